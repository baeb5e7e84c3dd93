"""Both libraries load with plain ctypes.CDLL (RTLD_NOW semantics are
checked by the C test test_load) and answer through the C ABI."""

import ctypes
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

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
    name = f"pytest-{os.getpid()}".encode()
    opts = _capi.ProducerOptions()
    lib.tsock_producer_options_init(ctypes.byref(opts))
    opts.slot_count, opts.slot_bytes = 4, 4096
    prod = ctypes.c_void_p()
    assert lib.tsock_producer_create(name, ctypes.byref(opts), ctypes.byref(prod)) == 0, lib.tsock_last_error()
    try:
        reader = ctypes.c_void_p()
        assert lib.tsock_reader_attach(name, None, ctypes.byref(reader)) == 0, lib.tsock_last_error()
        buf = ctypes.c_void_p()
        assert lib.tsock_producer_reserve(prod, 16, 0, ctypes.byref(buf)) == 0
        ctypes.memmove(buf, (ctypes.c_float * 4)(1.5, 2.5, 3.5, 4.5), 16)
        t = _capi.Tensor(dtype=12, ndim=1)
        t.shape[0], t.strides[0], t.nbytes = 4, 1, 16
        assert lib.tsock_producer_publish(prod, ctypes.byref(t), 1, None, 0) == 0, lib.tsock_last_error()
        batch = ctypes.POINTER(_capi.Batch)()
        assert lib.tsock_reader_acquire(reader, ctypes.byref(batch), 1_000_000_000) == 0
        got = batch.contents.tensors[0]
        assert list((ctypes.c_float * 4).from_address(got.data)) == [1.5, 2.5, 3.5, 4.5]
        assert lib.tsock_reader_release(reader, batch) == 0
        assert lib.tsock_reader_detach(reader) == 0
        assert lib.tsock_reader_detach(reader) == -3  # closed handle: TSOCK_EHANDLE
    finally:
        assert lib.tsock_producer_close(prod) == 0
    assert lib.tsock_producer_close(prod) == -3
