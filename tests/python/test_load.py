"""Both libraries load with plain ctypes.CDLL (RTLD_NOW semantics are
checked by the C test test_load) and answer through the C ABI."""

import ctypes
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from c_roundtrip import roundtrip  # noqa: E402
from tsock import _capi  # noqa: E402


@pytest.mark.parametrize("reader_only", [True, False])
def test_cdll_loads_and_reports_missing_channel(reader_only):
    lib = _capi.load(reader_only=reader_only)
    assert lib.tsock_status_str(-5) == b"no such channel"
    handle = ctypes.c_void_p()
    rc = lib.tsock_reader_attach(f"missing-{os.getpid()}".encode(), None, ctypes.byref(handle))
    assert rc == -5
    assert b"no channel" in lib.tsock_last_error()
    assert handle.value is None  # out-parameter untouched on error


def test_rtld_now_load():
    for name in ("libtsock_reader.so", "libtsock.so"):
        path = _capi._find(name)
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW)
        assert lib.tsock_dtype_size(12) == 4  # float32


def test_producer_roundtrip_through_ctypes():
    lib = _capi.load()
    prod, reader = roundtrip(_capi, lib, lib, f"pytest-{os.getpid()}".encode(), 1_000_000_000)
    assert lib.tsock_reader_detach(reader) == -3  # closed handle: TSOCK_EHANDLE
    assert lib.tsock_producer_close(prod) == -3
