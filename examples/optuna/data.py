"""The input pipeline of the Optuna study (study.py), as two factories that
do the same work on the same labelled JPEG images (examples/python/
shapes_data.py): decode, random resized crop to 40x40, random flip,
normalise, batch.

- make_pipeline(...) returns a tsock.Pipeline: its order is a pure function
  of the seed, so a shared producer that dies is replaced by one that
  resumes exactly where it stopped (docs/SHARED.md).
- make_loader(...) returns a plain torch DataLoader over the same stages:
  what each trial runs on its own without tsock (the study's baseline).

Both are importable module-level functions: tsock.shared() runs the factory
in its own producer process, which imports it by name.
"""

from __future__ import annotations

import io
import math
import random
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import shapes_data  # noqa: E402  (examples/python: the dataset's generator)

CROP = shapes_data.CROP
# The stored JPEGs' side: decoding them is most of the pipeline's work
# (~2 ms a sample here, against ~0.5 ms for a training step of the small
# CNN on the CPU), as on a GPU node, where the CPU's work is the pipeline.
SIZE = 384


def dataset(root: str, split: str, n: int) -> list[tuple[str, int]]:
    """(path, label) of the first n images of a split, generated under root
    on first use (deterministic, cached)."""
    folder = shapes_data.ensure_dataset(Path(root), n if split == "train" else 0, n if split == "val" else 0, size=SIZE)
    return shapes_data.list_split(folder, split, n)


# ---- the stages (what a trial's DataLoader and the shared pipeline both run) ----


def read(item: tuple[str, int]) -> tuple[bytes, int]:
    """I/O: the JPEG's bytes and the label."""
    path, label = item
    with open(path, "rb") as f:
        return f.read(), label


def decode(sample: tuple[bytes, int]) -> tuple[Image.Image, int]:
    """Deterministic: the decoded RGB image."""
    data, label = sample
    with Image.open(io.BytesIO(data)) as f:
        return f.convert("RGB"), label


def augment(sample: tuple[Image.Image, int], rng) -> tuple[np.ndarray, int]:
    """Random resized crop (scale 0.5-1, ratio 3/4-4/3) to CROP x CROP,
    random horizontal flip, normalise to float32 CHW. rng: anything with
    random() (numpy's Generator in the pipeline, Python's random module in
    the DataLoader)."""
    img, label = sample
    w, h = img.size
    cw, ch = w, h
    for _ in range(10):
        area = w * h * (0.5 + 0.5 * rng.random())
        ratio = math.exp(math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * rng.random())
        cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if cw <= w and ch <= h:
            break
    else:
        cw, ch = w, h
    x0, y0 = int(rng.random() * (w - cw + 1)), int(rng.random() * (h - ch + 1))
    img = img.resize((CROP, CROP), Image.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return shapes_data.to_tensor(img), label


def collate(samples: list) -> tuple[np.ndarray, np.ndarray]:
    return np.stack([x for x, _ in samples]), np.array([y for _, y in samples], np.int64)


# ---- the two factories ----


def make_pipeline(root: str, n: int, batch_size: int = 64, seed: int = 0, workers: int = 2):
    """The training split as a tsock.Pipeline (exact resume after a crash)."""
    import tsock

    return tsock.Pipeline(
        dataset(root, "train", n),
        batch_size=batch_size,
        read=read,
        decode=decode,
        augment=augment,
        collate=collate,
        seed=seed,
        shuffle=True,
        workers=workers,
    )


class _Train:
    """The same stages as a map-style torch Dataset (Python's random module
    as the random source, seeded per worker by torch)."""

    def __init__(self, items):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return augment(decode(read(self.items[i])), random)


def _torch_collate(samples: list):
    import torch

    return tuple(torch.from_numpy(a) for a in collate(samples))


def make_loader(root: str, n: int, batch_size: int = 64, seed: int = 0, workers: int = 2):
    """The training split as a plain torch DataLoader (the baseline)."""
    import torch
    from torch.utils.data import DataLoader

    gen = torch.Generator()
    gen.manual_seed(seed)
    return DataLoader(
        _Train(dataset(root, "train", n)),
        batch_size=batch_size,
        shuffle=True,
        generator=gen,
        num_workers=workers,
        collate_fn=_torch_collate,
        persistent_workers=workers > 0,
    )


def validation(root: str, n: int):
    """The held-out split, whole images resized to CROP x CROP: (x, y) torch
    tensors, small enough to evaluate in one pass."""
    import torch

    xs, ys = [], []
    for path, label in dataset(root, "val", n):
        with Image.open(path) as f:
            xs.append(shapes_data.to_tensor(f.convert("RGB").resize((CROP, CROP), Image.BILINEAR)))
        ys.append(label)
    return torch.from_numpy(np.stack(xs)), torch.tensor(ys)
