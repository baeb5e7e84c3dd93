"""The reader half of the C ABI, one level up: attach and acquire in short
slices (so Ctrl-C is delivered promptly), batch descriptors parsed into
Python values, release and detach. Loads libtsock_reader.so, which has no Go
runtime, so trainer processes stay fork-safe.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading
import time
from collections import deque

import numpy as np

from . import _capi, _structure
from ._dlpack import Lease
from ._waiting import AttachProgress
from .errors import TsockError, check, error_for

# Waits are cut into slices this long: a signal (KeyboardInterrupt) is acted
# on when a C call returns to Python.
SLICE_NS = 100_000_000

_BATCH = struct.Struct("<QQQIIQQIIQ")  # tsock_batch_t
_TENSOR = struct.Struct("<ii8q8qQQQ")  # tsock_tensor_t
assert _BATCH.size == ctypes.sizeof(_capi.Batch) and _TENSOR.size == ctypes.sizeof(_capi.Tensor)

_P = ctypes.c_void_p
_lib = None
_lib_lock = threading.Lock()


class _Lib:
    """libtsock_reader.so, with the hot functions declared again taking
    plain addresses (c_void_p) rather than ctypes pointer objects: a batch is
    then an int, cheap to pass around."""

    def __init__(self, cdll):
        self.cdll = cdll
        self.acquire = self._fn("tsock_reader_acquire", [_P, ctypes.POINTER(_P), ctypes.c_int64])
        self.release = self._fn("tsock_reader_release", [_P, _P])
        self.dlpack = self._fn("tsock_batch_dlpack", [_P, ctypes.c_uint32, ctypes.c_int, ctypes.POINTER(_P)])
        self.dlpack_cuda = self._fn("tsock_batch_dlpack_cuda", [_P, ctypes.c_uint32, ctypes.c_int, ctypes.POINTER(_P)])
        self.cuda_use = self._fn("tsock_batch_cuda_use", [_P, ctypes.c_size_t, ctypes.c_uint32])

    def _fn(self, name, argtypes):
        fn = self.cdll._FuncPtr((name, self.cdll))
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
        return fn

    def __getattr__(self, name):
        return getattr(self.cdll, name)


def library() -> _Lib:
    """libtsock_reader.so, loaded once per process."""
    global _lib
    with _lib_lock:
        if _lib is None:
            _lib = _Lib(_capi.load(reader_only=True))
        return _lib


# A leaf (one tensor of an acquired batch) is a tuple, for speed:
# (wire dtype, shape, strides in elements, address of the first element, bytes).
CODE, SHAPE, STRIDES, DATA, NBYTES = range(5)


class Raw:
    """An acquired batch: its lease (for DLPack and release), its leaves and
    its layout; or an epoch-end marker (no leaves, `end` True)."""

    __slots__ = ("lease", "epoch", "index", "end", "leaves", "layout", "rows")

    def __init__(self, lease: Lease, epoch: int, index: int, end: bool, leaves: list, layout):
        self.lease = lease
        self.epoch = epoch
        self.index = index
        self.end = end
        self.leaves = leaves
        self.layout = layout
        self.rows = None  # shared first dimension, computed when re-batching


def _pinned_mapping(lib, handle, base: int, length: int):
    """A ctypes array over the payload mapping that holds a pin on it
    (tsock_reader_pin_mapping) until the array is garbage-collected."""
    token = ctypes.c_void_p()
    check(lib, lib.tsock_reader_pin_mapping(handle, ctypes.byref(token)), "pin mapping")
    unpin = lib.tsock_mapping_unpin

    class PinnedMapping(ctypes.c_char * length):
        def __del__(self):
            unpin(self.token)

    mapping = PinnedMapping.from_address(base)
    mapping.token = token
    return mapping


class Reader:
    """One attached reader handle. Not thread-safe: one thread at a time."""

    def __init__(self, name: str, start: int, timeout: float | None, max_held: int):
        lib = self.lib = library()
        opts = _capi.ReaderOptions()
        lib.tsock_reader_options_init(ctypes.byref(opts))
        opts.start = start
        opts.max_held = max_held
        handle = ctypes.c_void_p()
        deadline = None if timeout is None else time.monotonic() + timeout
        encoded = name.encode()
        progress = AttachProgress(name, timeout)
        while True:
            # Each attempt waits one slice at most; the loop gives Python a
            # chance to deliver KeyboardInterrupt between them.
            if deadline is None:
                opts.attach_timeout_ns = SLICE_NS
            else:
                left = deadline - time.monotonic()
                opts.attach_timeout_ns = max(0, min(SLICE_NS, int(left * 1e9)))
            rc = lib.tsock_reader_attach(encoded, ctypes.byref(opts), ctypes.byref(handle))
            if rc == _capi.OK:
                progress.attached()
                break
            retry = rc in (_capi.ENOENT, _capi.EPRODUCER_GONE, _capi.ETIMEDOUT)
            if not retry or (deadline is not None and time.monotonic() >= deadline):
                detail = lib.tsock_last_error().decode(errors="replace")
                if rc == _capi.ENOENT:
                    waited = "" if not timeout else f" after waiting {timeout:g} s"
                    detail = (
                        f"{detail}{waited}; is the producer running? "
                        "(a Producer creates its channel when it publishes its first batch)"
                    )
                raise error_for(rc, f"attach to channel '{name}': {detail}")
            progress.tick()
        self.handle = handle
        base = ctypes.c_void_p()
        length = ctypes.c_uint64()
        check(lib, lib.tsock_reader_payload_range(handle, ctypes.byref(base), ctypes.byref(length)), "payload range")
        self.base = base.value
        self.length = length.value
        # A read-only view of the payload mapping, for numpy arrays built
        # straight from descriptors (no DLPack round trip for numpy). numpy
        # keeps the memoryview (not the ctypes array) as the arrays' base, so
        # their writeable flag cannot be turned back on. The view pins the
        # mapping: an array kept after close() reads stale bytes instead of
        # faulting, and the mapping goes when the last array does.
        self.payload = memoryview(_pinned_mapping(lib, handle, self.base, self.length)).cast("B").toreadonly()
        self.payload_array = np.frombuffer(self.payload, np.uint8)
        self.held: deque[Lease] = deque()
        self._out = ctypes.c_void_p()
        self._out_ref = ctypes.byref(self._out)
        self._views: dict[int, tuple] = {}
        # Called before a batch is released and before detaching (the GPU
        # staging waits there for copies still reading held batches).
        self.on_release = None

    def acquire(self) -> Raw:
        """The next batch, waiting in slices without limit; raises
        ProducerGone, ChannelClosed, Evicted... when the stream ends."""
        acquire, handle, ref = self.lib.acquire, self.handle, self._out_ref
        while True:
            rc = acquire(handle, ref, SLICE_NS)
            if rc == _capi.OK:
                break
            if rc != _capi.EAGAIN:
                check(self.lib, rc, "acquire")
        addr = self._out.value
        views = self._views.get(addr)
        if views is None:
            views = self._views[addr] = self._map_held(addr)
        bview, tview, mview = views
        seq, epoch, index, flags, n, _, _, mlen, _, _ = _BATCH.unpack_from(bview)
        lease = Lease(addr, seq)
        self.held.append(lease)
        if flags & _capi.BATCH_EPOCH_END:
            return Raw(lease, epoch, index, True, [], None)
        leaves = []
        unpack = _TENSOR.unpack_from
        for i in range(n):
            f = unpack(tview, i * _TENSOR.size)
            nd = f[1]
            leaves.append((f[0], f[2 : 2 + nd], f[10 : 10 + nd], f[20], f[19]))
        return Raw(lease, epoch, index, False, leaves, _structure.decode(bytes(mview[:mlen]), n))

    def _map_held(self, addr: int):
        """Read views of a held batch's struct, its tensor descriptors and its
        metadata. The reader keeps max_held of them at fixed addresses, so
        the views are made once per address."""
        bview = memoryview((ctypes.c_char * _BATCH.size).from_address(addr)).cast("B").toreadonly()
        _, _, _, _, _, tptr, mptr, _, _, _ = _BATCH.unpack_from(bview)
        tview = memoryview((ctypes.c_char * (_TENSOR.size * _capi.MAX_TENSORS)).from_address(tptr)).cast("B")
        mview = memoryview((ctypes.c_char * _capi.META_MAX).from_address(mptr)).cast("B")
        return bview, tview.toreadonly(), mview.toreadonly()

    def open_device(self):
        """Opens the producer's device pool (tsock_reader_open_device):
        (ordinal, None) on success, (None, why) where this reader must read
        host memory instead. CUDAUnavailable without a driver."""
        lib = self.lib
        ordinal = ctypes.c_int32()
        rc = lib.tsock_reader_open_device(self.handle, ctypes.byref(ordinal))
        if rc == _capi.OK:
            return ordinal.value, None
        detail = lib.tsock_last_error().decode(errors="replace")
        if rc == _capi.ENODEVICE:
            return None, detail
        raise error_for(rc, f"open the device pool: {detail}")

    def device_range(self) -> tuple[int, int]:
        """(base, length) of the device pool in this process."""
        base, length = ctypes.c_uint64(), ctypes.c_uint64()
        check(
            self.lib,
            self.lib.tsock_reader_device_range(self.handle, ctypes.byref(base), ctypes.byref(length)),
            "device range",
        )
        return base.value, length.value

    def release(self, lease: Lease) -> None:
        """Releases `lease` and every batch acquired before it."""
        if self.on_release is not None:
            self.on_release()
        rc = self.lib.release(self.handle, lease.batch)
        if rc:
            check(self.lib, rc, "release")
        held = self.held
        while held and held[0].seq <= lease.seq:
            held.popleft().valid = False

    def release_all(self) -> None:
        if self.held:
            self.release(self.held[-1])

    def detach(self) -> None:
        if self.on_release is not None and self.handle is not None:
            # A failing wait (a CUDA error) must not keep the reader
            # attached; the copies' sources keep the mapping alive anyway.
            with contextlib.suppress(Exception):
                self.on_release()
        for held in self.held:
            held.valid = False
        self.held.clear()
        if self.handle is not None:
            rc = self.lib.tsock_reader_detach(self.handle)
            self.handle = None
            # EFORKED: a child of the attaching process; the parent detaches.
            if rc not in (_capi.OK, _capi.EFORKED, _capi.EHANDLE):
                raise TsockError(f"detach: {self.lib.tsock_last_error().decode(errors='replace')}", rc)
