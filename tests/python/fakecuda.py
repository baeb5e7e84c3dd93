"""The record the fake CUDA driver keeps (tests/c/fake_cuda.h,
fake_cuda_stats), for test processes that load it with ctypes."""

import ctypes
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def path() -> Path:
    """Where make build puts the fake driver: beside the libraries."""
    return Path(os.environ.get("TSOCK_LIBRARY_DIR", ROOT / "build")) / "libtsock_fake_cuda.so"


_INT = ctypes.c_int
_FIELDS = [
    ("init_calls", _INT),
    ("registers", _INT),
    ("register_failures", _INT),
    ("registered_now", _INT),
    ("last_register_addr", ctypes.c_void_p),
    ("last_register_len", ctypes.c_size_t),
    ("last_register_flags", ctypes.c_uint),
    ("last_register_device", _INT),
    ("unregisters", _INT),
    ("unregister_failures", _INT),
    ("last_unregister_addr", ctypes.c_void_p),
    ("unregistered_after_unmap", _INT),
    ("calls_without_context", _INT),
    ("retains", _INT),
    ("releases", _INT),
    ("release_underflows", _INT),
    ("primary_refs", _INT),
    ("allocs", _INT),
    ("frees", _INT),
    ("ipc_opens", _INT),
    ("ipc_closes", _INT),
    ("copies", _INT),
    ("copy_bytes", ctypes.c_ulonglong),
    ("stream_waits", _INT),
    ("events_recorded", _INT),
    ("ctx_syncs", _INT),
    ("events_live", _INT),
    ("streams_live", _INT),
    ("injected_failures", _INT),
]


class Stats(ctypes.Structure):
    _fields_ = _FIELDS


def reader(fake: ctypes.CDLL):
    """stats() for a loaded fake driver."""

    def stats() -> Stats:
        s = Stats()
        fake.fake_cuda_query(ctypes.byref(s))
        return s

    return stats
