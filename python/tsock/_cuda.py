"""Consumer(device="cuda:N"): batches on a GPU, by one of two paths.

The device path (DirectOutput): the producer copies every batch once into
its device pool; a consumer on the same GPU opens the pool through CUDA IPC
(tsock_reader_open_device) and gets each tensor as a zero-copy CUDA tensor
(DLPack kDLCUDA). Its current stream is made to wait for the producer's copy
and the batch's slot is held back until the work queued on that stream
before the release has run (tsock_batch_cuda_use): nothing to synchronise by
hand.

The pinned host path (Staging), used where the device path is not open
(the producer has no pool, another GPU, a MIG instance): batches copied to
the GPU by this consumer, the copy of batch n+1 overlapping the trainer's
work on batch n.

The reader's payload mapping is registered as pinned host memory once
(tsock_reader_register_host), so copies out of shared memory are truly
asynchronous. Each batch is taken on the host as usual and every leaf is
copied with non_blocking=True on a dedicated torch.cuda.Stream; an event is
recorded after the batch's copies. next() hands batch n out after making
the caller's current stream wait on n's event (a GPU-side wait: the host
does not block) and after starting the copies of batch n+1. A host batch
stays held until its copies are known complete: before the reader releases
anything (or detaches) it waits on the event of the last copies issued.
The copies were issued one step earlier, so that wait rarely waits.

All CUDA calls go through a backend object (TorchCuda); tests substitute a
fake one to check the scheduling on machines without a GPU.

Imported only when device= is given.
"""

from __future__ import annotations

import warnings

from . import _capi
from .errors import CUDAUnavailable, NoDevicePath, TsockError


def check_device(device, output: str):
    """Validates device= before anything is attached; returns the
    torch.device (with its index), or a JaxGPU for output="jax", or raises
    ValueError / CUDAUnavailable."""
    if output == "jax":
        return _check_jax_device(JaxGPU(cuda_index(device), None))
    if output == "dlpack":
        return DLPackGPU(cuda_index(device))
    if output != "torch":
        raise ValueError(
            f"device={device!r} delivers torch tensors, JAX arrays or DLPack objects: "
            f"pass output='torch', 'jax' or 'dlpack' (got output={output!r})"
        )
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be None or a CUDA device such as 'cuda:0', got {device!r}") from None
    if dev.type != "cuda":
        raise ValueError(f"device must be None or a CUDA device such as 'cuda:0', got {device!r}")
    if torch.version.cuda is None:
        raise CUDAUnavailable(
            f"device={device!r}: this PyTorch ({torch.__version__}) is built without CUDA; "
            "install a CUDA build of PyTorch, or leave device=None for CPU tensors",
            _capi.ENOCUDA,
        )
    if not torch.cuda.is_available():
        raise CUDAUnavailable(
            f"device={device!r}: PyTorch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU "
            "(torch.cuda.is_available() is False: no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides every device)",
            _capi.ENOCUDA,
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        raise ValueError(f"device={device!r}: only {count} CUDA device(s) are visible")
    return torch.device("cuda", index)


class JaxGPU:
    """A JAX GPU device= resolved: its CUDA ordinal (index) and jax device."""

    def __init__(self, index: int, jax_device):
        self.index = index
        self.jax_device = jax_device

    def __str__(self):
        return f"cuda:{self.index}"

    def __repr__(self):
        return f"JaxGPU(cuda:{self.index}, {self.jax_device})"


def cuda_index(device) -> int:
    """The ordinal of "cuda" / "cuda:N" (or a torch.device that prints so)."""
    text = str(device)
    if text == "cuda":
        return 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise ValueError(f"device must be None or a CUDA device such as 'cuda:0', got {device!r}")


class DLPackGPU:
    """device= with output="dlpack": DLPackTensor objects of the device copy,
    ordered on the stream the consumer's from_dlpack passes to __dlpack__.
    Without a framework nothing can copy for this consumer, so the device
    path is the only one (the Consumer opens it itself: no backend)."""

    def __init__(self, index: int):
        self.index = index

    def __str__(self):
        return f"cuda:{self.index}"


def _check_jax_device(device: JaxGPU) -> JaxGPU:
    """device with its jax device, or CUDAUnavailable / ValueError."""
    index = device.index
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        raise CUDAUnavailable(
            f"device='{device}': JAX {jax.__version__} has no GPU backend ({e}); install jax[cuda12], "
            "or leave device=None for host arrays",
            _capi.ENOCUDA,
        ) from None
    if index >= len(gpus):
        raise ValueError(f"device='{device}': JAX sees only {len(gpus)} GPU(s)")
    return JaxGPU(index, gpus[index])


class TorchCuda:
    """The CUDA side of the staging, through torch.cuda, on one device."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def register(self, reader) -> str | None:
        """Pins the reader's payload mapping; returns None, or why it failed."""
        torch = self.torch
        with torch.cuda.device(self.device):
            # Makes the device's (primary) context current on this thread,
            # so the registration happens there rather than on device 0.
            torch.cuda.synchronize()
            rc = reader.lib.tsock_reader_register_host(reader.handle)
        if rc == _capi.OK:
            return None
        detail = reader.lib.tsock_last_error().decode(errors="replace")
        if rc == _capi.ENOCUDA:
            raise CUDAUnavailable(f"device={str(self.device)!r}: {detail}", rc)
        return detail

    def on_stream(self):
        return self.torch.cuda.stream(self.stream)

    # ---- the device path ----

    #: capsules through tsock_batch_cuda_use on the current stream (torch
    #: takes legacy capsules; not DLPack objects, whose versioned capsules
    #: carry a read-only flag older torch refuses)
    takes_objects = False
    #: tsock_batch_cuda_use flags: order on the caller's current stream
    use_flags = 0
    #: torch 1.13 knows no kDLBool: booleans travel as uint8, viewed back
    bool_as_uint8 = True

    def current_stream(self) -> int:
        """The CUstream of the caller's current stream on the device."""
        return self.torch.cuda.current_stream(self.device).cuda_stream

    def from_capsule(self, cap):
        return self.torch.utils.dlpack.from_dlpack(cap)

    def finish(self, t, code: int, copy: bool):
        """A zero-copy device tensor as handed out: booleans viewed back
        from uint8, then a private clone (copy=True) or the read-only guard."""
        if code == _capi.DTYPE_BOOL:
            t = t.view(self.torch.bool)
        if copy:
            return t.clone()
        from . import _torch

        return t.as_subclass(_torch.ReadOnlyTensor)

    def owned(self, host_output, arr, code: int):
        """A batch assembled on the host (re-batching), moved to the device."""
        return host_output.owned_tensor(arr, code).to(self.device)

    def protect(self, base: int, length: int):
        """Guards the device pool's range against in-place writes (the same
        ReadOnlyTensor check as host batches); returns the undo."""
        from . import _torch

        _torch.add_range(base, length)
        return lambda: _torch.remove_range(base, length)

    def copy(self, host):
        return host.to(self.device, non_blocking=True)

    def record(self):
        event = self.torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event) -> None:
        event.synchronize()

    def hand_out(self, event, tensors) -> None:
        stream = self.torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        # The tensors were allocated on the copy stream; tell the caching
        # allocator they are used on the caller's stream too.
        for t in tensors:
            t.record_stream(stream)


class JaxCuda:
    """The device path for JAX: DLPackTensor objects to
    jax.dlpack.from_dlpack (JAX >= 0.7.2 takes no bare capsules), which
    names the stream to order the batch on in __dlpack__(stream=...); where
    it names none, the host waits for the producer's copy and a release
    waits until the device is idle (TSOCK_CUDA_SYNC). JAX arrays are
    immutable, so no write guard is needed."""

    takes_objects = True

    def __init__(self, device: JaxGPU):
        import jax
        import jax.dlpack

        self.jax = jax
        self.device = device

    def from_object(self, obj):
        return self.jax.dlpack.from_dlpack(obj)

    def finish(self, t, code: int, copy: bool):
        return self.jax.numpy.array(t, copy=True) if copy else t

    def owned(self, host_output, arr, code: int):
        return self.jax.device_put(arr, self.device.jax_device)

    def protect(self, base: int, length: int):
        return lambda: None

    def register(self, reader):
        rc = reader.lib.tsock_reader_register_host(reader.handle)
        return None if rc == _capi.OK else reader.lib.tsock_last_error().decode(errors="replace")


def backend(device):
    if isinstance(device, JaxGPU):
        return JaxCuda(device)
    return TorchCuda(device)


class JaxCopyOutput:
    """JAX without the device path: each leaf read from host memory and
    put on the GPU (jax.device_put), waited for before the batch can be
    released, as the transfer reads shared memory."""

    name = "jax"

    def __init__(self, host, backend):
        self._host = host
        self._backend = backend

    def storage_dtype(self, code: int):
        return self._host.storage_dtype(code)

    def view(self, reader, raw, i: int, start=None, stop=None):
        from ._dtypes import numpy_dtype
        from ._output import CODE, numpy_view

        leaf = raw.leaves[i]
        arr = numpy_view(raw.mem, leaf, numpy_dtype(leaf[CODE]), start, stop)
        return self._backend.owned(self._host, arr, leaf[CODE]).block_until_ready()

    def owned(self, arr, code: int):
        return self._backend.owned(self._host, arr, code)


DEVICE_PATHS = ("auto", "require", "never")


class DirectOutput:
    """The torch or JAX output on the device path: each leaf is the batch's
    copy in the producer's device pool, zero-copy, ordered on the caller's
    current stream (torch) or waited for on the host (JAX)."""

    def __init__(self, host, backend, copy: bool, ordinal: int):
        self.name = host.name
        self._host = host
        self._backend = backend
        self.copy = copy
        self._ordinal = ordinal

    def storage_dtype(self, code: int):
        return self._host.storage_dtype(code)

    def view(self, reader, raw, i: int, start=None, stop=None):
        from ._dlpack import DLPackTensor, capsule
        from ._output import CODE

        lib = reader.lib
        backend = self._backend
        code = raw.leaves[i][CODE]
        rows = None if start is None else (start, stop)
        if backend.takes_objects:
            # The array API: the framework's from_dlpack names its stream in
            # __dlpack__(stream=...), which orders the batch there.
            obj = DLPackTensor(lib, raw.lease, i, rows, cuda=self._ordinal, host_wait=True)
            try:
                return backend.finish(backend.from_object(obj), code, self.copy)
            except TsockError as e:
                if e.status != _capi.EPRODUCER_GONE:
                    raise
                return self._from_host(reader, raw, i, start, stop)
        # Once per batch in effect: the same stream again is a no-op in C.
        rc = lib.cuda_use(raw.lease.batch, backend.current_stream(), backend.use_flags)
        if rc == _capi.EPRODUCER_GONE:
            # The producer died, and its device pool with it; the batches
            # it published are still in host memory: copy this one up.
            return self._from_host(reader, raw, i, start, stop)
        if rc:
            from .errors import check

            check(lib, rc, "order the batch on the current CUDA stream")
        as_uint8 = backend.bool_as_uint8 and code == _capi.DTYPE_BOOL
        cap = capsule(lib, raw.lease, i, False, as_uint8, rows, device=True)
        return backend.finish(backend.from_capsule(cap), code, self.copy)

    def owned(self, arr, code: int):
        # Batches re-cut across producer batches are assembled on the host.
        return self._backend.owned(self._host, arr, code)

    def _from_host(self, reader, raw, i: int, start, stop):
        import numpy as np

        from ._output import CODE, numpy_view

        code = raw.leaves[i][CODE]
        arr = np.array(numpy_view(raw.mem, raw.leaves[i], self._host.storage_dtype(code), start, stop))
        return self._backend.owned(self._host, arr, code)


def open_direct(reader, device, backend, host, copy: bool, required: bool):
    """The device path for `reader` if it opens on `device`: (DirectOutput,
    undo of the range guard, None), else (None, None, why not). With
    required, NoDevicePath instead of a why."""

    ordinal, why = reader.open_device()
    index = getattr(device, "index", None)
    if ordinal is not None and index is not None and ordinal != index:
        why = f"the producer's pool is on cuda:{ordinal} of this process, not on {device}"
        ordinal = None
    if ordinal is None:
        if required:
            raise NoDevicePath(f"device_path='require': {why}", _capi.ENODEVICE)
        return None, None, why
    base, length = reader.device_range()
    return DirectOutput(host, backend, copy, ordinal), backend.protect(base, length), None


class Staged:
    """A batch whose copies were started: the batch (None at an epoch's
    end), its event, its device tensors, or the error taking it raised."""

    __slots__ = ("batch", "event", "tensors", "error")

    def __init__(self, batch, event, tensors, error):
        self.batch = batch
        self.event = event
        self.tensors = tensors
        self.error = error


class DeviceOutput:
    """The torch output with every leaf copied to the device as it is made."""

    name = "torch"

    def __init__(self, host, staging):
        self._host = host
        self._staging = staging

    def storage_dtype(self, code: int):
        return self._host.storage_dtype(code)

    def view(self, reader, raw, i: int, start=None, stop=None):
        return self._staging.copy(self._host.tensor(reader, raw, i, start, stop))

    def owned(self, arr, code: int):
        return self._staging.copy(self._host.owned_tensor(arr, code))


class Staging:
    """The copy pipeline of one Consumer (one thread at a time, as it)."""

    def __init__(self, backend, host_output):
        self.backend = backend
        self.output = DeviceOutput(host_output, self)
        self.staged: Staged | None = None  # batch n+1, for the next call
        self._pending = None  # event of the last copies, not known complete
        self._keep: list = []  # sources of those copies, alive until then
        self._issued: list = []
        self._sources: list = []

    def register(self, reader) -> bool:
        """Pins the reader's mapping; False (with a warning) if that failed."""
        why = self.backend.register(reader)
        if why is not None:
            warnings.warn(
                f"tsock: pinning the channel's memory failed, copies to the GPU run unpinned (slower): {why}",
                RuntimeWarning,
                stacklevel=4,
            )
        return why is None

    def copy(self, host):
        t = self.backend.copy(host)
        self._issued.append(t)
        self._sources.append(host)
        return t

    def stage(self, produce) -> Staged:
        """Takes the next batch with produce() (the consumer's host path),
        its leaves copied as they are made, and records their event. An
        error is kept in the result, to be raised when it is handed out."""
        batch = error = event = None
        self._issued, self._sources = [], []
        try:
            with self.backend.on_stream():
                batch = produce()
        except Exception as e:  # noqa: BLE001 - raised by take()
            error = e
        finally:
            tensors, sources = self._issued, self._sources
            self._issued, self._sources = [], []
            if tensors:
                event = self._pending = self.backend.record()
                self._keep.extend(sources)
        return Staged(batch, event, tensors, error)

    def sync(self) -> None:
        """Waits until every copy issued so far is complete (host side).
        The reader calls it before it releases a batch or detaches."""
        event, self._pending = self._pending, None
        if self._issued:  # copies of the batch being staged: those too
            event = self.backend.record()
        if event is not None:
            self.backend.wait(event)
        self._keep.clear()

    def take(self, produce):
        """Batch n for next(): the staged one (or one staged now), after
        starting the copies of batch n+1; None at an epoch's end."""
        cur, self.staged = self.staged, None
        if cur is None:
            cur = self.stage(produce)
        if cur.error is not None:
            raise cur.error
        if cur.batch is None:
            return None
        self.staged = self.stage(produce)
        if cur.event is not None:
            self.backend.hand_out(cur.event, cur.tensors)
        return cur.batch

    def close(self) -> None:
        self.staged = None
