"""tsock.shared: trainers launched independently share one producer process,
started by whichever comes first, lingering after the last, and replaced by
one of them if it dies (docs/SHARED.md: the protocol and its failure cases)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import stat
import subprocess
import sys
import threading
import time
import warnings
import weakref
from typing import NamedTuple

from . import _capi, _state
from ._catchup import SKIP_MAX, CatchUp, _behind, _sweep_dead_catchups
from ._factory import _pickled, factory_ref, fingerprint
from ._runtime import (
    ATTACH_SLICE_S,
    Paths,
    check_name_of_run,
    close_lock,
    lock_is_held,
    new_channel,
    open_lock,
    runtime_dir,
    segment_path,
    serials,
    try_lock,
)
from .consumer import Consumer
from .errors import ChannelClosed, ChannelNotFound, Evicted, ProducerGone, TsockError
from .pipeline import Position

KEY_MAX = 40  # shared.UID.KEY stays within a channel name's 64 characters
READY_POLL_S = 0.01  # a trainer waiting for the producer's first batch
START_LOCK_POLL_S = 0.02  # a trainer waiting for another to attach
SLOW_START_WARN_S = 30.0  # then a trainer still waiting says so, naming the producer's log
# A trainer gives up (ProducerGone) once this many producers in a row died
# without a word and without making their channel, over at least this
# long: kills at start-up (an OOM killer, a sweep tool's) are survived, a
# factory that kills its process is not retried forever (review 24, F5).
START_ATTEMPTS = 5
START_BUDGET_S = 30.0
HANDSHAKE_TIMEOUT_S = 120.0  # the producer process's interpreter start, under load
CONSUMER_OPTIONS = ("output", "copy", "lifetime")
PRODUCER_OPTIONS = ("slots", "slot_bytes", "headroom", "join_window", "max_readers", "evict_after")


# ---- starting the producer ----


def start_producer(paths: Paths, spec: dict) -> int:
    """Starts the producer process (its own session, re-parented to init) and
    returns its pid once it holds KEY.alive; TsockError with its stderr if
    it could not start."""
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tsock._shared_run"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
        env=env,
        cwd=spec["cwd"],
    )
    try:
        out, err = proc.communicate(pickle.dumps(spec), timeout=HANDSHAKE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    answer = out.decode(errors="replace").split()
    if len(answer) == 2 and answer[0] == "ok" and answer[1].isdigit():
        return int(answer[1])
    if answer[:1] == ["busy"]:
        return 0  # another producer holds KEY.alive: attach to it
    detail = err.decode(errors="replace").strip()[-2000:] or f"exit status {proc.returncode}, no output"
    full = _full_file_systems(paths.dir)
    raise TsockError(
        f"tsock.shared: the producer process for '{paths.key}' did not start{f' ({full})' if full else ''}: {detail}",
        _capi.ESYS,
    )


# Below this, a file system counts as full: a producer writes its log, its
# notes and its segment's first slots there before it can say it started.
FULL_BELOW_BYTES = 1 << 20


def _full_file_systems(runtime: str) -> str:
    """Which of the runtime directory's and /dev/shm's file systems is full
    (bytes or inodes), said as the cause of a producer that died before its
    channel; "" when neither is (review 27, N9: the trainer said "killed?")."""
    said = []
    for path in (runtime, "/dev/shm"):
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        free = st.f_bavail * st.f_frsize
        if free < FULL_BELOW_BYTES or (st.f_files and st.f_favail == 0):
            said.append(f"{path} is full: {free} bytes and {st.f_favail} inodes free")
    return "; ".join(said)


# ---- the trainer's loader ----

# True in a producer process while it loads the training script (the
# factory is defined there): a shared() call at the script's top level runs
# then, and would start a producer of another key that cannot import it.
_loading_script = False
# This process's open loaders: a recovery attaches its siblings of the same key ahead.
_open_loaders: weakref.WeakSet = weakref.WeakSet()


class SharedLoader(CatchUp):
    """What tsock.shared returns: a loader over the shared producer's batches
    (see tsock.shared)."""

    def __init__(self, factory, args, kwargs, *, name, linger, producer, consumer, start_at=None, state=None):
        ref = factory_ref(factory)
        private = start_at is not None  # a catch-up loader: its key is this trainer's alone
        if state is not None:
            loaded = _state.decode(state)  # before anything starts
            if loaded.world_size:
                raise ValueError("this state is a partitioned consumer's (rank and world size): tsock.shared is not")
            if loaded.started:
                start_at = (loaded.fingerprint, loaded.epoch, loaded.batch)
        self._call = (factory, args, kwargs, producer, consumer)  # for a catch-up producer
        if name is None:
            self.description = fingerprint(ref, args, kwargs)
            key = self.description
        else:
            if not isinstance(name, str) or not name or len(name) > KEY_MAX:
                raise ValueError(f"name must be a str of 1..{KEY_MAX} characters, got {name!r}")
            try:
                self.description = fingerprint(ref, args, kwargs)
            except TypeError:
                self.description = None  # name= is how such arguments are shared
            key = name
        if not isinstance(linger, (int, float)) or linger < 0:
            raise ValueError(f"linger must be seconds >= 0, got {linger!r}")
        from .producer import check_name

        check_name(new_channel(key))
        #: the channel the producer publishes on (a run's own random name)
        self.channel = None
        #: the key trainers share a producer by (name, or the fingerprint)
        self.key = key
        self._spec = {
            "factory": ref,
            "args": _pickled(args, kwargs, script_loaded=ref["file"] is not None or ref.get("main", False)),
            "sys_path": list(sys.path),
            "cwd": os.getcwd(),
            "channel": None,
            "key": key,
            "description": self.description,
            "linger": float(linger),
            "producer": dict(producer),
            "start": start_at and list(start_at[1:]),  # (epoch, batch) where a first producer's run starts
            "private": private,
        }
        self._options = consumer
        self._paths = Paths(runtime_dir(), key)
        self._pid = os.getpid()
        #: producer crashes this trainer went through (each time a successor took over)
        self.recoveries = 0
        #: epochs that started over after a crash (the loader's order is not reproducible)
        self.restarts = 0
        #: batches this trainer did not get (always 0: a Pipeline's are caught up, see catchups)
        self.lost_batches = 0
        #: batches a successor published again that this trainer had (dropped; 0 when it resumed exactly)
        self.repeated_batches = 0
        #: times the producer evicted this trainer (producer={"evict_after": s}); it attached again each time
        self.evictions = 0
        #: epochs completed (each for-loop that ran to its end)
        self.epoch = 0
        #: pid of the producer this trainer reads from
        self.producer_pid = 0
        self._position = start_at  # (fingerprint, epoch, next index) in a pipeline's order
        self._behind_ok = start_at is not None  # batches before the position are expected (skipped, not repeated)
        self._resumed = state is not None and start_at is not None  # a loaded state set the position
        self._resumed_samples = loaded.samples if self._resumed else 0  # samples before it: a whole batch's?
        self._samples = self._resumed_samples  # samples of the position's epoch handed out (state_dict)
        self._catchup = None  # the private loader this trainer reads while behind the shared stream
        self._catchup_epoch_start = False  # it just ended an epoch: try to rejoin first
        # (channel, producer pid, (tag, batches, hold_max) held or None)
        # while it probes the stream
        self._probe = None
        if not private:
            _sweep_dead_catchups(self._paths)
        #: times this trainer was behind the shared stream and caught up on a producer of its own
        self.catchups = 0
        #: times it then went back to the shared stream
        self.rejoins = 0
        #: batches of a stream behind this trainer's resumed position it read and let go
        self.skipped_batches = 0
        self._tagged = None  # the stream carries pipeline tags (None: no batch seen yet)
        self._open = False  # the trainer's epoch in progress has handed out a batch
        self._epoch_done = False  # ended by a tag; the ring's marker may still come
        self._consumer = None
        self._closed = False
        self._announced = False  # the producer being attached to made its channel
        self._ahead_pid = 0  # the producer of the consumer attached ahead (_attach_siblings)
        roster = self._paths.trainer(self._pid, next(serials))
        self._roster = self._paths.join_roster(roster)
        # What the finalizer undoes: the consumer (replaced at each
        # recovery), the roster lock and its file.
        # What the finalizer undoes also holds the consumer attached ahead
        # to a successor for a sibling (_attach_siblings), until it is used.
        self._state = [None, self._roster, roster, self._pid, None]
        self._finalizer = weakref.finalize(self, _detach, self._state)
        # Held while this loader changes consumers: a sibling's recovery
        # attaches it ahead from another thread, perhaps.
        self._switching = threading.RLock()
        try:
            self._use(self._connect(recovering=False))
        except BaseException:
            self.close()
            raise
        _open_loaders.add(self)

    # ---- attaching ----

    def _connect(self, recovering: bool) -> Consumer:
        paths = self._paths
        successor = recovering  # a producer of this trainer's died (not a first start)
        start = open_lock(paths.start)
        try:
            self._take_start_lock(start)
            deaths, since = 0, time.monotonic()
            while True:
                if not lock_is_held(paths.alive):
                    error = paths.read_error() if recovering else None
                    if error is not None:
                        raise self._failed(error, successor)
                    channel, resume = self._run_to_start()
                    start_producer(paths, {**self._spec, "channel": channel, "resume": resume})
                alive = paths.read_alive()
                self._check_description(alive)
                self._announced = False
                consumer = self._attach("now" if recovering else "epoch")
                if consumer is not None:
                    self.producer_pid = int(alive.get("pid", 0))
                    return consumer
                # The producer died before its channel took this trainer.
                error = paths.read_error()
                if error is not None:
                    raise self._failed(error, successor)
                recovering = True  # from here on a KEY.error is this run's, and attaching is start="now"
                if self._announced:  # it got as far as its channel: the factory works
                    deaths, since = 0, time.monotonic()
                deaths += 1
                if deaths >= START_ATTEMPTS and time.monotonic() - since >= START_BUDGET_S:
                    raise ProducerGone(
                        f"tsock.shared: {deaths} producers of '{self.key}' in a row died before making their "
                        f"channel, over {time.monotonic() - since:.0f} s "
                        f"({_full_file_systems(paths.dir) or 'killed? crashed?'}); see {paths.log}",
                        _capi.EPRODUCER_GONE,
                    )
        finally:
            close_lock(start)  # releases KEY.start

    def _run_to_start(self) -> tuple[str, bool]:
        """(channel, resume) of the producer to start, decided under KEY.start.
        A successor on the last producer's channel (it reads where that one
        stopped from its ring, or its resume note) while a live trainer of
        the roster holds a position in that run: this one recovering, one
        busy elsewhere when the producer died while this one arrives (review
        27, N4), or one attached while this one was attaching (N3). A new
        run on a new channel otherwise: nobody holds a position in the last
        one, which its first producer forgets."""
        last = self._paths.read_alive().get("channel")
        if isinstance(last, str) and last in self._paths.live_trainer_channels():
            return check_name_of_run(last), True
        return new_channel(self.key), False

    def _record_channel(self, channel: str) -> None:
        """Writes in this loader's roster file the channel it is attached to
        (under KEY.start, where every producer start is decided): it holds a
        position in that run."""
        if self._roster is None:
            return  # out of the roster: catching up on a producer of its own
        os.ftruncate(self._roster, 0)
        os.pwrite(self._roster, channel.encode(), 0)

    def _enter_roster(self) -> None:
        """Back in the roster (after a catch-up): a new roster file, locked."""
        roster = self._paths.trainer(self._pid, next(serials))
        self._roster = self._paths.join_roster(roster)
        self._state[1], self._state[2] = self._roster, roster

    def _take_start_lock(self, start: int) -> None:
        """KEY.start, waited for in short tries: another trainer holds it
        while its producer runs the factory, and a factory that hangs must
        not leave this one waiting without a word either (review 24, F7)."""
        since, warned = time.monotonic(), False
        while not try_lock(start):
            if not warned and time.monotonic() - since >= SLOW_START_WARN_S:
                warned = True
                self._warn_slow_start(time.monotonic() - since)
            time.sleep(START_LOCK_POLL_S)

    def _failed(self, error: str, successor: bool) -> ProducerGone:
        what = "failed, so no successor was started" if successor else "could not be started"
        return ProducerGone(f"tsock.shared: the producer of '{self.key}' {what}: {error}", _capi.EPRODUCER_GONE)

    def _check_description(self, alive: dict) -> None:
        theirs = alive.get("description")
        if self.description is not None and theirs is not None and theirs != self.description:
            raise ValueError(
                f"tsock.shared: the producer named '{self.key}' runs another pipeline (arguments' fingerprint "
                f"{theirs}, this trainer's {self.description}); use another name= or the same arguments"
            )

    def _ready_channel(self) -> str | None:
        """The channel of the live producer once it said it exists (KEY.ready,
        of its pid), checked to be the segment it made; None before."""
        ready, alive = self._paths.read_ready(), self._paths.read_alive()
        channel = ready.get("channel")
        if not ready.get("pid") or ready.get("pid") != alive.get("pid") or not isinstance(channel, str):
            return None
        check_name_of_run(channel)
        try:
            st = os.stat(segment_path(channel), follow_symlinks=False)
        except FileNotFoundError:
            return None  # the producer is closing it: it lingered out
        if st.st_uid != os.geteuid() or [st.st_dev, st.st_ino] != ready.get("segment"):
            raise TsockError(
                f"tsock.shared: {segment_path(channel)} is not the segment the producer of '{self.key}' made "
                f"(replaced by uid {st.st_uid}?); not attaching",
                _capi.ECORRUPT,
            )
        return channel

    def _attach(self, start: str) -> Consumer | None:
        """A Consumer of the channel, once the producer says it made it (at
        its first batch, after the factory ran), tried in slices while the
        producer lives; None if it died. Never opens what sits at a channel
        name before that: a leftover or a planted file (review 24, F8)."""
        since, warned = time.monotonic(), False
        while lock_is_held(self._paths.alive):
            channel = self._ready_channel()
            self._announced = self._announced or channel is not None
            if channel is None:
                if not warned and time.monotonic() - since >= SLOW_START_WARN_S:
                    warned = True
                    self._warn_slow_start(time.monotonic() - since)
                time.sleep(READY_POLL_S)
                continue
            try:
                consumer = Consumer(channel, start=start, timeout=ATTACH_SLICE_S, **self._options)
            except (ChannelNotFound, ProducerGone):
                continue  # closed meanwhile (the producer lingered out, or died)
            except TsockError as e:
                if e.status != _capi.ETIMEDOUT:
                    raise
                continue  # the producer answered no join in the slice (stopped, starved of CPU): it still lives
            consumer.track_tags = True
            self._record_channel(channel)
            self.channel = channel
            return consumer
        return None

    def _warn_slow_start(self, waited: float) -> None:
        """A factory that hangs (a dead mount) must not leave the trainers
        waiting without a word (review 24, F7)."""
        pid = self._paths.read_alive().get("pid", "?")
        warnings.warn(
            f"tsock.shared: the producer {pid} of '{self.key}' has not published its first batch to this trainer after "
            f"{waited:.0f} s (its factory or loader still running, or stuck?); this trainer waits on while it "
            f"lives; see {self._paths.log}",
            RuntimeWarning,
            stacklevel=5,
        )

    def _use(self, consumer, pending=None) -> None:
        """Makes `consumer` this loader's (and `pending` the one attached ahead)."""
        self._consumer = self._state[0] = consumer
        self._state[4] = pending

    def _recover(self) -> None:
        """The producer died: attach to its successor (starting it if this
        trainer is the first to notice), or take the consumer a sibling's
        recovery attached ahead; then attach ahead this process's other
        loaders of the key still reading the dead producer's ring."""
        with self._switching:
            dead, old, ahead = self.producer_pid, self._consumer, self._state[4]
            self.recoveries += 1
            if ahead is not None:
                self._use(ahead)
                self.producer_pid = self._ahead_pid
            else:
                # The old consumer stays open until this one is attached:
                # its reader lock keeps the dead segment, which holds the
                # position the successor resumes from (read after its
                # factory ran), from being reclaimed by any Create of this
                # user meanwhile (30 s after the dead producer's last
                # publish): the run restarted at epoch 0 (review 27, N5).
                self._use(self._connect(recovering=True), None)
            if old is not None:
                old.close()
        self._attach_siblings(dead)
        if self._tagged is False and self._open:
            self.restarts += 1
            warnings.warn(
                f"tsock.shared: the producer of '{self.key}' died and its successor started the loader over: "
                f"epoch {self.epoch} restarted in this loop (its order is not known to be reproducible: return a "
                "tsock.Pipeline or a seeded map-style DataLoader from the factory for exact resume; its log says why "
                f"this one is not: {self._paths.log})",
                RuntimeWarning,
                stacklevel=4,
            )

    def _attach_siblings(self, dead: int) -> None:
        """This process's other open loaders of the key, still on the dead
        producer's ring: each gets a consumer of the successor now, kept
        until it has read the dead ring out (its ProducerGone), so that it
        loses nothing. The successor waits for every loader of the roster
        before its first batch, and a sibling reads only when this one
        returns (zip(loader_a, loader_b)): without this, the two waited for
        each other for ever (review 27, N6)."""
        for sibling in list(_open_loaders):
            if sibling is self or sibling.key != self.key or sibling._pid != os.getpid():
                continue
            if not sibling._switching.acquire(blocking=False):
                continue  # recovering in another thread by itself
            try:
                if sibling._consumer is None or sibling._state[4] is not None or sibling.producer_pid != dead:
                    continue
                current = sibling.producer_pid
                ahead = sibling._connect(recovering=True)
                sibling._ahead_pid, sibling.producer_pid = sibling.producer_pid, current
                sibling._use(sibling._consumer, ahead)
            finally:
                sibling._switching.release()

    def _reattach_evicted(self) -> None:
        """producer={"evict_after": s}: this trainer held the producer back
        that long and was evicted. It attaches again (start="now"), told;
        a Pipeline's batches published meanwhile come from a catch-up
        producer of its own (its tags show the stream went on), another
        loader's are lost to it. Before, Evicted ended the loader for good,
        and its close() raised too, leaving it in the roster (review 27,
        N8)."""
        old = self._consumer
        self._use(None, self._state[4])
        with contextlib.suppress(TsockError):
            old.close()  # evicted: its batches still referenced cannot be kept
        self.evictions += 1
        warnings.warn(
            f"tsock.shared: this trainer held the producer of '{self.key}' back longer than its evict_after and was "
            "evicted; it attaches again, and the batches published meanwhile come from a producer of its own "
            "(a Pipeline's; another loader's are lost to it)",
            RuntimeWarning,
            stacklevel=4,
        )
        self._use(self._connect(recovering=True), self._state[4])

    # ---- iterating ----

    def _usable(self) -> Consumer:
        self._check_process()
        return self._consumer

    def _check_process(self) -> None:
        if self._closed:
            raise TsockError("tsock.shared loader is closed", _capi.EHANDLE)
        if os.getpid() != self._pid:
            raise TsockError(
                "a tsock.shared loader cannot be used in a forked child; call tsock.shared there", _capi.EFORKED
            )

    def _next_batch(self):
        """The next batch of the trainer's epoch, or None at its end."""
        if self._epoch_done:
            self._epoch_done = False
            return None
        while True:
            if self._catchup is not None:
                self._check_process()
                return self._next_caught_up()
            consumer = self._usable()
            try:
                batch = next(consumer)
            except StopIteration:
                if self._tagged:
                    continue  # pipeline epochs end by their tags
                if not self._open:
                    continue  # an end marker before anything: not an epoch
                return None
            except (ProducerGone, ChannelClosed):
                # Closed: a producer closes only with no reader attached, or
                # when its loader failed (its KEY.error says so).
                self._recover()
                continue
            except Evicted:
                self._reattach_evicted()
                continue
            tag = consumer.last_tag
            self._tagged = tag is not None
            if tag is None or self._take(tag, len(consumer)):
                self._open = True
                return batch

    def _take(self, tag, batches: int) -> bool:
        """Whether a pipeline batch is this trainer's next one; moves the position."""
        pos = self._position
        if pos is not None and tag.fingerprint != pos[0] and self._resumed:
            raise ValueError(
                f"tsock.shared: the state loaded into this loader was saved from another pipeline (fingerprint "
                f"{pos[0].hex()}) than the one '{self.key}' runs ({tag.fingerprint.hex()}): load it into a loader of "
                "the same factory and arguments"
            )
        if pos is not None and tag.fingerprint != pos[0]:
            self.restarts += 1
            warnings.warn(
                f"tsock.shared: the producer of '{self.key}' was replaced by one whose pipeline has another "
                f"fingerprint (not reproducible): epoch {self.epoch} restarts at the next epoch start",
                RuntimeWarning,
                stacklevel=4,
            )
            pos = self._position = None
        if pos is None:
            if tag.index != 0:
                return False  # attached mid-epoch: start with the next one
        else:
            here, want = (tag.epoch, tag.index), (pos[1], pos[2])
            if here < want:
                if not self._behind_ok:
                    self.repeated_batches += 1  # handed out before the crash
                elif _behind(tag, pos, batches) > SKIP_MAX and self._catchup is None:
                    # Reading it up to the position would take the others'
                    # time for each batch (review 29): a producer of its own.
                    self._start_catchup()
                else:
                    self.skipped_batches += 1
                return False
            if here > want:
                # The stream is past this trainer's next batch (it resumed
                # from an older state, was evicted, or a successor did not
                # publish it again): its batches come from a producer of its
                # own from its position, nothing is lost.
                self._start_catchup()
                return False
        if self._resumed and tag.start != self._resumed_samples:
            raise ValueError(
                f"tsock.shared: the loaded state is {self._resumed_samples - tag.start} samples into batch "
                f"{tag.index} (a re-batching Consumer's?): a shared loader hands out whole batches; use a state it "
                "saved, or tsock.Consumer(..., batch_size=) to resume it"
            )
        self._behind_ok = self._resumed = False
        if tag.index + 1 >= batches:
            self._position = (tag.fingerprint, tag.epoch + 1, 0)
            self._samples = 0
            self._epoch_done = True
        else:
            self._position = (tag.fingerprint, tag.epoch, tag.index + 1)
            self._samples = tag.start + tag.samples
        return True

    # ---- resume ----

    def state_dict(self) -> dict:
        """Where this trainer is in the pipeline's order: {"tsock": 48 bytes}
        (the pipeline's fingerprint, the epoch, the samples and batches of it
        handed out). Save it with the model's checkpoint; load_state_dict()
        in a new loader resumes at the next batch. Nothing is snapshotted:
        taking it costs nothing, and so does keeping it up to date."""
        pos = self._catchup._position if self._catchup is not None else self._position
        samples = self._catchup._samples if self._catchup is not None else self._samples
        if pos is None:
            return _state.encode(_state.BEGINNING)
        return _state.encode(_state.State(pos[0], pos[1], samples, pos[2]))

    def load_state_dict(self, state_dict: dict) -> None:
        """Resumes at the position state_dict() gave, before the first batch:
        the next batch is the one after the last the saving loader handed
        out, in the same batches as a run never interrupted. When the shared
        stream is past it, this trainer's batches come from a producer of
        its own until it can rejoin the stream at an epoch start
        (docs/SHARED.md, "Resume"). ValueError for a state of another
        pipeline (at the first batch) or one that is not a tsock state."""
        state = _state.decode(state_dict)
        if self._open or self._position is not None or self.epoch:
            raise ValueError("load_state_dict() must come before the loader's first batch")
        if state.world_size:
            raise ValueError("this state is a partitioned consumer's (rank and world size): tsock.shared is not")
        if not state.started:
            return  # saved before any batch: the beginning, as without a state
        self._position = (state.fingerprint, state.epoch, state.batch)
        self._samples = self._resumed_samples = state.samples
        self._behind_ok = self._resumed = True

    @property
    def position(self):
        """(epoch, batch): the pipeline position of the next batch this
        trainer takes; None before its first pipeline batch."""
        return None if self._position is None else Position(self._position[1], self._position[2])

    def _end_epoch(self) -> None:
        self.epoch += 1
        self._open = False

    def __iter__(self):
        """One epoch, as a DataLoader's iterator; a loop that broke off
        before drops the rest of its epoch first (the producer is shared)."""
        self._check_process()  # now, not at the first next()
        if self._open:
            while self._next_batch() is not None:
                pass
            self._end_epoch()
        return self._epoch()

    def _epoch(self):
        while True:
            batch = self._next_batch()
            if batch is None:
                self._end_epoch()
                return
            yield batch

    def __len__(self) -> int:
        if self._catchup is not None:
            return len(self._catchup)
        while True:
            try:
                return len(self._usable())
            except ProducerGone:
                self._recover()

    # ---- lifecycle ----

    def close(self) -> None:
        """Detaches (the producer lingers, then exits, once no trainer is
        attached). Idempotent."""
        self._closed = True
        self._consumer = None
        if self._catchup is not None:
            self._catchup.close()
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<tsock.SharedLoader key={self.key!r} channel={self.channel!r} producer_pid={self.producer_pid}>"


def _detach(state: list) -> None:
    consumer, roster, path, pid, ahead = state
    if os.getpid() != pid:
        return
    try:
        if ahead is not None:
            ahead.close()
        if consumer is not None:
            with contextlib.suppress(Evicted):  # evicted: nothing left to detach
                consumer.close()
    finally:
        # Whatever close() raised: a loader left in the roster would hold
        # every later producer of the key back for the process's life
        # (review 27, N8). None: out of the roster (catching up on a
        # producer of its own).
        if roster is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
            close_lock(roster)


class SharedProducer(NamedTuple):
    """A running shared producer (tsock.shared_producers)."""

    key: str  #: what its trainers share it by: the name= given, or the arguments' fingerprint
    pid: int  #: its process
    channel: str | None  #: the channel it publishes on (None before its first batch)
    trainers: int  #: loaders attached to it or waiting for it now
    description: str | None  #: the fingerprint of its factory and arguments (None for unnamed objects)


def _held_by_a_producer(path: str) -> bool:
    """Whether `path` (a KEY.alive) is ours and locked: opened without
    creating it, so a query leaves nothing behind."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        if try_lock(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        return True
    finally:
        os.close(fd)


def shared_producers(factory=None, *args, name: str | None = None, **kwargs) -> list[SharedProducer]:
    """The shared producers of this user running on the node, or only the
    one `tsock.shared(factory, *args, name=name, **kwargs)` would attach
    to (give the factory's own arguments, not shared()'s keywords).
    Nothing is started or attached; a tool can watch or stop a producer by
    its pid (SIGTERM lets it finish cleanly: docs/OPERATIONS.md)."""
    if name is not None:
        wanted = name
    elif factory is not None:
        wanted = fingerprint(factory_ref(factory), args, kwargs)
    else:
        wanted = None
    directory = runtime_dir()
    found = []
    for entry in sorted(os.listdir(directory)):
        key, dot, suffix = entry.rpartition(".")
        if suffix != "alive" or not dot or (wanted is not None and key != wanted):
            continue
        paths = Paths(directory, key)
        if not _held_by_a_producer(paths.alive):
            continue
        note = paths.read_alive()
        pid = note.get("pid")
        if not isinstance(pid, int):
            continue  # its producer is writing the note this instant
        ready = paths.read_ready()
        channel = ready.get("channel") if ready.get("pid") == pid else None
        description = note.get("description") if isinstance(note.get("description"), str) else None
        found.append(SharedProducer(key, pid, channel, paths.live_trainers(), description))
    return found


def shared(
    factory,
    *args,
    name: str | None = None,
    linger: float = 5.0,
    producer: dict | None = None,
    output: str = "numpy",
    copy: bool = False,
    lifetime: str = "referenced",
    state: dict | None = None,
    **kwargs,
) -> SharedLoader:
    """A loader over `factory(*args, **kwargs)`'s batches, made once by one
    producer process that every trainer calling shared() with the same
    factory and arguments (or the same `name`) shares: the first caller
    starts it (in its own session: it outlives the trainer that started
    it), later ones attach, it exits `linger` seconds after the last one
    detaches, and if it dies a trainer starts a successor that resumes
    where it stopped. docs/SHARED.md has the details.

    Args:
      factory: an importable function (module level, not a lambda, not
        defined in a notebook) returning a tsock.Pipeline (exact resume after
        a crash) or any re-iterable loader of batches (a DataLoader, a list:
        after a crash the epoch restarts, with a RuntimeWarning; an iterator
        is refused). It runs in the producer.
      args, kwargs: its arguments, pickled to the producer; part of the key.
      name: the key instead of the arguments' fingerprint (needed when an
        argument has no canonical form, such as an object); at most 40 of
        [A-Za-z0-9._-].
      linger: seconds the producer stays once no trainer is attached.
      producer: Producer options (slots, slot_bytes, headroom, join_window,
        max_readers, evict_after), used if this call starts the producer.
      output, copy, lifetime: the Consumer's options.
      state: a loader's state_dict() to resume after: a new run's first
        producer starts there (load_state_dict() after the call would read
        a new run from its beginning up to it).
    """
    if _loading_script:
        raise RuntimeError(
            "tsock.shared was called while the producer process loaded the training script to import the factory "
            'from it: put the script\'s work under `if __name__ == "__main__":` (the producer loads the script '
            "as a module, as multiprocessing's spawn does)"
        )
    producer = dict(producer or {})
    unknown = set(producer) - set(PRODUCER_OPTIONS)
    if unknown:
        raise TypeError(f"producer= takes {PRODUCER_OPTIONS}, not {sorted(unknown)}")
    consumer = {"output": output, "copy": copy, "lifetime": lifetime}
    return SharedLoader(
        factory, args, kwargs, name=name, linger=linger, producer=producer, consumer=consumer, state=state
    )
