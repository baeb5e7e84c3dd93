"""Turning batch leaves into numpy arrays, torch tensors or JAX arrays.

Each output kind makes two things:
  view(reader, raw, i, start, stop)  rows [start, stop) of leaf i of a held
                                     batch, zero-copy (copy=True: a copy);
  owned(array, code)                 an array the consumer assembled (rows
                                     gathered across batches), as the output.
Assembling happens in numpy, in storage_dtype(code).
"""

from __future__ import annotations

import numpy as np

from . import _capi, _dtypes
from ._dlpack import DLPackTensor, capsule
from ._reader import CODE, DATA, NBYTES, SHAPE, STRIDES

_NUMPY = _dtypes.TO_NUMPY  # wire code -> numpy dtype, for the hot path

# (shape, strides) -> element count if C-contiguous, else -1; batches repeat
# their shapes, so this is a dict hit after the first batch.
_counts: dict[tuple, int] = {}


def _contiguous_count(shape: tuple, strides: tuple) -> int:
    key = (shape, strides)
    count = _counts.get(key)
    if count is None:
        count = 1
        for n, s in zip(reversed(shape), reversed(strides)):
            if n != 1 and s != count:
                count = -1
                break
            count *= n
        if count != -1:
            count = 1
            for n in shape:
                count *= n
        if len(_counts) < 4096:
            _counts[key] = count
    return count


def numpy_view(mem, leaf, dtype: np.dtype, start=None, stop=None) -> np.ndarray:
    """A read-only numpy array over rows [start, stop) of a leaf, in place,
    over the memory it lies in (a Memory). Its base is a read-only buffer,
    so flags.writeable cannot be set."""
    return _array(mem.view, leaf[DATA] - mem.base, leaf, dtype, start, stop)


def _array(buf, offset: int, leaf, dtype: np.dtype, start, stop) -> np.ndarray:
    shape = leaf[SHAPE]
    strides = leaf[STRIDES]
    if start is not None:
        offset += start * strides[0] * dtype.itemsize
        shape = (stop - start,) + shape[1:]
    count = _contiguous_count(shape, strides)
    if count >= 0:
        return np.frombuffer(buf, dtype, count, offset).reshape(shape)
    item = dtype.itemsize
    return np.ndarray(shape, dtype, buffer=buf, offset=offset, strides=[s * item for s in strides])


def kept_view(raw, i: int, dtype: np.dtype, start=None, stop=None) -> np.ndarray:
    """numpy_view for lifetime="referenced": the array is a view of a flat
    array of leaf i (its exporter, made once per batch and kept in
    raw.exporters), whose reference count then says whether any array of
    the leaf is alive (see _lifetime): numpy's base chain of every view of
    it ends there. As cheap as numpy_view: one frombuffer, one view."""
    leaf = raw.leaves[i]
    shape = leaf[SHAPE]
    count = _contiguous_count(shape, leaf[STRIDES])
    ex = raw.exporters
    if ex is None:
        ex = raw.exporters = [None] * len(raw.leaves)
    e = ex[i]
    if e is None:
        mem = raw.mem
        offset = leaf[DATA] - mem.base
        if count >= 0:
            e = np.frombuffer(mem.view, dtype, count, offset)
        else:
            e = np.frombuffer(mem.view, np.uint8, leaf[NBYTES], offset)
        ex[i] = e
    if count < 0:
        return _array(e, 0, leaf, dtype, start, stop)
    if start is None:
        return e.reshape(shape)
    row = count // shape[0]
    return e[start * row : stop * row].reshape((stop - start,) + shape[1:])


def handed_out(raw, obj):
    """Records a DLPackTensor handed out (lifetime="referenced"): until it
    is consumed, it refers to its leaf."""
    ex = raw.exporters
    if ex is None:
        ex = raw.exporters = [None] * len(raw.leaves)
    ex.append(obj)
    return obj


class NumpyOutput:
    """numpy arrays, built straight from the descriptors over a read-only
    view of the mapping (flags.writeable is False and cannot be set)."""

    name = "numpy"

    def __init__(self, copy: bool):
        self.copy = copy

    def storage_dtype(self, code: int) -> np.dtype:
        return _dtypes.numpy_dtype(code)

    def view(self, reader, raw, i: int, start=None, stop=None):
        leaf = raw.leaves[i]
        dtype = _NUMPY.get(leaf[CODE]) or _dtypes.numpy_dtype(leaf[CODE])
        if self.copy:
            return numpy_view(raw.mem, leaf, dtype, start, stop).copy()
        if reader.keeping:
            return kept_view(raw, i, dtype, start, stop)
        return numpy_view(raw.mem, leaf, dtype, start, stop)

    def views(self, reader, raw) -> list:
        """Every leaf of a whole batch, as view() makes them, in one pass
        (the hot path of the plain loop)."""
        if self.copy:
            return [self.view(reader, raw, i) for i in range(len(raw.leaves))]
        mem = raw.mem
        buf, base = mem.view, mem.base
        ex = [] if reader.keeping else None
        out = []
        for leaf in raw.leaves:
            dtype = _NUMPY.get(leaf[CODE]) or _dtypes.numpy_dtype(leaf[CODE])
            shape = leaf[SHAPE]
            count = _counts.get((shape, leaf[STRIDES]))
            if count is None:
                count = _contiguous_count(shape, leaf[STRIDES])
            if count >= 0:
                e = np.frombuffer(buf, dtype, count, leaf[DATA] - base)
                out.append(e.reshape(shape))
            elif ex is None:
                out.append(_array(buf, leaf[DATA] - base, leaf, dtype, None, None))
                continue
            else:
                e = np.frombuffer(buf, np.uint8, leaf[NBYTES], leaf[DATA] - base)
                out.append(_array(e, 0, leaf, dtype, None, None))
            if ex is not None:
                ex.append(e)  # kept_view's exporter of the leaf
        if ex is not None:
            raw.exporters = ex
        return out

    def owned(self, arr: np.ndarray, code: int):
        if not self.copy:
            # Read-only like every other batch, so code that writes to a
            # batch fails the same way whatever the batch boundaries.
            arr.flags.writeable = False
        return arr


class TorchOutput:
    """torch tensors through DLPack (torch.utils.dlpack.from_dlpack), wrapped
    in ReadOnlyTensor unless copy=True."""

    name = "torch"

    def __init__(self, copy: bool):
        import torch
        import torch.utils.dlpack

        from . import _torch

        self.copy = copy
        self._torch = torch
        # The C function under torch.utils.dlpack.from_dlpack, for capsules.
        self._from_dlpack = getattr(torch._C, "_from_dlpack", torch.utils.dlpack.from_dlpack)
        self._mod = _torch

    def storage_dtype(self, code: int) -> np.dtype:
        self._mod.torch_dtype(code, _dtypes.NAMES)  # fails early if torch lacks it
        return _dtypes.numpy_storage_dtype(code)

    def tensor(self, reader, raw, i: int, start=None, stop=None):
        """Rows [start, stop) of leaf i as a plain torch tensor over shared
        memory (unprotected: for internal use, such as copies to a GPU)."""
        code = raw.leaves[i][CODE]
        if code not in self._mod.TO_TORCH:
            self._mod.torch_dtype(code, _dtypes.NAMES)  # raises UnsupportedDtype
        # torch 1.13 knows no kDLBool: booleans travel as uint8, viewed back.
        rows = None if start is None else (start, stop)
        t = self._from_dlpack(capsule(reader.lib, raw.lease, i, False, code == _capi.DTYPE_BOOL, rows))
        if code == _capi.DTYPE_BOOL:
            t = t.view(self._torch.bool)
        return t

    def view(self, reader, raw, i: int, start=None, stop=None):
        t = self.tensor(reader, raw, i, start, stop)
        if self.copy:
            return t.clone()
        return t.as_subclass(self._mod.ReadOnlyTensor)

    def owned_tensor(self, arr: np.ndarray, code: int):
        """A plain torch tensor over an assembled numpy array."""
        t = self._torch.from_numpy(arr)
        if code == _capi.DTYPE_BFLOAT16:
            t = t.view(self._torch.bfloat16)
        return t

    def owned(self, arr: np.ndarray, code: int):
        t = self.owned_tensor(arr, code)
        # Already a private copy: copy=True needs no second one.
        return t if self.copy else self._mod.protect(t)


class JaxOutput:
    """JAX arrays through the public DLPack import (jax.dlpack.from_dlpack of
    a DLPackTensor), zero-copy where XLA takes the memory as it is: JAX
    newer than 0.4.30 copies data that do not start on a 64-byte boundary
    (re-batched slices at such offsets). JAX without jax_enable_x64 turns
    64-bit dtypes into 32-bit ones (a copy), as jnp.asarray does."""

    name = "jax"

    def __init__(self, copy: bool):
        import jax.dlpack
        import jax.numpy as jnp

        self.copy = copy
        self._jnp = jnp
        self._from_dlpack = jax.dlpack.from_dlpack

    def storage_dtype(self, code: int) -> np.dtype:
        return _dtypes.numpy_dtype(code)  # JAX depends on ml_dtypes: bfloat16 is there

    def view(self, reader, raw, i: int, start=None, stop=None):
        if self.copy:
            leaf = raw.leaves[i]
            return self._jnp.array(numpy_view(raw.mem, leaf, _dtypes.numpy_dtype(leaf[CODE]), start, stop))
        # The array API's protocol: JAX >= 0.7.2 takes no bare capsules.
        return self._from_dlpack(DLPackTensor(reader.lib, raw.lease, i, None if start is None else (start, stop)))

    def owned(self, arr: np.ndarray, code: int):
        return self._jnp.asarray(arr)


class DLPackOutput:
    """DLPackTensor objects: the batch for any framework with from_dlpack
    (cupy, numpy, torch, JAX, ...). Batches assembled across producer
    batches are read-only numpy arrays, which speak DLPack too. With cuda
    (an ordinal on the device path) the objects export the device copy."""

    name = "dlpack"

    def __init__(self, copy: bool, cuda: int | None = None):
        if copy:
            raise ValueError("output='dlpack' exports shared memory; copy=True is for numpy, torch and jax outputs")
        self.copy = False
        self.cuda = cuda

    def storage_dtype(self, code: int) -> np.dtype:
        return _dtypes.numpy_dtype(code)

    def view(self, reader, raw, i: int, start=None, stop=None):
        obj = DLPackTensor(reader.lib, raw.lease, i, None if start is None else (start, stop), cuda=self.cuda)
        return handed_out(raw, obj) if reader.keeping else obj

    def owned(self, arr: np.ndarray, code: int):
        if self.cuda is not None:
            from .errors import NoDevicePath

            raise NoDevicePath(
                "output='dlpack' with a device cannot re-batch across producer batches (nothing here copies to the "
                "GPU): use a batch_size that divides the producer's, or output='torch' / 'jax'",
                _capi.ENODEVICE,
            )
        arr.flags.writeable = False
        return arr


OUTPUTS = {"numpy": NumpyOutput, "torch": TorchOutput, "jax": JaxOutput, "dlpack": DLPackOutput}
