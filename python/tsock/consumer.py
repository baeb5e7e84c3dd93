"""Consumer: a trainer's drop-in replacement for its DataLoader."""

from __future__ import annotations

import collections
import math
import numbers
import sys
import time
import weakref
from time import perf_counter_ns

from . import _accounting, _capi, _lifetime, _partition, _placement, _state, _structure
from . import metrics as _metrics
from ._reader import Raw, Reader
from ._rebatch import Rebatched, Whole
from .errors import ChannelClosed, TsockError

_START = {"epoch": _capi.START_NEXT_EPOCH, "now": _capi.START_NOW, "oldest": _capi.START_OLDEST}
LIFETIMES = ("referenced", "step")


def _close_reader(reader: Reader, life, unprotect, undo: list) -> None:
    try:
        # Batches still referenced are kept before the reader lets go of
        # their slots; then the reader detaches whatever happened.
        life.close()
    finally:
        try:
            reader.detach()
        finally:
            if unprotect is not None:
                unprotect(reader.base, reader.length)
                for base, length in reader.slot_ranges():
                    unprotect(base, length)
            for fn in undo:
                fn()


class _Epoch:
    """iter(consumer): one epoch of it, like a DataLoader's iterator. Spent at
    the epoch's end, or once a newer iter() of the consumer started."""

    __slots__ = ("_consumer", "_iteration", "_spent")

    def __init__(self, consumer: Consumer, iteration: int):
        self._consumer = consumer
        self._iteration = iteration
        self._spent = False

    def __iter__(self):
        return self

    def __next__(self):
        c = self._consumer
        if self._spent or c._iterations != self._iteration:
            raise StopIteration
        try:
            return c.__next__()
        except StopIteration:
            self._spent = True
            raise


# The name of the profiler range around Consumer.__next__: stock profiles
# and TensorBoard's profiler count ranges named "enumerate(DataLoader)#..."
# as the input pipeline's time (PyTorch's DataLoader iterators name theirs
# so).
PROFILE_NAME = "enumerate(DataLoader)#tsock.Consumer.__next__"


def _profiled():
    """torch.autograd.profiler.record_function while PyTorch's profiler runs
    (torch imported and a profile active), else None: nothing is entered
    per batch when no profiler runs."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    profiler = getattr(getattr(torch, "autograd", None), "profiler", None)
    if profiler is None or not getattr(profiler, "_is_profiler_enabled", False):
        return None
    return profiler.record_function


def _closed_message(name: str, epochs: int) -> str:
    """ChannelClosed in words: what happened, from this consumer's side."""
    if epochs == 0:
        return f"channel '{name}': the producer closed it before this consumer read any batch; nothing more will come"
    done = "1 epoch" if epochs == 1 else f"{epochs} epochs"
    return (
        f"channel '{name}': the producer closed it after its last epoch, and this consumer has read every batch "
        f"it published ({done} here); there is no further epoch to read"
    )


def _check_rank(state, rank, world_size) -> None:
    """ValueError unless a loaded state is this consumer's rank's."""
    if state.started and (state.rank, state.world_size) != (rank or 0, world_size or 0):
        raise ValueError(
            f"the state is rank {state.rank} of {state.world_size}'s, this consumer is rank {rank} of "
            f"{world_size}'s (0 of 0: not partitioned)"
        )


class Consumer:
    """Reads the batches a Producer publishes on channel `name`, zero-copy.

    Iterate it like a DataLoader: each for-loop yields the batches of one
    epoch, in the producer's structure (tuples, lists, dicts of tensors), then
    stops::

        with tsock.Consumer("sweep", output="torch") as c:
            for epoch in range(3):
                for x, y in c:
                    ...

    A batch is a view of shared memory, zero-copy, and stays what it was for
    as long as anything refers to it, as a DataLoader's batches do: keep
    batches in a list, across steps, past close(), or hand them to JAX's
    asynchronous dispatch. A batch goes back to the producer once nothing
    refers to it any more; one still referenced when the consumer needs its
    slot (it holds at most half the ring) is copied out once, just the
    tensors referenced, into private memory at the same addresses. The
    plain loop, which keeps nothing, copies nothing. lifetime="step" gives
    the old contract instead, without bookkeeping: a batch is valid until
    the next one is taken. Batches are read-only: numpy arrays have
    flags.writeable False, torch tensors are ReadOnlyTensor and raise
    ReadOnlyBatchError on in-place writes; x.clone() (torch) or x.copy()
    (numpy) gives a writable copy; JAX arrays are immutable.

    Each for-loop (each iter()) is one epoch, as with a DataLoader: a loop
    that breaks off early (a step limit, a debug break) drops the rest of
    its epoch, and the next loop starts the next epoch. The dropped batches
    are read and let go as the producer publishes them, since the producer
    is shared with other trainers: the next loop's first batch comes when
    the producer reaches the next epoch. next(consumer) goes on with the
    epoch in progress. One thread at a time may use a Consumer.

    Args:
      name: the channel name.
      batch_size: re-batch to this many samples per batch (every leaf is cut
        along its first dimension; leaves must share it). None keeps the
        producer's batches. Every sample is delivered exactly once per epoch,
        in order; batches within one producer batch are zero-copy slices,
        batches that straddle two are copies.
      drop_last: with batch_size, drop an epoch's last, incomplete batch (as
        DataLoader does).
      output: "numpy", "torch" or "jax"; or "dlpack" for objects with
        __dlpack__ that any framework's from_dlpack() takes.
      copy: deliver private, writable copies instead of shared-memory views.
      carry_over: False (default): iter() starts an epoch, dropping the rest of
        one a loop broke off. True: the old behaviour, iter() returns the
        consumer itself, and a loop that breaks off leaves the rest of its
        epoch to the next loop.
      lifetime: "referenced" (default): a batch stays valid while anything
        refers to it (see above; on the device path, torch and JAX batches
        are private copies on the GPU for that reason). "step": valid until
        the next batch is taken, after which the producer may rewrite it
        under anything kept; zero-copy device tensors on the device path.
      start: "epoch" (default): start with the producer's current epoch if
        this consumer attaches within the producer's join_window, else with
        the next epoch; "now": with the next batch published (the default
        with `state`); "oldest": with the oldest batch in the ring another
        consumer has not let go yet (the slowest one's next), or as "now".
      state: a state_dict() of an earlier consumer of the same pipeline:
        resume after the last batch it handed out (see load_state_dict).
      timeout: seconds to wait for the channel to appear; None (default):
        wait for the producer however long it takes to start (its dataset
        set-up may take minutes), printing a line on stderr after 5 s and
        every 30 s while waiting; 0: fail at once with ChannelNotFound.
        Waiting for batches has no limit:
        a dead producer ends it (ProducerGone) within about 50 ms, and
        Ctrl-C interrupts it.
      device: None (default), or a CUDA device ("cuda", "cuda:1", a
        torch.device) with output="torch": every batch is copied to that GPU
        (private, writable tensors). The channel's memory is pinned once
        (cuMemHostRegister), copies run non_blocking on a dedicated CUDA
        stream, and the copy of the next batch overlaps the caller's work on
        the current one: next() returns batch n once batch n+1 is taken and
        its copy started, with the caller's current stream made to wait for
        n's copy. CUDAUnavailable when PyTorch has no CUDA or sees no GPU.
        When the producer has a device pool on that same GPU
        (Producer(device=...)), batches are instead read from its copy
        there (the device path; see `placement`): copied on the GPU into
        tensors of the caller's (lifetime="referenced": device memory
        cannot be swapped like host memory, and a batch kept in the pool
        would stall the producer), or zero-copy read-only CUDA tensors
        (lifetime="step"), ordered on the caller's current stream.
      device_path: with device, "auto" (default): the device path where it
        opens, else the pinned host path; "require": NoDevicePath where it
        does not open; "never": always copy (the pinned host path).
      rank, world_size: read a partitioned channel (a tsock.Pipeline with
        world_size=) as rank `rank` of `world_size`: only this rank's
        batches are delivered, the same samples per epoch as
        torch.utils.data.DistributedSampler(num_replicas=world_size,
        rank=rank) gives it; the other ranks' batches are let go unread.
        Both or neither. PartitionMismatch when they do not fit the
        channel (see docs/PIPELINE.md, "Partition mode").

    Raises ProducerGone when the producer dies (after every batch it
    published), ChannelClosed when an epoch is asked for after the producer
    closed the channel, Evicted when the producer's eviction policy dropped
    this reader.
    """

    def __init__(
        self,
        name: str,
        *,
        batch_size: int | None = None,
        drop_last: bool = False,
        output: str = "numpy",
        copy: bool = False,
        start: str | None = None,
        timeout: float | None = None,
        device=None,
        device_path: str = "auto",
        lifetime: str = "referenced",
        carry_over: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        state: dict | None = None,
    ):
        if not isinstance(name, str):
            raise TypeError(f"channel name must be str, got {type(name).__name__}")
        if batch_size is not None:
            if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
                raise TypeError(f"batch_size must be a positive int or None, got {batch_size!r}")
            if batch_size < 1:
                raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
            batch_size = int(batch_size)
        resume = None if state is None else _state.decode(state)  # before attaching
        if start is None:
            start = "epoch" if resume is None else "now"  # a stream past it is refused, not skipped a whole epoch
        if start not in _START:
            raise ValueError(f"start must be 'epoch', 'now' or 'oldest', got {start!r}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"timeout must be None or seconds >= 0, got {timeout!r}")
        if lifetime not in LIFETIMES:
            raise ValueError(f"lifetime must be one of {LIFETIMES}, got {lifetime!r}")
        rank, world_size = _partition.check(rank, world_size)
        if resume is not None:
            _check_rank(resume, rank, world_size)  # before attaching
        from ._output import OUTPUTS

        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {sorted(OUTPUTS)}, got {output!r}")
        if device is not None:
            device = _placement.check(device, device_path, output)  # before attaching
        self.name = name
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self.copy = bool(copy)
        #: "referenced" or "step" (see the class's documentation)
        self.lifetime = lifetime
        #: iter() goes on where the last loop stopped (True) or starts an epoch
        self.carry_over = bool(carry_over)
        self._open = False  # a batch of the epoch in progress was delivered
        self._skip = False  # drop the rest of it first (iter() after a break)
        self._iterations = 0  # iter() calls: an older _Epoch iterator is spent
        self._out = OUTPUTS[output](self.copy)
        #: epochs completed by this consumer; during an epoch, its number (from 0)
        self.epoch = 0
        #: the producer's number of the epoch of the last batch read (None before any)
        self.producer_epoch = None
        self._pending: list[Raw] = []  # acquired ahead (len() peeks), not yet used
        self._layout = None
        self._delivered = 0  # batches made in the epoch in progress
        self._closed_seen = False
        self._started = False  # a batch was taken
        self._last_meta = None  # metadata of the last producer batch taken
        # (metadata, rows cut from it) where each batch made and not yet
        # handed out ends (the pinned host path makes one ahead), and where
        # the last one handed out ends: the state.
        self._made = collections.deque(maxlen=4)
        self._handed = (None, None)
        self._resume = None  # a loaded state, until the stream reaches its position
        self._resume_rows = 0  # rows of the first batch after it that were handed out before
        #: this consumer's rank and the job's world size (None: not partitioned)
        self.rank, self.world_size = rank, world_size
        self._ranks = _partition.Ranks(name, rank, world_size)
        self._closed = False
        #: tsock.shared sets it: last_tag is then the pipeline tag (or None)
        #: of the producer batch the last batch came from
        self.track_tags = False
        self.last_tag = None
        # What refers to shared memory is tracked where the caller gets
        # views of it: host batches, and output="dlpack" on the device path
        # (the only zero-copy device output by default). Copies need none.
        keeping = lifetime == "referenced" and not self.copy and (device is None or output == "dlpack")
        # Re-batching holds the batch being cut and the next one at most; on
        # the device path released batches stay held while the GPU reads
        # them, so it keeps a few more. Keeping, batches are held while
        # referenced, up to half the ring (_lifetime.Referenced.limit; the C
        # reader clamps HOLD_MAX to the ring).
        max_held = _lifetime.HOLD_MAX if keeping else 2 if device is None else 4
        if keeping and world_size:
            # A batch of this rank still referenced holds the other ranks'
            # after it (see _lifetime.Referenced.ranks).
            max_held = min(_capi.MAX_HELD, max_held * world_size)
        self._acct = _accounting.Account()  # before attaching: time to first batch counts the wait for the producer
        _metrics.track_consumer(self)  # for tsock.metrics (its exporter, if the environment asks, starts now)
        self._reader = Reader(name, _START[start], timeout, max_held=max_held, keeping=keeping)
        self._keeping = keeping
        if keeping:
            self._life = _lifetime.Referenced(self._reader, output, device is not None)
            self._life.max_held = max_held
        else:
            self._life = _lifetime.Step(self._reader)
        unprotect = None
        if output == "torch":
            from . import _torch

            _torch.add_range(self._reader.base, self._reader.length)
            self._reader.on_mapped = _torch.add_range
            self._reader.on_retired = unprotect = _torch.remove_range
        self._undo: list = []  # more to undo at close (the device range guard)
        self._finalizer = weakref.finalize(self, _close_reader, self._reader, self._life, unprotect, self._undo)
        #: the CUDA device batches are delivered on, or None
        self.device = device
        #: where batches come from: "host" (shared memory), "pinned" (shared
        #: memory pinned for copies to `device`) or "device" (the producer's
        #: device pool, zero-copy)
        self.placement = "host"
        #: why the device path is not used (None when it is, or not asked for)
        self.placement_note = None
        self._gpu = None  # the copy pipeline of the pinned host path (_staging.Staging)
        if device is not None:
            try:
                placed = _placement.place(self._reader, self._out, device, device_path, self.copy, lifetime)
            except BaseException:
                self.close()
                raise
            self._out, self._gpu = placed.output, placed.staging
            self.placement, self.placement_note = placed.where, placed.note
            self._undo.extend(placed.undo)
        if batch_size is None:
            self._cutter = Whole(self._out, self._reader)
        else:
            self._cutter = Rebatched(self._out, self._reader, batch_size, self.drop_last)
        if resume is not None:
            self.load_state_dict(state)

    # ---- resume ----

    def state_dict(self) -> dict:
        """Where this consumer is in the pipeline's order: {"tsock": 48 bytes}
        (the pipeline's fingerprint, the epoch, the samples and the next
        batch of it, the rank). Save it with the model's checkpoint; a new
        consumer given it (state=, or load_state_dict before its first
        batch) hands out the batches after the last one this one handed
        out, the same batches as a run never interrupted. Nothing is
        snapshotted: it is read from the tag of the last batch handed out,
        which costs a step well under a microsecond. Needs a tsock.Pipeline
        producer (TypeError otherwise: its batches carry no position)."""
        if self._resume is not None:
            return _state.encode(self._resume)  # loaded, not reached yet
        meta, rows = self._handed
        if meta is None:
            return _state.encode(_state.BEGINNING)
        tag = _structure.decode_tag(meta)
        if tag is None:
            raise TypeError(
                f"channel '{self.name}': the producer's batches carry no position in a known order, so this "
                "consumer has no state to save; publish a tsock.Pipeline (docs/PIPELINE.md)"
            )
        rows = tag.samples if rows is None else rows
        step = tag.ranks if tag.world_size else 1  # a rank's batches are `ranks` apart
        if rows < tag.samples:
            index, samples = tag.index, tag.start + rows
        else:
            index, samples = tag.index + step, tag.start + tag.samples
        epoch = tag.epoch
        if self._skip or self._epoch_ends_at(index, samples):
            # The rest of the epoch will not be handed out: a new iter()
            # drops it, or it is shorter than a batch that drop_last drops.
            epoch, index, samples = epoch + 1, tag.index % step, 0
        return _state.encode(_state.State(tag.fingerprint, epoch, samples, index, tag.rank, tag.world_size))

    def _epoch_ends_at(self, index: int, samples: int) -> bool:
        """Whether nothing of the epoch is handed out after this position."""
        layout = self._layout
        if layout is None:
            return False
        if layout.batches is not None and index >= layout.batches:
            return True
        if self.drop_last and self.batch_size is not None and layout.samples is not None:
            return layout.samples // self._ranks.ranks - samples < self.batch_size
        return False

    def load_state_dict(self, state_dict: dict) -> None:
        """Resumes at a state_dict()'s position, before the first batch: the
        batches before it are read and let go (the stream is behind it);
        a stream already past it raises ValueError at the first batch, since
        what lies between was published before this consumer attached:
        start the producer there (Producer.run(start=...)), or share it with
        tsock.shared, whose trainers catch up on their own."""
        state = _state.decode(state_dict)
        if self._handed[0] is not None or self._delivered or self.epoch or self._open:
            raise ValueError("load_state_dict() must come before the consumer's first batch")
        _check_rank(state, self.rank, self.world_size)
        self._resume = state if state.started else None

    def _reached(self, raw: Raw) -> bool:
        """Whether raw is at the loaded state's position (the earlier ones
        are let go); raw is let go before an error is raised."""
        state = self._resume
        tag = _structure.decode_tag(raw.meta)
        problem = None
        if tag is None:
            problem = TypeError("the state needs a tsock.Pipeline producer; this channel's batches carry no position")
        elif tag.fingerprint != state.fingerprint:
            problem = ValueError(
                f"the state was saved from another pipeline (fingerprint {state.fingerprint.hex()}) than channel "
                f"'{self.name}' publishes ({tag.fingerprint.hex()})"
            )
        else:
            here, want = (tag.epoch, tag.index), (state.epoch, state.batch)
            if here < want:
                self._release(raw)
                return False
            rows = state.samples - tag.start
            if here > want:
                problem = ValueError(
                    f"channel '{self.name}' is past the state's position (epoch {state.epoch}, batch {state.batch}; "
                    f"its next batch is {tag.epoch}, {tag.index}): start the producer at the position "
                    "(Producer.run(start=...)), attach before it gets there, or use tsock.shared, which catches up"
                )
            elif not 0 <= rows < max(1, tag.samples):
                problem = ValueError(
                    f"the state's position (epoch {state.epoch}, batch {state.batch}, sample {state.samples}) is not "
                    f"one of channel '{self.name}''s batches (batch {tag.index} holds samples {tag.start} to "
                    f"{tag.start + tag.samples - 1}): its pipeline is laid out otherwise (another ranks= of a node?)"
                )
            elif rows and self.batch_size is None:
                problem = ValueError("the state was saved part of the way into a producer batch: give batch_size=")
            else:
                self._resume, self._resume_rows = None, rows
                return True
        self._release(raw)
        raise problem

    def _first_row(self) -> int:
        """Rows of the first batch taken after a resume that were handed out
        before it (the re-batching cutter starts there); 0 afterwards."""
        rows, self._resume_rows = self._resume_rows, 0
        return rows

    # ---- lifecycle ----

    def close(self) -> None:
        """Detaches from the channel (the producer stops waiting for this
        reader). Batches still referenced stay valid (lifetime="referenced":
        they are copied out first) or read stale bytes ("step"), never
        fault. Idempotent."""
        self._closed = True
        self._pending = []
        cutter = getattr(self, "_cutter", None)  # None: closed during __init__
        if cutter is not None:
            cutter.forget()
        if self._gpu is not None:
            self._gpu.close()
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"epoch {self.epoch}"
        where = "" if self.device is None else f" device={self.device}"
        return f"<tsock.Consumer {self.name!r} output={self._out.name}{where} batch_size={self.batch_size} {state}>"

    # ---- iteration ----

    def __iter__(self):
        """An iterator over one epoch, as a DataLoader's: if a loop broke off
        in the middle of the epoch before, the rest of that epoch is dropped
        and this one starts with the next epoch (with carry_over=True: the
        consumer itself, which goes on where the last loop stopped)."""
        if self.carry_over:
            return self
        if self._open:
            self._skip = True
        self._iterations += 1
        return _Epoch(self, self._iterations)

    def __next__(self):
        """The next batch of the epoch in progress; StopIteration at its end
        (the following call starts the next epoch). Under PyTorch's
        profiler the call shows as a DataLoader's does (see _profiled); its
        time and the caller's between calls are accounted (stats())."""
        start = perf_counter_ns()
        got = False
        try:
            batch = self._next_profiled()
            got = True
            return batch
        finally:
            self._acct.call(start, perf_counter_ns(), got)

    def stats(self) -> dict:
        """Where this consumer's time went, as Ray Data's iteration metrics
        count it: `batches` handed out; `blocked_s`, seconds the caller was
        blocked in next() (waiting for the producer, making the batch);
        `user_s`, seconds between one next() returning and the next call
        (the caller's steps); `time_to_first_batch_s`, from the consumer's
        creation to its first batch (None before it); `stall`, blocked_s /
        (blocked_s + user_s). Costs two clock reads per batch; see
        docs/METRICS.md for the Prometheus exporter."""
        out = self._acct.stats()
        out.update(name=self.name, rank=self.rank, epoch=self.epoch)
        return out

    def _next_profiled(self):
        """__next__ without the accounting (the benchmark's baseline)."""
        record = _profiled()
        if record is None:
            return self._next_batch()
        with record(PROFILE_NAME):
            return self._next_batch()

    def _next_batch(self):
        if self._closed:
            raise TsockError("consumer is closed", _capi.EHANDLE)
        if self._skip:
            self._skip_rest()
        if self._gpu is None:
            batch = self._next_host()
        else:
            batch = self._gpu.take(self._next_host)
        if batch is None:
            self.epoch += 1
            self._delivered = 0
            self._open = False
            raise StopIteration
        self._open = True
        if self._made:
            self._handed = self._made.popleft()
        return batch

    def _skip_rest(self) -> None:
        """Drops the rest of the epoch in progress (a new iter() after a loop
        broke off). The producer is shared, so it does not skip them: its
        batches up to the epoch's end are read and let go as they come."""
        self._skip = False
        end_seen = self._cutter.drop(self)  # re-batching: read with the last, partial batch
        if self._gpu is not None:
            # The batch staged (copied ahead) belongs to the dropped epoch.
            staged, self._gpu.staged = self._gpu.staged, None
            end_seen = end_seen or (staged is not None and staged.batch is None and staged.error is None)
        while not end_seen:
            raw = self._take(1)  # 1: a close without an epoch-end marker ends the epoch
            if raw is None:
                break
            self._release(raw)
        self._made.clear()
        self._handed = (self._last_meta, None)  # the epoch's batches are behind this consumer
        self.epoch += 1
        self._delivered = 0
        self._open = False

    def _next_host(self):
        """The next batch of the epoch in the output's form, or None at its
        end. Counted here, where it is made: the pinned host path makes batch
        n+1 before it hands batch n out."""
        cutter = self._cutter
        batch = cutter.next(self)
        if batch is not None:
            self._delivered += 1
            if type(cutter) is Rebatched and cutter._cur is not None:
                self._made.append((cutter._cur.meta, cutter._off))  # a producer batch cut part of the way
            else:
                self._made.append((self._last_meta, None))
        return batch

    def __len__(self) -> int:
        """Batches per epoch, after re-batching. Before the first batch this
        waits for it (the producer's sizes travel with every batch). TypeError
        if the producer's loader has no length."""
        layout = self._layout or self._peek_layout()
        if self.batch_size is None:
            if layout.batches is None:
                raise TypeError("the producer's loader has no len(), so neither has this consumer")
            return layout.batches // self._ranks.ranks  # a rank's share: every rank has as many
        if layout.samples is None:
            raise TypeError(
                "the producer's loader does not tell its number of samples, so a re-batching consumer has no len()"
            )
        samples = layout.samples // self._ranks.ranks
        if self.drop_last:
            return samples // self.batch_size
        return math.ceil(samples / self.batch_size)

    def _peek_layout(self):
        while True:
            if self._keeping:
                self._life.settle()
            raw = self._reader.acquire()
            if not raw.end and not self._mine(raw):
                self._release(raw)  # another rank's: let go unread
                continue
            self._pending.append(raw)
            if not raw.end:
                self._layout = raw.layout
                return raw.layout
            # A marker first (started with "now" at an epoch end): its lease
            # may go, the record of it stays pending.
            self._release(raw)

    def _peek_tag(self, timeout: float):
        """The pipeline tag of the next batch, which stays pending for next();
        None when none comes within `timeout` seconds (tsock.shared's probe
        of a stream it may rejoin) or it is not a pipeline's."""
        deadline = time.monotonic() + timeout
        while True:
            if self._keeping:
                self._life.settle()
            raw = self._reader.acquire(deadline)
            if raw is None:
                return None
            if raw.end:
                self._release(raw)  # a marker first: the stream's next batch is what counts
                continue
            self._pending.append(raw)
            return _structure.decode_tag(raw.meta)

    def _take(self, rows_so_far: int) -> Raw | None:
        """The next producer batch of this epoch (of this consumer's rank),
        or None at its end."""
        while True:
            if self._pending:
                raw = self._pending.pop(0)
                if not raw.end:
                    # Acquired ahead (a peek), perhaps long ago: evicted
                    # since, its slot may hold another batch (review 30, F2).
                    self._reader.check_claim()
            else:
                if self._keeping:
                    self._life.settle()
                try:
                    raw = self._reader.acquire()
                except ChannelClosed as closed:
                    # Closed without an epoch-end marker: what was read is an
                    # epoch. Asking for another raises.
                    if self._closed_seen or (self._delivered == 0 and rows_so_far == 0):
                        raise ChannelClosed(_closed_message(self.name, self.epoch), closed.status) from None
                    self._closed_seen = True
                    return None
            self.producer_epoch = raw.epoch
            if raw.end:
                self._release(raw)
                if not self._started or self._resume is not None:
                    # Joined ("now") just before an epoch-end marker: the
                    # first epoch starts after it, not empty.
                    continue
                return None
            if not self._mine(raw):
                self._release(raw)  # another rank's: let go unread
                continue
            self._layout = raw.layout
            if self._resume is not None and not self._reached(raw):
                continue
            self._last_meta = raw.meta
            if self.track_tags:
                self.last_tag = _structure.decode_tag(raw.meta)
            return raw

    def _mine(self, raw: Raw) -> bool:
        """Whether raw (a batch, not a marker) is for this consumer's rank
        (_partition.Ranks); raw is let go before an error is raised, so the
        consumer can still be closed, or read on past a batch it refused."""
        self._started = True  # an epoch with batches of other ranks only is an (empty) epoch
        if self.rank is None and raw.meta[:4] != _structure.MAGIC_TAGGED:
            return True  # the common case, per batch: no rank asked, no pipeline tag to check
        try:
            mine = self._ranks.mine(raw)
        except TsockError:
            self._release(raw)
            raise
        if self._keeping:
            self._life.ranks = self._ranks.ranks
        return mine

    def _release(self, raw: Raw | None) -> None:
        """The consumer is done with raw: its slot goes back now (Step), or
        once nothing refers to it (Referenced.settle)."""
        if raw is not None:
            raw.done = True
            if not self._keeping and raw.lease.valid:
                self._reader.release(raw)
