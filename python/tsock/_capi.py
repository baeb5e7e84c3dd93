"""ctypes declarations of include/tsock.h.

This module mirrors the C header one to one and nothing else; the Python API
lives in the modules beside it. The library is found, in order: the
TSOCK_LIBRARY_DIR environment variable, the package's own _lib folder (where
`pip install` puts it), the repository's build folder.

The constants below restate the header's #defines and enums by hand (an
installed wheel carries no tsock.h to read them from), under the header's
names less TSOCK_; tests/python/test_capi.py fails when a name or a value
differs, or is missing on either side.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from pathlib import Path

VERSION_MAJOR = 0
VERSION_MINOR = 1
NAME_MAX = 64
MAX_DIMS = 8
MAX_TENSORS = 16
META_MAX = 256
MAX_HELD = 64
BATCH_EPOCH_END = 0x1
START_NEXT_EPOCH = 0
START_NOW = 1
START_OLDEST = 2
# The producer's option defaults (TSOCK_DEFAULT_*), written once in
# producer/defaults.h; this mirror lets Producer check its arguments before
# it starts a Pipeline's workers or loads libtsock.so, and
# tests/python/test_capi.py fails when the two differ.
PRODUCER_DEFAULTS = {"SLOT_COUNT": 16, "SLOT_BYTES": 1 << 20, "MAX_READERS": 64, "MODE": 0o600}

# Status codes (tsock_status).
OK = 0
EAGAIN = -1
EINVAL = -2
EHANDLE = -3
ENAME = -4
ENOENT = -5
EEXIST = -6
EVERSION = -7
ECORRUPT = -8
EPRODUCER_GONE = -9
ECLOSED = -10
EFULL = -11
EBACKPRESSURE = -12
ETIMEDOUT = -13
ETOOBIG = -14
EDTYPE = -15
EEVICTED = -16
ESTATE = -17
EPERM = -18
ESYS = -19
EFORKED = -20
ENOMEM = -21
ENOCUDA = -22
ENODEVICE = -23

CUDA_SYNC = 0x1  # tsock_batch_cuda_use: the host waits instead of a stream

# Flags of tsock_batch_dlpack_export.
DLPACK_VERSIONED = 0x1  # DLManagedTensorVersioned (read-only flag), else legacy
DLPACK_DEVICE = 0x2  # the device copy (kDLCUDA), else host memory
DLPACK_BOOL_AS_UINT8 = 0x4  # booleans described as uint8 (consumers without kDLBool)
DLPACK_ROWS = 0x8  # rows [row_start, row_stop) of the first dimension only

# Dtypes (tsock_dtype).
DTYPE_BOOL = 1
DTYPE_INT8 = 2
DTYPE_INT16 = 3
DTYPE_INT32 = 4
DTYPE_INT64 = 5
DTYPE_UINT8 = 6
DTYPE_UINT16 = 7
DTYPE_UINT32 = 8
DTYPE_UINT64 = 9
DTYPE_FLOAT16 = 10
DTYPE_BFLOAT16 = 11
DTYPE_FLOAT32 = 12
DTYPE_FLOAT64 = 13


class Tensor(ctypes.Structure):
    _fields_ = [
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
        ("offset", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint64),
        ("data", ctypes.c_void_p),
    ]


# tsock_tensor_t as struct packs it (the producer fills descriptors in place,
# the reader unpacks them); test_capi.py checks it against Tensor.
TENSOR_STRUCT = struct.Struct(f"<ii{MAX_DIMS}q{MAX_DIMS}qQQQ")


class Batch(ctypes.Structure):
    _fields_ = [
        ("seq", ctypes.c_uint64),
        ("epoch", ctypes.c_uint64),
        ("index", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("n_tensors", ctypes.c_uint32),
        ("tensors", ctypes.POINTER(Tensor)),
        ("meta", ctypes.c_void_p),
        ("meta_len", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("publish_ns", ctypes.c_uint64),
        ("payload", ctypes.c_void_p),
        ("payload_capacity", ctypes.c_uint64),
        ("dlpack_live", ctypes.POINTER(ctypes.c_uint32)),
    ]


class ReaderOptions(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("start", ctypes.c_int32),
        ("attach_timeout_ns", ctypes.c_int64),
        ("max_held", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("spin_ns", ctypes.c_int64),
    ]


class ProducerOptions(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("slot_count", ctypes.c_uint32),
        ("slot_bytes", ctypes.c_uint64),
        ("max_readers", ctypes.c_uint32),
        ("mode", ctypes.c_uint32),
        ("gid", ctypes.c_int64),
        ("evict_after_ns", ctypes.c_int64),
        ("join_window", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("cuda_device", ctypes.c_int32),
        ("reserved2", ctypes.c_uint32),
    ]


class ProducerStats(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("readers", ctypes.c_uint32),
        ("published", ctypes.c_uint64),
        ("epoch", ctypes.c_uint64),
        ("backpressure_ns", ctypes.c_uint64),
        ("readers_reclaimed", ctypes.c_uint64),
        ("readers_evicted", ctypes.c_uint64),
    ]


class Peek(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("published", ctypes.c_uint64),
        ("seq", ctypes.c_uint64),
        ("epoch", ctypes.c_uint64),
        ("index", ctypes.c_uint64),
        ("producer_alive", ctypes.c_uint32),
        ("meta_len", ctypes.c_uint32),
        ("meta", ctypes.c_uint8 * META_MAX),
    ]


_P = ctypes.c_void_p
_I = ctypes.c_int

_COMMON = {
    "tsock_status_str": (ctypes.c_char_p, [_I]),
    "tsock_last_error": (ctypes.c_char_p, []),
    "tsock_dtype_size": (ctypes.c_size_t, [_I]),
    "tsock_tensor_init": (_I, [ctypes.POINTER(Tensor), _I, _I, ctypes.POINTER(ctypes.c_int64), ctypes.c_uint64]),
    "tsock_reader_options_init": (None, [ctypes.POINTER(ReaderOptions)]),
    "tsock_reader_attach": (_I, [ctypes.c_char_p, ctypes.POINTER(ReaderOptions), ctypes.POINTER(_P)]),
    "tsock_reader_acquire": (_I, [_P, ctypes.POINTER(ctypes.POINTER(Batch)), ctypes.c_int64]),
    "tsock_reader_release": (_I, [_P, ctypes.POINTER(Batch)]),
    "tsock_reader_payload_range": (_I, [_P, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint64)]),
    "tsock_reader_check": (_I, [_P]),
    "tsock_reader_detach": (_I, [_P]),
    "tsock_batch_dlpack": (_I, [ctypes.POINTER(Batch), ctypes.c_uint32, _I, ctypes.POINTER(_P)]),
    "tsock_batch_dlpack_export": (
        _I,
        [ctypes.POINTER(Batch), ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(_P)],
    ),
    "tsock_dlpack_delete": (_I, [_P, _I]),
    "tsock_reader_pin_mapping": (_I, [_P, ctypes.POINTER(_P)]),
    "tsock_mapping_unpin": (_I, [_P]),
    "tsock_reader_register_host": (_I, [_P]),
    "tsock_reader_open_device": (_I, [_P, ctypes.POINTER(ctypes.c_int32)]),
    "tsock_reader_device_range": (_I, [_P, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]),
    "tsock_batch_cuda_ptr": (_I, [ctypes.POINTER(Batch), ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64)]),
    "tsock_batch_cuda_use": (_I, [ctypes.POINTER(Batch), ctypes.c_size_t, ctypes.c_uint32]),
    "tsock_batch_dlpack_cuda": (_I, [ctypes.POINTER(Batch), ctypes.c_uint32, _I, ctypes.POINTER(_P)]),
    "tsock_batch_keep": (_I, [_P, ctypes.POINTER(Batch), ctypes.c_uint32, ctypes.POINTER(ctypes.POINTER(Batch))]),
    "tsock_batch_free": (_I, [ctypes.POINTER(Batch)]),
    "tsock_batch_pin": (_I, [_P, ctypes.POINTER(Batch), ctypes.POINTER(_P)]),
}

_PRODUCER = {
    "tsock_producer_options_init": (None, [ctypes.POINTER(ProducerOptions)]),
    "tsock_producer_create": (_I, [ctypes.c_char_p, ctypes.POINTER(ProducerOptions), ctypes.POINTER(_P)]),
    "tsock_producer_reserve": (_I, [_P, ctypes.c_uint64, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p)]),
    "tsock_producer_publish": (_I, [_P, ctypes.POINTER(Tensor), ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32]),
    "tsock_producer_abort": (_I, [_P]),
    "tsock_producer_end_epoch": (_I, [_P, ctypes.c_int64]),
    "tsock_producer_wait_readers": (_I, [_P, ctypes.c_uint32, ctypes.c_int64]),
    "tsock_producer_stats": (_I, [_P, ctypes.POINTER(ProducerStats)]),
    "tsock_producer_reader_pids": (
        _I,
        [_P, ctypes.POINTER(ctypes.c_int32), ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)],
    ),
    "tsock_producer_close": (_I, [_P]),
    "tsock_producer_peek": (_I, [ctypes.c_char_p, ctypes.c_uint64, ctypes.POINTER(Peek)]),
}


def library_dirs() -> list[Path]:
    """Folders searched for the libraries, in order."""
    dirs = []
    env = os.environ.get("TSOCK_LIBRARY_DIR")
    if env:
        dirs.append(Path(env))
    here = Path(__file__).resolve().parent
    dirs.append(here / "_lib")
    dirs.append(here.parent.parent / "build")
    return dirs


def _find(filename: str) -> Path:
    for d in library_dirs():
        if (d / filename).is_file():
            return d / filename
    searched = ", ".join(str(d) for d in library_dirs())
    raise OSError(f"{filename} not found (searched {searched}); build it with `make build`")


def _declare(lib: ctypes.CDLL, table: dict) -> None:
    for name, (restype, argtypes) in table.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def once(make):
    """A function that returns make(), called at the first call only (under a
    lock: two threads never load a library twice)."""
    made = []
    lock = threading.Lock()

    def get():
        with lock:
            if not made:
                made.append(make())
            return made[0]

    return get


def load(reader_only: bool = False) -> ctypes.CDLL:
    """Loads libtsock_reader.so (reader_only) or libtsock.so with plain
    ctypes.CDLL and declares its functions."""
    lib = ctypes.CDLL(str(_find("libtsock_reader.so" if reader_only else "libtsock.so")))
    _declare(lib, _COMMON)
    if not reader_only:
        _declare(lib, _PRODUCER)
    return lib
