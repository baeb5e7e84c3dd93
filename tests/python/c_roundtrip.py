"""One float32[4] batch from a producer to a reader through the raw C ABI
(ctypes, no tsock Python API): shared by test_load.py and, as source text
run inside a fresh venv, test_packaging.py. Imports only ctypes; _capi is
passed in."""

import ctypes


def roundtrip(_capi, lib, reader_lib, name: bytes, timeout_ns: int):
    """Publishes one batch with lib (libtsock.so) and reads it back with
    reader_lib; returns the (closed) producer and reader handles."""
    opts = _capi.ProducerOptions()
    lib.tsock_producer_options_init(ctypes.byref(opts))
    opts.slot_count, opts.slot_bytes = 4, 4096
    prod = ctypes.c_void_p()
    assert lib.tsock_producer_create(name, ctypes.byref(opts), ctypes.byref(prod)) == 0, lib.tsock_last_error()
    try:
        reader = ctypes.c_void_p()
        assert reader_lib.tsock_reader_attach(name, None, ctypes.byref(reader)) == 0, reader_lib.tsock_last_error()
        buf = ctypes.c_void_p()
        assert lib.tsock_producer_reserve(prod, 16, 0, ctypes.byref(buf)) == 0
        ctypes.memmove(buf, (ctypes.c_float * 4)(1.5, 2.5, 3.5, 4.5), 16)
        t = _capi.Tensor(dtype=12, ndim=1)
        t.shape[0], t.strides[0], t.nbytes = 4, 1, 16
        assert lib.tsock_producer_publish(prod, ctypes.byref(t), 1, None, 0) == 0, lib.tsock_last_error()
        batch = ctypes.POINTER(_capi.Batch)()
        assert reader_lib.tsock_reader_acquire(reader, ctypes.byref(batch), timeout_ns) == 0
        got = list((ctypes.c_float * 4).from_address(batch.contents.tensors[0].data))
        assert got == [1.5, 2.5, 3.5, 4.5], got
        assert reader_lib.tsock_reader_release(reader, batch) == 0
        assert reader_lib.tsock_reader_detach(reader) == 0
    finally:
        assert lib.tsock_producer_close(prod) == 0
    return prod, reader
