"""A tsock.shared trainer behind its stream (resumed from an older state,
evicted, or not published again by a successor): it reads a producer of
its own, the same pipeline from its position, then rejoins the stream
(docs/SHARED.md, "Resume from a trainer's checkpoint")."""

from __future__ import annotations

import contextlib
import os
import re

from ._runtime import (
    ATTACH_SLICE_S,
    Paths,
    check_name_of_run,
    close_lock,
    lock_is_held,
    open_lock,
    pid_alive,
    remove_if_ours,
    segment_path,
    serials,
)
from .consumer import Consumer
from .errors import TsockError

SKIP_MAX = 16  # batches of a stream behind its position a trainer reads and lets go, rather than catch up
CATCHUP_LINGER_S = 0.5  # a catch-up producer's linger after its trainer rejoined or left


class CatchUp:
    """The catch-up half of SharedLoader: leaving the stream for a producer
    of its own, and rejoining it."""

    def _start_catchup(self) -> None:
        """This trainer is behind the shared stream (resumed from an older
        state, or a successor did not publish its next batch): it leaves the
        stream and the roster (the shared producer must not wait for it) and
        reads its own producer, the same pipeline from its position."""
        factory, args, kwargs, producer, consumer = self._call
        # Its one reader is this trainer, whom nobody else waits for: an
        # eviction would only nest another catch-up in it (review 29).
        producer = {k: v for k, v in producer.items() if k != "evict_after"}
        key = f"{self.key[:20]}.c{self._pid}.{next(serials)}"
        self._leave_shared()
        _sweep_dead_catchups(self._paths)
        try:
            catchup = type(self)(
                factory,
                args,
                kwargs,
                name=key,
                linger=CATCHUP_LINGER_S,
                producer=producer,
                consumer=consumer,
                start_at=self._position,
            )
        except BaseException:
            # Its producer failed (the factory's error is raised): nothing of
            # the key is left, and the trainer is back on the stream, where
            # its next batch tries again.
            _forget_private_key(Paths(self._paths.dir, key))
            self._join_shared()
            raise
        catchup._samples = self._samples
        # The loaded state's checks go with the position, to the catch-up's first batch.
        catchup._resumed, catchup._resumed_samples = self._resumed, self._resumed_samples
        self._resumed = False
        self._catchup = catchup
        self.catchups += 1

    def _join_shared(self) -> None:
        """Back in the roster and attached to the shared stream (its producer
        started again if it is gone)."""
        self._enter_roster()
        self._consumer = self._connect(recovering=False)

    def _leave_shared(self) -> None:
        """Detaches from the shared stream and leaves its roster."""
        consumer, self._consumer = self._consumer, None
        ahead, self._state[4] = self._state[4], None
        self._probe = None
        self._state[0] = None
        if consumer is not None:
            consumer.close()
        if ahead is not None:
            # Attached ahead to a successor by a sibling loader's recovery:
            # left open, it was a reader that never reads (review 30, F5).
            ahead.close()
        roster_fd, roster = self._state[1], self._state[2]
        self._state[1] = self._roster = None
        if roster_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(roster)
            close_lock(roster_fd)

    def _next_caught_up(self):
        """The next batch from the catch-up producer (None at an epoch's
        end). At an epoch start the trainer attaches to the shared stream
        again; once the stream's oldest batch is its next one, it goes back
        to the stream (_rejoined)."""
        if self._catchup_epoch_start:
            self._catchup_epoch_start = False
            if self._consumer is None:
                self._probe_shared()
        if self._consumer is not None and self._rejoined():
            return self._next_batch()
        catchup = self._catchup
        batch = catchup._next_batch()
        self._position, self._samples = catchup._position, catchup._samples
        if batch is None:
            self._catchup_epoch_start = True
        else:
            self._open = True
        return batch

    def _probe_shared(self) -> None:
        """Attaches to the shared stream with start="oldest": its first batch
        is the oldest one a trainer of the stream has not let go (the
        slowest one's next), which the ring keeps for this trainer from the
        attach on. Nothing happens if the stream is gone or not ready."""
        start = open_lock(self._paths.start)
        try:
            # Under KEY.start, as any attach: the roster file names the
            # channel, which decides whether a successor resumes this run
            # (review 29: a trainer that rejoined was invisible to it).
            self._take_start_lock(start)
            if not lock_is_held(self._paths.alive):
                return
            channel = self._ready_channel()
            if channel is None:
                return
            pid = int(self._paths.read_alive().get("pid", 0))
            self._enter_roster()
            try:
                consumer = Consumer(channel, start="oldest", timeout=ATTACH_SLICE_S, **self._options)
            except TsockError:
                self._leave_shared()
                return
            self._record_channel(channel)
        finally:
            close_lock(start)
        self._state[0] = self._consumer = consumer
        consumer.track_tags = True
        self._probe = (channel, pid, None)

    def _rejoined(self) -> bool:
        """Whether the trainer is back on the shared stream, which it probed
        at an epoch start. The stream's oldest batch, once there is one, is
        held (the producer cannot overwrite it) while the catch-up producer
        serves the batches before it, up to half the ring (review 28, F7:
        before, a trainer at the others' pace never rejoined, and one whose
        stream took more than 1 s per batch was never seen to). A stream
        further ahead, or gone, or a hold the producer's eviction policy
        ended, leaves the trainer on its own producer until the next epoch
        start."""
        channel, pid, held = self._probe
        want = self._position
        consumer = self._consumer
        try:
            if held is None:
                tag = consumer._peek_tag(0)
                if tag is None:
                    if consumer._pending:  # a batch, but not a pipeline's
                        self._leave_shared()
                    return False  # nothing in its ring yet: look again at the next batch
                # The same pipeline as the catch-up's: its epochs are as
                # long. The stream's len() would wait for a batch (review
                # 30, F3).
                slots = consumer._reader.slot_count()
                held = tag, len(self._catchup), max(1, slots // 2)
                self._probe = (channel, pid, held)
            tag, batches, hold_max = held
            behind = _behind(tag, want, batches)
            if tag.fingerprint != want[0] or behind > SKIP_MAX or -behind > hold_max:
                self._leave_shared()  # past this trainer by more than it may hold, or too far behind
                return False
            if behind < 0:
                return False  # its own producer serves the batches before the held one
            consumer._reader.check_claim()  # evicted while it held the batch: it may be another by now
        except TsockError:
            self._leave_shared()  # the shared producer died, closed, or evicted it meanwhile
            return False
        self.channel, self.producer_pid = channel, pid
        catchup, self._catchup = self._catchup, None
        # The catch-up handed out its epoch's last batch, and the held one
        # starts the next: this loop ends first (review 30, F4: the two
        # epochs ran as one).
        self._epoch_done = catchup._epoch_done
        catchup.close()
        self._behind_ok = True
        self._probe = None
        self.rejoins += 1
        return True


_PRIVATE_KEY = re.compile(r".*\.c(\d+)\.\d+")


def _forget_private_key(paths: Paths) -> None:
    """Removes a catch-up key's files, its channel's segment and its resume
    note (kept in the runtime directory: review 27, N2); its producer and
    its trainer are gone."""
    from .producer import resume_note_path

    channel = paths.read_alive().get("channel")
    if isinstance(channel, str):
        with contextlib.suppress(TsockError):
            check_name_of_run(channel)
            for path in (segment_path(channel), resume_note_path(channel, paths.dir)):
                remove_if_ours(path)
    for path in (paths.ready, paths.error, paths.log, paths.alive, paths.start):
        remove_if_ours(path)
    with contextlib.suppress(OSError):
        for entry in os.listdir(paths.dir):
            if entry.startswith((paths.trainer_prefix, f"{paths.key}.joining.")):
                remove_if_ours(os.path.join(paths.dir, entry))  # its trainer's roster file: dead too


def _sweep_dead_catchups(paths: Paths) -> None:
    """Catch-up keys whose trainer and producer were killed together (an
    OOM kill, a job killed whole) left a segment and files that nobody
    would remove: a trainer of the same key removes them (review 28)."""
    try:
        entries = os.listdir(paths.dir)
    except OSError:
        return
    prefix = paths.key[:20] + ".c"
    for entry in entries:
        key, _, suffix = entry.rpartition(".")
        if suffix != "alive" or not key.startswith(prefix):
            continue
        found = _PRIVATE_KEY.fullmatch(key)
        if found is None or pid_alive(int(found.group(1))):
            continue
        private = Paths(paths.dir, key)
        if lock_is_held(private.alive):
            continue  # its producer lingers still
        _forget_private_key(private)


def _behind(tag, position: tuple, batches: int) -> int:
    """Batches from the stream's batch `tag` to `position` (fingerprint,
    epoch, index): > 0 when the stream is behind it, < 0 when past it."""
    return (position[1] - tag.epoch) * batches + position[2] - tag.index
