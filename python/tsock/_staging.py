"""The pinned host path, used where the device path is not open (the
producer has no pool, another GPU, a MIG instance): batches copied to the
GPU by this consumer, the copy of batch n+1 overlapping the trainer's work
on batch n.

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

JAX without the device path (JaxCopyOutput) puts each leaf on the GPU with
jax.device_put and waits for it before the batch can be released."""

from __future__ import annotations

import warnings


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
