"""Producer: publishes the batches of one loader to every Consumer of a
channel."""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import stat
import sys
import time
import weakref
from typing import NamedTuple

import numpy as np

from . import _capi, _dtypes, _from_dataloader, _runtime, _state, _structure
from . import metrics as _metrics
from ._reader import SLICE_NS
from ._stats_note import StatsNote
from .errors import BatchTooLarge, TsockError, UnsupportedDtype, check
from .pipeline import Pipeline, Position

ALIGN = 64  # every tensor starts on a cache line (and suits any dtype, DLPack and XLA)
_NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{_capi.NAME_MAX}}}")
_TENSOR = _capi.TENSOR_STRUCT
_SMALL_COPY = 1 << 20

# libtsock.so (producer and reader; it carries a Go runtime), loaded once.
library = _capi.once(lambda: _capi.load(reader_only=False))


def check_name(name) -> str:
    """Validates a channel name as the C library does (tsock_layout_name_ok in
    ring/layout.h): 1..NAME_MAX of [A-Za-z0-9._-], not "." or "..".
    TsockError (status ENAME) otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"channel name must be str, got {type(name).__name__}")
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise TsockError(f"channel name {name!r} is not 1..{_capi.NAME_MAX} of [A-Za-z0-9._-]", _capi.ENAME)
    return name


def _option_defaults(lib) -> _capi.ProducerOptions:
    """Producer options as tsock_producer_options_init fills them: the
    defaults, written once (producer/defaults.h)."""
    opts = _capi.ProducerOptions()
    lib.tsock_producer_options_init(ctypes.byref(opts))
    return opts


def _default_slots(loader) -> int:
    """The library's default ring depth; for a partitioned Pipeline, at
    least 4 slots per rank it publishes: a rank's consumer holds the
    batches of the other ranks published after one it still uses (the
    ring is released in order), so each batch it holds holds a step's
    worth, and the producer still needs room to run ahead."""
    slots = _capi.PRODUCER_DEFAULTS["SLOT_COUNT"]
    ranks = len(getattr(loader, "ranks", ())) if getattr(loader, "world_size", 0) else 0
    while slots < 4 * ranks:
        slots *= 2
    return slots


def _check_join_window(join_window, slots: int) -> None:
    """ValueError unless join_window is in 0..slots-1."""
    if not isinstance(join_window, int) or join_window < 0 or join_window >= slots:
        raise ValueError(f"join_window must be in 0..slots-1 ({slots - 1}), got {join_window!r}")


def epoch_sizes(loader) -> tuple[int | None, int | None]:
    """(batches, samples) per epoch of a loader, None where it cannot tell.
    Knows torch DataLoaders (batches from len(), samples from the sampler and
    drop_last) and in-memory sequences of batches."""
    if isinstance(loader, Pipeline):
        return len(loader), loader.samples_per_epoch
    try:
        batches = len(loader)
    except TypeError:
        return None, None
    samples = None
    batch_size = getattr(loader, "batch_size", None)
    sampler = getattr(loader, "sampler", None)
    if isinstance(batch_size, int) and sampler is not None and hasattr(loader, "drop_last"):
        try:
            n = len(sampler)
        except TypeError:
            n = None
        if n is not None:
            samples = n - n % batch_size if loader.drop_last else n
    elif isinstance(loader, (list, tuple)):
        try:
            samples = sum(_rows(b) for b in loader)
        except (TypeError, ValueError, IndexError):
            samples = None
    return batches, samples


def _rows(batch) -> int:
    _, leaves = _structure.flatten(batch)
    return int(leaves[0].shape[0])


class _Prepared(NamedTuple):
    """A batch ready to write: its structure, leaves, offsets and size."""

    spec: str
    sources: list
    offsets: list
    total: int


class _Source:
    """A leaf ready to copy: wire dtype, shape, bytes, and either a numpy
    array (any strides; copied with numpy) or a torch tensor not on the CPU
    (copied by torch, straight into shared memory)."""

    __slots__ = ("code", "shape", "nbytes", "array", "tensor")

    def __init__(self, code, shape, nbytes, array=None, tensor=None):
        self.code = code
        self.shape = shape
        self.nbytes = nbytes
        self.array = array
        self.tensor = tensor


def _numpy_source(arr: np.ndarray, batch, i: int) -> _Source:
    code = _dtypes.FROM_NUMPY.get(arr.dtype)
    if code is None:  # bfloat16, byte-swapped, or unsupported: the slow path names the leaf
        code = _dtypes.code_of_numpy(arr.dtype, _structure.leaf_path(batch, i))
    return _Source(code, arr.shape, arr.nbytes, array=arr)


def _source(leaf, batch, i: int) -> _Source:
    if isinstance(leaf, np.ndarray):
        return _numpy_source(leaf, batch, i)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(leaf, torch.Tensor):
        from ._torch import FROM_TORCH

        code = FROM_TORCH.get(leaf.dtype)
        if code is None:
            raise UnsupportedDtype(
                f"{_structure.leaf_path(batch, i)} has dtype {leaf.dtype}, which tsock cannot carry; "
                f"supported: {_dtypes.SUPPORTED}",
                _capi.EDTYPE,
            )
        shape = tuple(leaf.shape)
        if leaf.device.type != "cpu":
            return _Source(code, shape, leaf.numel() * _dtypes.ITEMSIZE[code], tensor=leaf)
        t = leaf.detach()
        if t.is_neg():
            t = t.resolve_neg()
        if code == _capi.DTYPE_BFLOAT16:
            t = t.view(torch.int16)  # numpy has no bfloat16: move the bits
        arr = t.numpy()
        return _Source(code, shape, arr.nbytes, array=arr)
    if isinstance(leaf, np.generic) or (
        hasattr(leaf, "__array__") and hasattr(leaf, "dtype") and hasattr(leaf, "shape") and not isinstance(leaf, type)
    ):
        # JAX arrays (np.asarray is a view on the CPU) and numpy scalars.
        return _numpy_source(np.asarray(leaf), batch, i)
    raise UnsupportedDtype(
        f"{_structure.leaf_path(batch, i)} is a {type(leaf).__name__}: tsock carries numpy arrays, torch tensors "
        "and JAX arrays (in tuples, lists and dicts); convert other values to arrays",
        _capi.EDTYPE,
    )


def _close_handle(lib, handle, pid: int) -> None:
    # Only the creating process closes: a forked child (DataLoader worker)
    # must not remove its parent's channel, and the library refuses anyway.
    if handle.value is not None and os.getpid() == pid:
        lib.tsock_producer_close(handle)
        handle.value = None


def _cuda_ordinal(device) -> int:
    """The CUDA ordinal of a device= argument; -1 for None."""
    if device is None:
        return -1
    from ._devices import cuda_index

    return cuda_index(device)


def _position_of_state(state_dict: dict, pipe: Pipeline) -> Position:
    """Where a consumer's state_dict() resumes, in `pipe`'s batches: for a
    rank's state, the start of its step (every rank's batch of it)."""
    state = _state.decode(state_dict)
    if not state.started:
        return Position(0, 0)
    if state.fingerprint != pipe.fingerprint:
        raise ValueError(
            f"the state was saved from another pipeline (fingerprint {state.fingerprint.hex()}) than {pipe!r} "
            f"({pipe.fingerprint.hex()})"
        )
    batch = state.batch - state.batch % len(pipe.ranks) if state.world_size else state.batch
    pipe._check_position(state.epoch, batch)
    return Position(state.epoch, batch)


def _check_same_pipeline(name: str, fingerprint: bytes, world_size: int, ranks: int, pipeline: Pipeline) -> None:
    if fingerprint != pipeline.fingerprint:
        raise ValueError(
            f"channel '{name}' was publishing another pipeline (fingerprint {fingerprint.hex()}, this one "
            f"{pipeline.fingerprint.hex()}): its position does not apply to {pipeline!r}"
        )
    if world_size != pipeline.world_size or ranks != len(pipeline.ranks):
        raise ValueError(
            f"channel '{name}' was publishing {ranks} rank(s) of world size {world_size}, this pipeline "
            f"makes {len(pipeline.ranks)} of {pipeline.world_size}: its batch numbers do not apply"
        )


# ---- the resume note ----
# A producer that resumes at a position other than the start writes it here
# before it creates its channel, and removes it once its first pipeline
# batch is published: until then its channel's ring holds no batch to read
# the position from (it replaced its predecessor's segment at creation), and
# a successor of it would otherwise start over.

RESUME_DIR = "/dev/shm"
_NOTE_MAX = 4096


def resume_note_path(name: str, directory: str | None = None) -> str:
    """Hidden, beside the channel's segment (or in tsock.shared's runtime
    directory: RESUME_DIR, or `directory`), with no name a channel can have."""
    return os.path.join(directory or RESUME_DIR, f".tsock-resume.{name}")


def _remove_dead_temporaries(name: str) -> None:
    """Removes this user's temporary notes of `name` whose writer is gone
    (killed between creating and renaming one)."""
    prefix = os.path.basename(resume_note_path(name)) + _runtime.TMP_SEP
    try:
        entries = os.listdir(RESUME_DIR)
    except OSError:
        return
    for entry in entries:
        pid = entry[len(prefix) :] if entry.startswith(prefix) else ""
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its writer is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's process
        path = os.path.join(RESUME_DIR, entry)
        with contextlib.suppress(OSError):
            if os.lstat(path).st_uid == os.geteuid():
                os.unlink(path)


def _write_resume_note(name: str, pipe: Pipeline, pos: Position) -> None:
    _remove_dead_temporaries(name)
    path = resume_note_path(name)
    text = json.dumps(
        {
            "fingerprint": pipe.fingerprint.hex(),
            "world_size": pipe.world_size,
            "ranks": len(pipe.ranks),
            "epoch": pos.epoch,
            "batch": pos.batch,
        }
    ).encode()
    try:
        _runtime.write_whole(path, text, 0o600)
    except OSError as e:
        raise TsockError(f"cannot record the resume position of '{name}' in {path}: {e}", _capi.ESYS) from None


def _remove_resume_note(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(resume_note_path(name))
    _remove_dead_temporaries(name)


def _read_resume_note(name: str) -> dict | None:
    """The note of channel `name`, if this user wrote one; TsockError for a
    note that cannot be one."""
    path = resume_note_path(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise TsockError(f"cannot read the resume position of '{name}' in {path}: {e}", _capi.ESYS) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
            return None  # not ours: never trusted
        raw = os.read(fd, _NOTE_MAX + 1)
    finally:
        os.close(fd)
    try:
        note = json.loads(raw) if len(raw) <= _NOTE_MAX else None
        fields = ("epoch", "batch", "world_size", "ranks")
        if not isinstance(note, dict) or not all(isinstance(note.get(k), int) and note[k] >= 0 for k in fields):
            raise ValueError("fields missing")
        note["fingerprint"] = bytes.fromhex(note["fingerprint"])
    except (ValueError, TypeError, KeyError):
        raise TsockError(
            f"the resume position of '{name}' in {path} is unreadable; remove it and pass start=(epoch, batch)",
            _capi.ECORRUPT,
        ) from None
    return note


def _advance(base: Position, markers: int) -> Position:
    """The position after `markers` epoch-end markers published after base."""
    return base if markers == 0 else Position(base.epoch + markers, 0)


class Producer:
    """Publishes every batch of `loader` to the consumers of channel `name`.

    The loader is any iterable of batches: a torch DataLoader (worker
    processes included), a generator of numpy arrays, a JAX pipeline. A batch
    is an array or tensor (numpy, torch on any device, JAX), or tuples, lists
    and dicts of them (at most 16 tensors, 8 dimensions each). Each batch is
    copied once, straight into shared memory; consumers read it in place.

    The channel is created at the first batch, sized from it: each of the
    `slots` ring slots holds first-batch bytes x `headroom` (or `slot_bytes`).
    A later batch that does not fit raises BatchTooLarge.

    Trainers started before the producer wait for the channel; one that
    attaches after the first batch of an epoch was published starts with the
    next epoch, unless it comes within `join_window` batches. For a sweep,
    pass wait_readers=<number of trainers> so that every trainer gets the
    first epoch whole.

    A tsock.Pipeline as the loader adds exact positions: every batch is
    tagged with its place in the pipeline's order, run() can start at any
    (epoch, batch), and recorded_position() tells a successor where a dead
    producer stopped (docs/PIPELINE.md).

    Args:
      loader: the iterable run() publishes, or a tsock.Pipeline (None:
        publish() by hand).
      name: channel name, 1..64 of [A-Za-z0-9._-].
      slots: ring depth, a power of two (2..65536): how far the producer may
        run ahead of the slowest consumer; None: the library's default
        (tsock_producer_options_init).
      slot_bytes: payload bytes per batch; default first batch x headroom.
      headroom: margin over the first batch's size for later, larger batches.
      join_window: a consumer that attaches while at most this many batches
        of the current epoch are published still gets the whole epoch
        (the producer keeps them); must be less than slots.
      max_readers: consumers that may attach at once (1..1024); None: the
        library's default.
      wait_readers: before the first batch, wait for this many consumers.
      timeout: seconds to wait for a free slot or for wait_readers (None:
        forever; a dead consumer never blocks, it is dropped within ~10 ms).
      evict_after: evict a live consumer that holds the ring back this many
        seconds (it then gets Evicted); None (default): slow consumers apply
        back-pressure and are never evicted.
      device: None (default), or a CUDA device ("cuda", "cuda:1", a
        torch.device): every batch is also copied once into a device pool on
        that GPU, which consumers with Consumer(device=...) on the same GPU
        read zero-copy (CUDA IPC); consumers elsewhere read host memory.
        Needs the NVIDIA driver (CUDAUnavailable without one).

    Use it as a context manager or call close(): consumers then read what was
    published and get ChannelClosed. The producer is used by one thread.
    """

    def __init__(
        self,
        loader=None,
        name: str = "sweep",
        *,
        slots: int | None = None,
        slot_bytes: int | None = None,
        headroom: float = 1.25,
        join_window: int = 0,
        max_readers: int | None = None,
        wait_readers: int = 0,
        timeout: float | None = None,
        evict_after: float | None = None,
        device=None,
    ):
        self.name = check_name(name)
        self.cuda_device = _cuda_ordinal(device)
        if slots is not None and (not isinstance(slots, int) or slots < 2 or slots > 65536 or slots & (slots - 1)):
            raise ValueError(f"slots must be a power of two in 2..65536, got {slots!r}")
        if slot_bytes is not None and (not isinstance(slot_bytes, int) or slot_bytes < 1):
            raise ValueError(f"slot_bytes must be a positive int or None, got {slot_bytes!r}")
        if not isinstance(headroom, (int, float)) or headroom < 1:
            raise ValueError(f"headroom must be a number >= 1, got {headroom!r}")
        converted, why = _from_dataloader.convert(loader)
        #: why the loader's batches cannot be resumed exactly (a DataLoader
        #: that is not a seeded map-style one), or None
        self.not_resumable = why
        #: the DataLoader given, when it was made a Pipeline (self.loader)
        self.dataloader = loader if converted is not None else None
        if converted is not None:
            loader = converted
        if slots is None:
            slots = _default_slots(loader)
        if max_readers is None:
            max_readers = _capi.PRODUCER_DEFAULTS["MAX_READERS"]
        _check_join_window(join_window, slots)
        if max_readers is not None and (not isinstance(max_readers, int) or not 1 <= max_readers <= 1024):
            raise ValueError(f"max_readers must be in 1..1024, got {max_readers!r}")
        if not isinstance(wait_readers, int) or wait_readers < 0:
            raise ValueError(f"wait_readers must be an int >= 0, got {wait_readers!r}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"timeout must be None or seconds >= 0, got {timeout!r}")
        if evict_after is not None and (not isinstance(evict_after, (int, float)) or evict_after <= 0):
            raise ValueError(f"evict_after must be None or seconds > 0, got {evict_after!r}")
        self.evict_after = evict_after
        self.loader = loader
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.headroom = float(headroom)
        self.join_window = join_window
        self.max_readers = max_readers
        self.wait_readers = wait_readers
        self.timeout = timeout
        if isinstance(loader, Pipeline):
            # Its workers live across epochs: fork them before the Go
            # runtime's threads exist in this process.
            loader.start()
        # Loaded now, so that a (DataLoader) loader's worker processes, forked
        # at every epoch, come from a process that already carries the Go
        # runtime (they never call it).
        self._lib = library()
        self._handle = ctypes.c_void_p()
        self._pid = os.getpid()
        self._sizes = None  # (batches, samples) per epoch of the loader
        self._meta: dict[str, bytes] = {}
        self._tensors = (_capi.Tensor * _capi.MAX_TENSORS)()
        self._descs = memoryview(self._tensors).cast("B")  # packed in place with struct
        self._packed: dict[tuple, bytes] = {}
        self._slot_views: dict[int, memoryview] = {}
        self._closed = False
        self._running = False  # run() is publishing a Pipeline
        self._stats_note = None  # the Pipeline's figures for tsock stat (_stats_note), from the first run()
        #: called with the producer before each batch is written, once the
        #: channel exists (tsock.shared's producer waits for its trainers
        #: and lingers there); it may raise to stop run()
        self.before_publish = None
        self._finalizer = weakref.finalize(self, _close_handle, self._lib, self._handle, self._pid)
        _metrics.track_producer(self)  # for tsock.metrics (its exporter, if the environment asks, starts now)

    # ---- channel ----

    def _create(self, batch_bytes: int) -> None:
        lib = self._lib
        nbytes = self.slot_bytes
        if nbytes is None:
            nbytes = max(4096, -(-math.ceil(batch_bytes * self.headroom) // 4096) * 4096)
        opts = _option_defaults(lib)
        opts.slot_count = self.slots
        opts.slot_bytes = nbytes
        opts.max_readers = self.max_readers
        opts.join_window = self.join_window
        if self.evict_after is not None:
            opts.evict_after_ns = int(self.evict_after * 1e9)
        opts.cuda_device = self.cuda_device
        check(
            lib,
            lib.tsock_producer_create(self.name.encode(), ctypes.byref(opts), ctypes.byref(self._handle)),
            f"create channel '{self.name}'",
        )
        self.slot_bytes = nbytes
        if self.wait_readers:
            self._wait(
                lambda ns: lib.tsock_producer_wait_readers(self._handle, self.wait_readers, ns),
                f"waiting for {self.wait_readers} readers on '{self.name}'",
            )

    def _usable(self) -> None:
        if self._closed:
            raise TsockError(f"producer of '{self.name}' is closed", _capi.EHANDLE)
        if os.getpid() != self._pid:
            raise TsockError("a Producer cannot be used in a forked child process", _capi.EFORKED)

    def _wait(self, call, what: str) -> None:
        """Runs a waiting C call in slices, so Ctrl-C gets through, until it
        succeeds or self.timeout passes."""
        if self.timeout == 0:
            check(self._lib, call(0), what)
            return
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            ns = SLICE_NS
            if deadline is not None:
                ns = max(1, min(ns, int((deadline - time.monotonic()) * 1e9)))
            rc = call(ns)
            if rc == _capi.OK:
                return
            if rc != _capi.ETIMEDOUT:
                check(self._lib, rc, what)
            if deadline is not None and time.monotonic() >= deadline:
                raise TsockError(f"{what}: timed out after {self.timeout:g} s", _capi.ETIMEDOUT)

    # ---- publishing ----

    def publish(self, batch) -> None:
        """Publishes one batch (copied once into shared memory). Waits while
        the ring is full (the slowest consumer is `slots` batches behind)."""
        self._usable()
        prepared = self._prepare(batch)
        self._ensure_channel(prepared)
        if self.before_publish is not None:
            self.before_publish(self)
        self._write(prepared, self._plain_meta(prepared.spec))

    def _plain_meta(self, spec: str) -> bytes:
        meta = self._meta.get(spec)
        if meta is None:
            if self._sizes is None:
                self._sizes = epoch_sizes(self.loader) if self.loader is not None else (None, None)
            meta = self._meta[spec] = _structure.encode(spec, *self._sizes)
        return meta

    def _prepare(self, batch) -> _Prepared:
        """A batch's structure, its leaves ready to copy and their offsets."""
        spec, leaves = _structure.flatten(batch)
        if len(leaves) > _capi.MAX_TENSORS:
            raise BatchTooLarge(
                f"batch has {len(leaves)} tensors, a batch carries at most {_capi.MAX_TENSORS}: "
                "stack or concatenate some of them",
                _capi.ETOOBIG,
            )
        sources = [_source(leaf, batch, i) for i, leaf in enumerate(leaves)]
        offsets = []
        total = 0
        for i, src in enumerate(sources):
            if len(src.shape) > _capi.MAX_DIMS:
                raise UnsupportedDtype(
                    f"{_structure.leaf_path(batch, i)} has {len(src.shape)} dimensions, at most {_capi.MAX_DIMS}",
                    _capi.EDTYPE,
                )
            total = -(-total // ALIGN) * ALIGN
            offsets.append(total)
            total += src.nbytes
        return _Prepared(spec, sources, offsets, total)

    def _ensure_channel(self, prepared: _Prepared) -> None:
        """Creates the channel at the first batch, sized from it; checks that
        the batch fits."""
        total = prepared.total
        if self._handle.value is None:
            self._create(total)
        if total > self.slot_bytes:
            raise BatchTooLarge(
                f"batch of {total} bytes does not fit channel '{self.name}', whose slots hold {self.slot_bytes} bytes "
                f"(sized from the first batch x headroom {self.headroom:g}); pass slot_bytes >= {total} "
                "or a larger headroom to Producer",
                _capi.ETOOBIG,
            )

    def _write(self, prepared: _Prepared, meta: bytes) -> None:
        """Reserves a slot, copies the batch into it and publishes it with `meta`."""
        lib, handle = self._lib, self._handle
        sources, offsets, total = prepared.sources, prepared.offsets, prepared.total
        payload = ctypes.c_void_p()
        # Reserve inside the try: a KeyboardInterrupt right after a
        # successful reserve must not leave the slot reserved (abort without
        # a reservation is a harmless error).
        try:
            self._wait(
                lambda ns: lib.tsock_producer_reserve(handle, total, ns, ctypes.byref(payload)),
                f"reserve a slot on '{self.name}' (the slowest reader holds the ring)",
            )
            addr = payload.value
            descs = self._descs
            for i, (src, off) in enumerate(zip(sources, offsets)):
                self._copy(src, addr, off)
                key = (src.code, src.shape, off)
                packed = self._packed.get(key)
                if packed is None:
                    packed = self._packed[key] = self._pack(src, off)
                descs[i * _TENSOR.size : (i + 1) * _TENSOR.size] = packed
            check(lib, lib.tsock_producer_publish(handle, self._tensors, len(sources), meta, len(meta)), "publish")
        except BaseException:
            lib.tsock_producer_abort(handle)
            raise

    @staticmethod
    def _pack(src: _Source, off: int) -> bytes:
        """The tsock_tensor_t of a C-contiguous leaf at payload offset off."""
        nd = len(src.shape)
        strides = [1] * nd
        for d in range(nd - 2, -1, -1):
            strides[d] = strides[d + 1] * src.shape[d + 1]
        pad = [0] * (_capi.MAX_DIMS - nd)
        return _TENSOR.pack(src.code, nd, *src.shape, *pad, *strides, *pad, off, src.nbytes, 0)

    def _copy(self, src: _Source, addr: int, off: int) -> None:
        """Copies a leaf into the reserved slot at `addr`, C-contiguous at
        offset `off`: the one copy a batch makes."""
        if src.array is not None:
            arr = src.array
            slot = self._slot_view(addr)
            n = src.nbytes
            # Small contiguous leaves: a plain buffer copy costs a third of
            # building a destination array. Large ones go through numpy,
            # which releases the GIL while it copies.
            if n < _SMALL_COPY and arr.flags.c_contiguous and arr.dtype.isnative:
                try:
                    slot[off : off + n] = memoryview(arr).cast("B")
                    return
                except (TypeError, ValueError, BufferError):
                    pass  # a dtype the buffer protocol cannot describe (bfloat16): numpy copies it
            dtype = arr.dtype if arr.dtype.isnative else arr.dtype.newbyteorder("=")
            np.copyto(np.ndarray(src.shape, dtype, buffer=slot, offset=off), arr)
            return
        import torch

        from ._torch import TO_TORCH

        storage = _dtypes.numpy_storage_dtype(src.code)
        dst = torch.from_numpy(np.ndarray(src.shape, storage, buffer=self._slot_view(addr), offset=off))
        if src.code == _capi.DTYPE_BFLOAT16:
            dst = dst.view(torch.bfloat16)
        elif dst.dtype != TO_TORCH[src.code]:
            dst = dst.view(TO_TORCH[src.code])
        dst.copy_(src.tensor)  # device to shared host memory, one copy

    def _slot_view(self, addr: int) -> memoryview:
        view = self._slot_views.get(addr)
        if view is None:
            view = memoryview((ctypes.c_char * self.slot_bytes).from_address(addr)).cast("B")
            self._slot_views[addr] = view
        return view

    def end_epoch(self) -> None:
        """Publishes an epoch-end marker: consumers' for-loops end there."""
        self._usable()
        if self._handle.value is None:
            self._create(0)  # an empty first epoch: default-sized slots
        lib, handle = self._lib, self._handle
        self._wait(lambda ns: lib.tsock_producer_end_epoch(handle, ns), f"end epoch on '{self.name}'")

    def run(self, epochs: int | None = 1, start=None) -> None:
        """For each epoch, publishes every batch of iter(loader), then an
        epoch-end marker. epochs=None runs until interrupted.

        With a tsock Pipeline as the loader, epochs are the pipeline's own
        numbers: run(epochs=E) publishes epochs 0..E-1, and with
        start=(epoch, batch) it starts at that batch of that epoch (batch =
        len(pipeline): with that epoch's end marker) and still stops before
        epoch E, so a restarted run with the same `epochs` ends where an
        uninterrupted one would. start="recorded" starts where the previous
        producer of this channel stopped (Producer.recorded_position), or at
        the beginning if there is nothing to resume. start=a consumer's
        state_dict() starts at its next batch (a job restarted from its
        checkpoint: give the state of its rank furthest behind). Every batch
        carries its epoch, index and the pipeline's fingerprint in its
        metadata."""
        if self.loader is None:
            raise ValueError("Producer.run needs a loader; with loader=None use publish() and end_epoch()")
        if isinstance(self.loader, Pipeline):
            self._running = True
            try:
                self._run_pipeline(epochs, start)
            finally:
                self._running = False
                if self._closed and self.dataloader is not None:
                    self.loader.close()  # closed while it ran (from another thread): its workers go now
            return
        if start is not None:
            why = f" (this DataLoader is not one: {self.not_resumable})" if self.not_resumable else ""
            raise ValueError(
                "start= needs a tsock.Pipeline or a seeded map-style DataLoader as the loader: other loaders cannot "
                f"seek{why}"
            )
        e = 0
        while epochs is None or e < epochs:
            for batch in self.loader:
                self.publish(batch)
            self.end_epoch()
            e += 1

    def _run_pipeline(self, epochs, start) -> None:
        pipe = self.loader
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0):
            raise ValueError(f"epochs must be None or an int >= 0, got {epochs!r}")
        n = len(pipe)
        if n == 0:
            raise ValueError(f"{pipe!r} has no batch per epoch: nothing to publish")
        if pipe.autosize:
            # The ring full, waiting for its readers: the pipeline's workers are not what is slow.
            pipe.autosize_feedback(lambda: self.stats()["backpressure_s"])
        if start is None:
            start = Position(0, 0)
        elif isinstance(start, str) and start == "recorded":
            self._usable()
            start = self.recorded_position(self.name, pipe) or Position(0, 0)
        elif isinstance(start, dict):
            start = _position_of_state(start, pipe)
        else:
            try:
                start = Position(*start)
            except TypeError:
                raise TypeError(f"start must be (epoch, batch) or 'recorded', got {start!r}") from None
            pipe._check_position(start.epoch, start.batch)
        resumed = start if start != (0, 0) else None
        marker_first = start.batch == n  # the epoch's batches were all published, its marker not
        if marker_first:
            if epochs is not None and start.epoch >= epochs:
                return
            start = Position(start.epoch + 1, 0)
        noted = False
        if self._stats_note is None:
            self._stats_note = StatsNote(self.name, pipe)
        stream = pipe.stream(start, epochs)
        for info, batch in stream:
            prepared = self._prepare(batch)
            self._usable()
            if self._handle.value is None:
                if resumed:
                    _write_resume_note(self.name, pipe, resumed)
                    noted = True
                else:
                    _remove_resume_note(self.name)  # a note of an earlier run no longer applies
            self._ensure_channel(prepared)
            if self.before_publish is not None:
                self.before_publish(self)
            if marker_first:
                self.end_epoch()
                marker_first = False
            tag = _structure.Tag(
                pipe.fingerprint,
                info.epoch,
                info.index,
                info.start,
                len(info),
                info.rank,
                pipe.world_size,
                len(pipe.ranks),
            )
            self._write(prepared, _structure.encode_tagged(prepared.spec, n, pipe.samples_per_epoch, tag))
            self._stats_note.tick()  # for tsock stat: stage times, workers, cache
            if noted:
                _remove_resume_note(self.name)  # the ring has the position now
                noted = False
            if info.index == n - 1:
                self.end_epoch()
        if marker_first:  # nothing after it: the marker alone
            if self._handle.value is None:
                _write_resume_note(self.name, pipe, resumed)
            self.end_epoch()

    @staticmethod
    def recorded_position(name: str, pipeline: Pipeline | None = None) -> Position | None:
        """Where the producer of channel `name` stopped publishing a Pipeline
        (alive or dead): the epoch and the index of the next batch it would
        have published (index len(pipeline): that epoch's end marker). None
        when there is no such channel or nothing was published on it.

        The position is read from the metadata of the newest batches still
        in the channel's ring (tsock_producer_peek): it was published with
        each batch, atomically, so it is exactly what the readers could
        get. With `pipeline`, a channel of another pipeline (its fingerprint,
        world size or number of ranks differ) raises ValueError."""
        check_name(name)
        lib = library()
        out = _capi.Peek()
        out.size = ctypes.sizeof(out)
        markers = 0
        back = 0
        while True:
            rc = lib.tsock_producer_peek(name.encode(), back, ctypes.byref(out))
            if rc in (_capi.ENOENT, _capi.EAGAIN):  # no channel, or no more batches in its ring
                break
            check(lib, rc, f"read the newest batches of '{name}'")
            if out.flags & _capi.BATCH_EPOCH_END:
                markers += 1
                back += 1
                continue
            tag = _structure.decode_tag(bytes(out.meta[: out.meta_len]))
            if tag is None:
                raise TsockError(
                    f"channel '{name}' was not published from a tsock Pipeline: its batches carry no position",
                    _capi.ECORRUPT,
                )
            if pipeline is not None:
                _check_same_pipeline(name, tag.fingerprint, tag.world_size, tag.ranks, pipeline)
            return _advance(Position(tag.epoch, tag.index + 1), markers)
        # No pipeline batch in the ring: a successor that died before its
        # first one left its starting position in its note.
        note = _read_resume_note(name)
        if note is None:
            if markers:
                raise TsockError(
                    f"channel '{name}': only epoch-end markers among its newest batches, no position to resume from; "
                    "pass start=(epoch, batch)",
                    _capi.EAGAIN,
                )
            return None
        if pipeline is not None:
            _check_same_pipeline(name, note["fingerprint"], note["world_size"], note["ranks"], pipeline)
        return _advance(Position(note["epoch"], note["batch"]), markers)

    # ---- state ----

    def stats(self) -> dict:
        """Counters: readers attached now, batches published (epoch markers
        included), current epoch, seconds spent waiting for slow readers,
        readers reclaimed after dying and evicted, slot geometry."""
        out = {"name": self.name, "slots": self.slots, "slot_bytes": self.slot_bytes}
        if self._handle.value is None or self._closed:
            out.update(readers=0, published=0, epoch=0, backpressure_s=0.0, readers_reclaimed=0, readers_evicted=0)
            return out
        st = _capi.ProducerStats()
        st.size = ctypes.sizeof(st)
        check(self._lib, self._lib.tsock_producer_stats(self._handle, ctypes.byref(st)), "stats")
        out.update(
            readers=st.readers,
            published=st.published,
            epoch=st.epoch,
            backpressure_s=st.backpressure_ns / 1e9,
            readers_reclaimed=st.readers_reclaimed,
            readers_evicted=st.readers_evicted,
        )
        return out

    def reader_pids(self) -> list[int]:
        """The pid of each reader attached now (evicted ones left out), as the
        kernel told it at the join (in this process's pid namespace; 0 when
        not visible here); a process with two readers is there twice. [] once
        closed."""
        if self._handle.value is None or self._closed:
            return []
        count = ctypes.c_uint32(0)
        while True:
            cap = count.value + 8  # room for readers joining meanwhile
            pids = (ctypes.c_int32 * cap)()
            rc = self._lib.tsock_producer_reader_pids(self._handle, pids, cap, ctypes.byref(count))
            check(self._lib, rc, "reader_pids")
            if count.value <= cap:
                return list(pids[: count.value])

    def close(self) -> None:
        """Closes the channel: consumers read what was published, then get
        ChannelClosed. Idempotent."""
        if not self._closed:
            _metrics.retire_producer(self)  # its counters, read once more before the handle goes
            if self._stats_note is not None:
                self._stats_note.remove()
        self._closed = True
        self._finalizer()
        self._slot_views.clear()  # they point into the unmapped segment now
        if self.dataloader is not None and not self._running:
            self.loader.close()  # the Pipeline made of it: its workers are this producer's (else run() closes it)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<tsock.Producer {self.name!r} slots={self.slots} slot_bytes={self.slot_bytes}>"
