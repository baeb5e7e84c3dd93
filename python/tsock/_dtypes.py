"""The dtypes a channel carries, and their numpy and torch forms.

The wire dtypes are tsock_dtype of include/tsock.h. numpy has no bfloat16 of
its own: ml_dtypes (a dependency of JAX) provides one, and is used when it can
be imported.
"""

from __future__ import annotations

import sys

import numpy as np

from . import _capi
from .errors import UnsupportedDtype

NAMES = {
    _capi.DTYPE_BOOL: "bool",
    _capi.DTYPE_INT8: "int8",
    _capi.DTYPE_INT16: "int16",
    _capi.DTYPE_INT32: "int32",
    _capi.DTYPE_INT64: "int64",
    _capi.DTYPE_UINT8: "uint8",
    _capi.DTYPE_UINT16: "uint16",
    _capi.DTYPE_UINT32: "uint32",
    _capi.DTYPE_UINT64: "uint64",
    _capi.DTYPE_FLOAT16: "float16",
    _capi.DTYPE_BFLOAT16: "bfloat16",
    _capi.DTYPE_FLOAT32: "float32",
    _capi.DTYPE_FLOAT64: "float64",
}
ITEMSIZE = {
    _capi.DTYPE_BOOL: 1,
    _capi.DTYPE_INT8: 1,
    _capi.DTYPE_INT16: 2,
    _capi.DTYPE_INT32: 4,
    _capi.DTYPE_INT64: 8,
    _capi.DTYPE_UINT8: 1,
    _capi.DTYPE_UINT16: 2,
    _capi.DTYPE_UINT32: 4,
    _capi.DTYPE_UINT64: 8,
    _capi.DTYPE_FLOAT16: 2,
    _capi.DTYPE_BFLOAT16: 2,
    _capi.DTYPE_FLOAT32: 4,
    _capi.DTYPE_FLOAT64: 8,
}
SUPPORTED = ", ".join(NAMES.values())

# numpy dtype -> wire code, native byte order. bfloat16 is added on demand.
FROM_NUMPY = {np.dtype(name): code for code, name in NAMES.items() if name != "bfloat16"}
# wire code -> numpy dtype; bfloat16 filled by _bfloat16().
TO_NUMPY = {code: dt for dt, code in FROM_NUMPY.items()}


def _bfloat16() -> np.dtype | None:
    """numpy's bfloat16 from ml_dtypes, or None when it is not installed."""
    dt = TO_NUMPY.get(_capi.DTYPE_BFLOAT16)
    if dt is not None:
        return dt
    try:
        import ml_dtypes
    except ImportError:
        return None
    dt = np.dtype(ml_dtypes.bfloat16)
    TO_NUMPY[_capi.DTYPE_BFLOAT16] = dt
    FROM_NUMPY[dt] = _capi.DTYPE_BFLOAT16
    return dt


def code_of_numpy(dtype: np.dtype, where: str) -> int:
    """The wire code of a numpy dtype; UnsupportedDtype names the leaf."""
    code = FROM_NUMPY.get(dtype)
    if code is not None:
        return code
    if dtype.name == "bfloat16" and "ml_dtypes" in sys.modules and _bfloat16() == dtype:
        return _capi.DTYPE_BFLOAT16
    if not dtype.isnative:
        # Big-endian data is converted while it is copied into the slot.
        code = FROM_NUMPY.get(dtype.newbyteorder("="))
        if code is not None:
            return code
    raise UnsupportedDtype(f"{where} has dtype {dtype}, which tsock cannot carry; supported: {SUPPORTED}", _capi.EDTYPE)


def numpy_dtype(code: int) -> np.dtype:
    """The numpy dtype of a wire code (bfloat16 needs ml_dtypes)."""
    dt = TO_NUMPY.get(code)
    if dt is not None:
        return dt
    if code == _capi.DTYPE_BFLOAT16:
        dt = _bfloat16()
        if dt is not None:
            return dt
        raise UnsupportedDtype(
            "the channel carries bfloat16, which numpy has only through ml_dtypes (pip install ml_dtypes); "
            "or use output='torch' or 'jax'",
            _capi.EDTYPE,
        )
    raise UnsupportedDtype(f"unknown wire dtype {code}", _capi.EDTYPE)


def numpy_storage_dtype(code: int) -> np.dtype:
    """A numpy dtype of the same size to move a tensor's bytes, for code that
    only copies bytes: bfloat16 as int16, which torch.from_numpy takes (old
    torch has no uint16) and .view(torch.bfloat16) turns back."""
    if code == _capi.DTYPE_BFLOAT16:
        return np.dtype(np.int16)
    return TO_NUMPY[code]
