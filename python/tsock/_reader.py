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
import weakref
from collections import deque

from . import _capi, _structure
from ._dlpack import Lease, capsule_destructors
from ._waiting import AttachProgress
from .errors import TsockError, check, error_for

# Waits are cut into slices this long: a signal (KeyboardInterrupt) is acted
# on when a C call returns to Python.
SLICE_NS = 100_000_000

_BATCH = struct.Struct("<QQQIIQQIIQQQQ")  # tsock_batch_t
LIVE_TOTAL = _capi.MAX_TENSORS  # dlpack_live[LIVE_TOTAL]: descriptors of the batch alive
_TENSOR = _capi.TENSOR_STRUCT
assert _BATCH.size == ctypes.sizeof(_capi.Batch) and _TENSOR.size == ctypes.sizeof(_capi.Tensor)

_P = ctypes.c_void_p


class _Lib:
    """libtsock_reader.so, with the hot functions declared again taking
    plain addresses (c_void_p) rather than ctypes pointer objects: a batch is
    then an int, cheap to pass around."""

    def __init__(self, cdll):
        self.cdll = cdll
        self.acquire = self._fn("tsock_reader_acquire", [_P, ctypes.POINTER(_P), ctypes.c_int64])
        self.release = self._fn("tsock_reader_release", [_P, _P])
        self.dlpack = self._fn(
            "tsock_batch_dlpack_export",
            [_P, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(_P)],
        )
        # The same export for the common case (a whole host tensor, dtype
        # as is): two arguments fewer cost ~0.7 us less a tensor in ctypes.
        self.dlpack_whole = self._fn("tsock_batch_dlpack", [_P, ctypes.c_uint32, ctypes.c_int, ctypes.POINTER(_P)])
        # The destructors of capsules never consumed free their struct
        # through the library that made it (tsock_dlpack_delete).
        delete = self._fn("tsock_dlpack_delete", [_P, ctypes.c_int])
        self.destroy_legacy, self.destroy_versioned = capsule_destructors(delete)
        self.cuda_use = self._fn("tsock_batch_cuda_use", [_P, ctypes.c_size_t, ctypes.c_uint32])
        self.keep = self._fn("tsock_batch_keep", [_P, _P, ctypes.c_uint32, ctypes.POINTER(_P)])
        self.free = self._fn("tsock_batch_free", [_P])
        self.pin = self._fn("tsock_batch_pin", [_P, _P, ctypes.POINTER(_P)])

    def _fn(self, name, argtypes):
        fn = self.cdll._FuncPtr((name, self.cdll))
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
        return fn

    def __getattr__(self, name):
        return getattr(self.cdll, name)


# libtsock_reader.so, loaded once per process.
library = _capi.once(lambda: _Lib(_capi.load(reader_only=True)))


# A leaf (one tensor of an acquired batch) is a tuple, for speed:
# (wire dtype, shape, strides in elements, address of the first element, bytes).
CODE, SHAPE, STRIDES, DATA, NBYTES = range(5)


class Memory:
    """Where tensors lie in this process: a read-only memoryview over an
    address range (a byte-per-element view; numpy arrays are built over it
    or over slices of it), its base address and length, and for a slot's
    mapping the counters of live DLPack descriptors of the batch it
    carries (dlpack_live, read without a call). The view pins the range:
    it stays mapped while the view or any slice of it lives."""

    __slots__ = ("view", "base", "length", "live")

    def __init__(self, view: memoryview, base: int, length: int, live):
        self.view = view
        self.base = base
        self.length = length
        self.live = live


class Raw:
    """An acquired batch: its lease (for DLPack and release), the memory its
    tensors lie in, its leaves and its layout; or an epoch-end marker (no
    leaves, `end` True). `exporters` (lifetime="referenced"): the objects
    that whatever the caller was given holds on to, whose reference counts
    tell whether a leaf is still referenced: at position i < len(leaves) the
    memoryview numpy arrays of leaf i are built on (or None), after those
    DLPackTensor objects handed out (their leaf in `leaf`)."""

    __slots__ = (
        "lease",
        "mem",
        "epoch",
        "index",
        "end",
        "leaves",
        "layout",
        "meta",
        "rows",
        "exporters",
        "done",
        "foreign",
    )

    def __init__(self, lease: Lease, mem: Memory, epoch: int, index: int, end: bool, leaves: list, layout, meta=b""):
        self.lease = lease
        self.mem = mem
        self.epoch = epoch
        self.index = index
        self.end = end
        self.leaves = leaves
        self.layout = layout
        self.meta = meta  # the metadata's bytes (a private copy): a Pipeline batch's tag is in it
        self.rows = None  # shared first dimension, computed when re-batching
        self.exporters = None
        self.done = False  # the consumer has delivered all of it
        self.foreign = False  # another rank's batch, let go unread (partition mode)


_pinned_types: dict[int, type] = {}


def _pinned_view(lib, token: ctypes.c_void_p, base: int, length: int) -> memoryview:
    """A read-only byte view of [base, base + length) over a ctypes array
    that drops `token` (tsock_mapping_unpin) when it is garbage-collected,
    that is when the view and every slice of it are gone."""
    cls = _pinned_types.get(length)
    if cls is None:
        unpin = lib.tsock_mapping_unpin

        class Pinned(ctypes.c_char * length):
            def __del__(self):
                unpin(self.token)

        cls = _pinned_types[length] = Pinned
    mapping = cls.from_address(base)
    mapping.token = token
    return memoryview(mapping).cast("B").toreadonly()


def _exiting() -> bool:
    """Whether the interpreter is exiting: its main thread has stopped and
    only daemon threads are left (the exit finalizers run then). The main
    thread alone is not enough: it stops too when the script ends while
    non-daemon threads still run (review 34, B3)."""
    main = threading.main_thread()
    if main.is_alive():
        return False
    return all(t.daemon for t in threading.enumerate() if t is not main)


class Reader:
    """One attached reader handle. Not thread-safe: one thread at a time."""

    def __init__(self, name: str, start: int, timeout: float | None, max_held: int, keeping: bool = False):
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
        self.slot_bytes = 0  # a slot's payload bytes, as each acquired batch says
        # A read-only view of the payload mapping, for numpy arrays built
        # straight from descriptors (no DLPack round trip for numpy). numpy
        # keeps the memoryview (not the ctypes array) as the arrays' base, so
        # their writeable flag cannot be turned back on. The view pins the
        # mapping: an array kept after close() reads stale bytes instead of
        # faulting, and the mapping goes when the last array does.
        token = ctypes.c_void_p()
        check(lib, lib.tsock_reader_pin_mapping(handle, ctypes.byref(token)), "pin mapping")
        self.payload = _pinned_view(lib, token, self.base, self.length)
        self.whole = Memory(self.payload, self.base, self.length, None)
        # keeping (lifetime="referenced"): batches are read through their
        # slot's mapping (a Memory per slot, made at its first batch), which
        # moves elsewhere when a batch of it is kept.
        self.keeping = keeping
        self._slots: dict[int, Memory] = {}
        # Called with (base, length) when a slot mapping outside the whole
        # payload range appears, and when a slot mapping is retired (kept):
        # the torch guard's ranges.
        self.on_mapped = self.on_retired = None
        self.held: deque[Raw] = deque()
        self._out = ctypes.c_void_p()
        self._out_ref = ctypes.byref(self._out)
        self._views: dict[int, tuple] = {}
        # Held by every call that changes the reader (acquire and reading
        # the batch, release, keep, detach): the C reader takes one thread
        # at a time, and a detach from another thread (a finalizer at exit)
        # must not free the reader's memory under a call, nor an exit
        # finalizer's keep meet a release of the reading thread (review 32).
        # Re-entrant: a finalizer keeps batches under it.
        self.busy = threading.RLock()
        # Set by detach: None while attached, else whether it ran at
        # interpreter exit (the exit finalizers), for what a call of another
        # thread sees then (_closed).
        self._detached_at_exit: bool | None = None
        # Called before a batch is released and before detaching (the GPU
        # staging waits there for copies still reading held batches).
        self.on_release = None

    def acquire(self, deadline: float | None = None) -> Raw | None:
        """The next batch, waiting in slices without limit (or until the
        time.monotonic() `deadline`: None then); raises ProducerGone,
        ChannelClosed, Evicted... when the stream ends."""
        acquire, handle, ref, busy = self.lib.acquire, self.handle, self._out_ref, self.busy
        while True:
            with busy:
                rc = acquire(handle, ref, SLICE_NS)
                if rc == _capi.OK:
                    # Read under the lock: the batch record is the reader's
                    # memory, which a detach from another thread (a
                    # finalizer at exit) frees (review 32, F3).
                    return self._acquired()
            if rc != _capi.EAGAIN:
                self._check(rc, "acquire")
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _acquired(self) -> Raw:
        """The batch acquire() just took, read from the reader's record of it."""
        addr = self._out.value
        views = self._views.get(addr)
        if views is None:
            views = self._views[addr] = self._map_held(addr)
        bview, tview, mview = views
        seq, epoch, index, flags, n, _, _, mlen, _, _, payload, capacity, live = _BATCH.unpack_from(bview)
        self.slot_bytes = capacity
        lease = Lease(addr, seq)
        if self.keeping:
            mem = self._slots.get(payload)
            if mem is None:
                mem = self._slot_memory(addr, payload, capacity, live)
        else:
            mem = self.whole
        if flags & _capi.BATCH_EPOCH_END:
            raw = Raw(lease, mem, epoch, index, True, [], None)
        else:
            leaves = []
            unpack = _TENSOR.unpack_from
            for i in range(n):
                f = unpack(tview, i * _TENSOR.size)
                nd = f[1]
                leaves.append((f[0], f[2 : 2 + nd], f[10 : 10 + nd], f[20], f[19]))
            meta = bytes(mview[:mlen])
            raw = Raw(lease, mem, epoch, index, False, leaves, _structure.decode(meta, n), meta)
        self.held.append(raw)
        return raw

    def _slot_memory(self, batch: int, payload: int, capacity: int, live: int) -> Memory:
        """The Memory of a slot mapping met for the first time, pinned
        (tsock_batch_pin) for as long as its view or a slice of it lives."""
        lib = self.lib
        token = ctypes.c_void_p()
        self._check(lib.pin(self.handle, batch, ctypes.byref(token)), "pin a slot")
        view = _pinned_view(lib, token, payload, capacity)
        counts = memoryview((ctypes.c_uint32 * (LIVE_TOTAL + 1)).from_address(live)).cast("B").cast("I")
        mem = self._slots[payload] = Memory(view, payload, capacity, counts)
        if self.on_mapped is not None and not self.base <= payload < self.base + self.length:
            self.on_mapped(payload, capacity)
        return mem

    def slot_ranges(self) -> list[tuple[int, int]]:
        """(base, length) of the slot mappings in use outside the whole
        payload mapping (slots moved by a keep)."""
        inside = range(self.base, self.base + self.length)
        return [(m.base, m.length) for m in self._slots.values() if m.base not in inside]

    def keep(self, raw: Raw, mask: int) -> None:
        """Keeps the leaves of `raw` in `mask` and those with live DLPack
        descriptors valid past its release, at their addresses
        (tsock_batch_keep). Its slot mapping is then retired: it holds the
        kept copies only, and later batches of the slot lie elsewhere."""
        lib = self.lib
        kept = ctypes.c_void_p()
        with self.busy:
            rc = lib.keep(self.handle, raw.lease.held, mask, ctypes.byref(kept))
        if rc:
            self._check(rc, "keep a batch")
        if not kept.value:
            return  # nothing was referenced after all: nothing copied
        mem = raw.mem
        if self._slots.get(mem.base) is mem:
            del self._slots[mem.base]
            if self.on_retired is not None:
                self.on_retired(mem.base, mem.length)
        lease = raw.lease
        if lease.free is not None:
            lease.free()  # kept again: the newer kept batch describes it as well
        lease.batch = kept.value
        lease.kept = True
        # The kept batch (for DLPack exports after the release) goes with
        # the lease, when the Raw and every DLPackTensor of it are gone:
        # freed once, by whichever comes first of that and a later keep.
        lease.free = weakref.finalize(lease, lib.free, kept.value)

    def _map_held(self, addr: int):
        """Read views of a held batch's struct, its tensor descriptors and its
        metadata. The reader keeps max_held of them at fixed addresses, so
        the views are made once per address."""
        bview = memoryview((ctypes.c_char * _BATCH.size).from_address(addr)).cast("B").toreadonly()
        tptr, mptr = _BATCH.unpack_from(bview)[5:7]
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

    def check_claim(self) -> None:
        """Evicted once the producer's eviction policy took this reader: what
        it holds may be rewritten from then on (a batch acquired ahead)."""
        self._check(self.lib.tsock_reader_check(self.handle), "check")

    def slot_count(self) -> int:
        """The ring's slots, from the payload mapping's length and the slot
        size its batches gave (0 before the first)."""
        return self.length // self.slot_bytes if self.slot_bytes else 0

    def release(self, raw: Raw) -> None:
        """Releases `raw` and every batch acquired before it. Their leases
        turn invalid, except kept ones (their memory stays)."""
        if self.on_release is not None:
            self.on_release()
        lease = raw.lease
        held = self.held
        with self.busy:
            rc = self.lib.release(self.handle, lease.held)
            # Invalid whatever the release says: after an eviction (EEVICTED)
            # the producer may already be rewriting these slots.
            while held and held[0].lease.seq <= lease.seq:
                old = held.popleft().lease
                if not old.kept:
                    old.valid = False
        if rc:
            self._check(rc, "release")

    def _check(self, rc: int, what: str) -> None:
        """check() for a call on the reader, which another thread may have
        detached meanwhile (its handle is then not open): that reads as the
        consumer closed, whichever call noticed it (review 32, F4)."""
        if rc == _capi.EHANDLE and self._detached_at_exit is not None:
            if self._detached_at_exit and threading.current_thread() is not threading.main_thread():
                # The exit finalizers closed it under a daemon thread still
                # reading: end that thread quietly (threading prints no
                # traceback for SystemExit), as the process is exiting.
                raise SystemExit(0)
            raise TsockError(f"{what}: the consumer was closed by another thread", rc)
        check(self.lib, rc, what)

    def detach(self) -> None:
        if self.on_release is not None and self.handle is not None:
            # A failing wait (a CUDA error) must not keep the reader
            # attached; the copies' sources keep the mapping alive anyway.
            with contextlib.suppress(Exception):
                self.on_release()
        rc = _capi.OK
        # Under the lock: the reading thread appends to and pops from
        # `held` under it (review 34, B2).
        with self.busy:
            for raw in self.held:
                if not raw.lease.kept:
                    raw.lease.valid = False
            self.held.clear()
            if self.handle is not None:
                self._detached_at_exit = _exiting()
                rc = self.lib.tsock_reader_detach(self.handle)
                self.handle = None
        if rc != _capi.OK:
            # EFORKED: a child of the attaching process; the parent detaches.
            if rc not in (_capi.EFORKED, _capi.EHANDLE):
                raise TsockError(f"detach: {self.lib.tsock_last_error().decode(errors='replace')}", rc)
