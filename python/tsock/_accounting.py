"""Where a consumer's time goes: blocked in next() or spent by the caller.

Two clock reads per batch (time.perf_counter_ns, on entering and leaving
Consumer.__next__), a few integer additions, nothing else: no lock, no
allocation. The names follow Ray Data's iteration metrics
(iter_total_blocked_seconds, iter_user_seconds, iter_batches,
iter_time_to_first_batch_seconds).
"""

from __future__ import annotations

from time import perf_counter_ns

NS = 1e9


class Account:
    """One consumer's counters, in nanoseconds of time.perf_counter_ns.

    blocked: time inside __next__ (waiting for the producer, making the
    batch); user: time between one __next__ returning and the next call
    (the training step, an evaluation between epochs); first: time from the
    consumer's creation (before it attached) to its first batch. Each
    __next__ call adds its span to blocked and the gap before it to user,
    so blocked + user is the wall time from the first call to the end of
    the last one."""

    __slots__ = ("created", "first", "last", "blocked", "user", "batches")

    def __init__(self):
        self.created = perf_counter_ns()
        self.first = None  # ns from created to the first batch
        self.last = 0  # when the last __next__ call ended (0: none yet)
        self.blocked = 0
        self.user = 0
        self.batches = 0

    def call(self, start: int, end: int, got: bool) -> None:
        """Accounts one __next__ call that ran from start to end; got: it
        returned a batch (not StopIteration or an error)."""
        if self.last:
            self.user += start - self.last
        self.blocked += end - start
        self.last = end
        if got:
            self.batches += 1
            if self.first is None:
                self.first = end - self.created

    def stats(self) -> dict:
        """The counters in seconds (see Consumer.stats)."""
        blocked, user = self.blocked / NS, self.user / NS
        busy = blocked + user
        return {
            "batches": self.batches,
            "blocked_s": blocked,
            "user_s": user,
            "time_to_first_batch_s": None if self.first is None else self.first / NS,
            "stall": blocked / busy if busy > 0 else 0.0,
        }
