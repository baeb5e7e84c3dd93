"""default_collate: a list of samples to one batch, as torch's
default_collate does, without needing torch.

- numpy arrays: stacked along a new first dimension (np.stack);
- torch tensors: torch.stack (torch is imported already: the samples are
  its tensors);
- numpy scalars: an array of them (their dtype); Python bools, ints and
  floats: bool, int64 and float64 arrays;
- str and bytes: the list of them (tsock cannot publish those: keep them out
  of batches meant for a channel);
- dicts: a dict of the collated values (every sample must have the same
  keys); namedtuples, tuples and lists: the same type of the collated
  fields (every sample of the same length).

Differences from torch's: numpy arrays stay numpy arrays (torch's turns them
into tensors), and a plain tuple stays a tuple (torch's returns a list "for
backwards compatibility"). Mismatched shapes, dtypes, keys or lengths raise
a ValueError (TypeError for types it cannot collate) naming where in the
sample the difference is.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import numpy as np


def default_collate(samples):
    """The batch of `samples` (a non-empty sequence)."""
    samples = list(samples)
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    return _collate(samples, "sample")


def _collate(samples: list, path: str):
    first = samples[0]
    if isinstance(first, np.ndarray):
        return _stack_numpy(samples, path)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(first, torch.Tensor):
        return _stack_torch(torch, samples, path)
    if isinstance(first, np.generic):
        return _stack_numpy([np.asarray(s) for s in samples], path)
    if isinstance(first, bool):
        return _scalars(samples, bool, np.bool_, path)
    if isinstance(first, int):
        return _scalars(samples, int, np.int64, path)
    if isinstance(first, float):
        return _scalars(samples, (int, float), np.float64, path)
    if isinstance(first, (str, bytes)):
        return samples
    if isinstance(first, Mapping):
        return _collate_dict(samples, path)
    if isinstance(first, (tuple, list)):
        return _collate_sequence(samples, path)
    raise TypeError(
        f"default_collate cannot batch {path} of type {type(first).__name__}: it batches numpy arrays, torch tensors, "
        "numbers, strings and tuples, lists and dicts of them; pass collate= to Pipeline for other types"
    )


def _same_type(samples: list, kind, path: str) -> None:
    for i, s in enumerate(samples):
        if not isinstance(s, kind):
            raise TypeError(
                f"cannot collate {path}: sample 0 has a {type(samples[0]).__name__}, sample {i} a {type(s).__name__}"
            )


def _stack_numpy(samples: list, path: str) -> np.ndarray:
    first = samples[0]
    _same_type(samples, np.ndarray, path)
    pixel = _pixel_size(first)  # from the shape and dtype every sample shares (checked below)
    flipped = False
    for i, s in enumerate(samples):
        if s.shape != first.shape or s.dtype != first.dtype:
            raise ValueError(
                f"cannot collate {path}: sample 0 has shape {first.shape} and dtype {first.dtype}, "
                f"sample {i} has shape {s.shape} and dtype {s.dtype}"
            )
        # Any flipped sample, not only the first: a random flip leaves half
        # the batches with a first sample as it was.
        flipped = flipped or (pixel and _walks_pixels_back(s, pixel))
    if flipped and all(type(s) is np.ndarray for s in samples):
        out = np.empty((len(samples),) + first.shape, first.dtype)
        for i, s in enumerate(samples):
            _copy_pixels(out[i], s, pixel)
        return out
    return np.stack(samples)


# A sample whose last axis is a few contiguous bytes (an RGB pixel) in an
# axis walked backwards (x[:, ::-1], a horizontal flip) is copied by numpy
# one pixel's bytes at a time: 82 us for a 160x160x3 uint8 image against 2 us
# contiguous (numpy 2.5, this project's 2-vCPU VM). Viewed as one item of
# that many bytes per pixel, the same copy is one row of pixels at a time,
# about twice as fast. Other layouts numpy copies well enough as they are
# (a transposed image is slower through such a view), and small samples
# faster with np.stack than with a loop over them (review 45).
PIXEL_MAX = 16  # bytes: a larger last axis is copied fast enough as it is
SAMPLE_MIN = 4096  # bytes: a smaller sample is np.stack's


def _pixel_size(x: np.ndarray) -> int:
    """The bytes of a pixel (x's last axis, 2 to PIXEL_MAX bytes) where
    x's shape and dtype allow the pixel-item copy: a native numeric or
    bool dtype, at least two axes, SAMPLE_MIN bytes; else 0."""
    if x.ndim < 2 or x.nbytes < SAMPLE_MIN or x.dtype.kind not in "biufc" or not x.dtype.isnative:
        return 0  # np.stack's own dtype rules (byte order, padding) for anything else: review 44, 6
    n = x.shape[-1] * x.itemsize
    return n if 2 <= n <= PIXEL_MAX else 0


def _walks_pixels_back(x: np.ndarray, pixel: int) -> bool:
    """Whether x's last axis is one contiguous pixel and the axis before it
    walks the pixels backwards."""
    return x.strides[-1] == x.itemsize and x.strides[-2] == -pixel


def _copy_pixels(dst: np.ndarray, src: np.ndarray, pixel: int) -> None:
    """dst[...] = src, through views of one item per pixel where src's
    layout allows them (numpy refuses such a view of some layouts)."""
    if _walks_pixels_back(src, pixel):
        try:
            dst.view(f"V{pixel}")[...] = src.view(f"V{pixel}")
            return
        except ValueError:
            pass
    dst[...] = src


def _stack_torch(torch, samples: list, path: str):
    first = samples[0]
    _same_type(samples, torch.Tensor, path)
    for i, s in enumerate(samples):
        if s.shape != first.shape or s.dtype != first.dtype:
            raise ValueError(
                f"cannot collate {path}: sample 0 has shape {tuple(first.shape)} and dtype {first.dtype}, "
                f"sample {i} has shape {tuple(s.shape)} and dtype {s.dtype}"
            )
    return torch.stack(samples)


def _scalars(samples: list, kind, dtype, path: str) -> np.ndarray:
    _same_type(samples, kind, path)
    return np.array(samples, dtype=dtype)


def _collate_dict(samples: list, path: str) -> dict:
    keys = list(samples[0].keys())
    for i, s in enumerate(samples):
        if not isinstance(s, Mapping) or list(s.keys()) != keys:
            got = list(s.keys()) if isinstance(s, Mapping) else type(s).__name__
            raise ValueError(f"cannot collate {path}: sample 0 has keys {keys}, sample {i} has {got}")
    return {k: _collate([s[k] for s in samples], f"{path}[{k!r}]") for k in keys}


def _collate_sequence(samples: list, path: str):
    first = samples[0]
    for i, s in enumerate(samples):
        if type(s) is not type(first) or len(s) != len(first):
            raise ValueError(
                f"cannot collate {path}: sample 0 is a {type(first).__name__} of {len(first)}, "
                f"sample {i} a {type(s).__name__} of {len(s) if hasattr(s, '__len__') else '?'}"
            )
    fields = [_collate([s[j] for s in samples], f"{path}[{j}]") for j in range(len(first))]
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
        return type(first)(*fields)
    return tuple(fields) if isinstance(first, tuple) else fields
