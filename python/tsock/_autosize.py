"""workers="auto": the controller that sizes a Pipeline's worker pool at run
time. Pure logic on measurements handed in (no clock of its own, no
process), so its decisions can be tested with made-up numbers.

Two knobs, sized from two kinds of measurement:

- I/O threads per worker, for the `read` stage: from the stage times. A
  worker's batch costs about max(R / t, C) with R the seconds its reads take
  one after another and C its other stages (source, decode, augment,
  collate, which hold the GIL); t = ceil(MARGIN * R / C) threads hide the
  reads behind the rest, without a core more (a read waiting on a network
  file system uses none).
- Worker processes, for the CPU stages: hill climbing on delivered batches/s
  with hysteresis. Each window (WINDOW_S and at least MIN_BATCHES) gives the
  rate and the fraction of it the consumer of the pool waited for a batch
  (the pool is the bottleneck). While it waits more than GROW_WAIT the
  controller tries one worker more (a quarter more on a pool of 8 or more,
  one more where that count failed), never above the CPU budget; a try that
  does not raise the rate by GAIN is taken back, and that count is not
  tried again for COOLDOWN windows (twice as many after each further
  failure, up to 8 times). While the consumer waits less than
  SHRINK_WAIT for PATIENCE windows in a row (it, or the ring's readers
  behind it, are the bottleneck), it tries one worker less; if the rate
  then drops by GAIN or the consumer starts waiting, the worker comes back
  and fewer are not tried for COOLDOWN windows. The window right after a
  change is not judged (the new worker's start, the pipeline refilling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

WINDOW_S = 1.0
MIN_BATCHES = 4
GROW_WAIT = 0.10
SHRINK_WAIT = 0.02
GAIN = 0.05
PATIENCE = 3
COOLDOWN = 10
MARGIN = 1.5
MAX_THREADS = 64


@dataclass
class Window:
    """What one window measured: seconds it lasted, batches handed out, the
    seconds the pool's consumer waited for a batch, the seconds downstream
    waited for its own consumers (a Producer's ring: None when unknown), and
    the workers' stage seconds of the batches received (by STAGE_NAMES)."""

    seconds: float
    batches: int
    waited: float
    stages: dict
    received: int
    backpressure: float | None = None

    @property
    def rate(self) -> float:
        return self.batches / self.seconds if self.seconds > 0 else 0.0

    @property
    def wait(self) -> float:
        return self.waited / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Decision:
    workers: int
    threads: int
    why: str


@dataclass
class Controller:
    """Sizes workers (1..budget) and I/O threads (1..max_threads; 1 when the
    pipeline has no read stage) from Window measurements."""

    budget: int
    threads_wanted: bool  # the pipeline has a read stage
    max_threads: int = MAX_THREADS
    workers: int = 1
    threads: int = 1
    trial: tuple | None = None  # ("grow" | "shrink", rate before, workers before)
    settle: int = 1  # windows not judged (the first: start-up)
    quiet: int = 0  # windows in a row with the consumer hardly waiting
    no_more: dict = field(default_factory=dict)  # workers count -> windows it is not tried for
    failed: dict = field(default_factory=dict)  # workers count -> its trials taken back
    log: list = field(default_factory=list)  # (workers, threads, why) of each change
    settled_after: int = 0  # windows until the last change

    def __post_init__(self):
        self.budget = max(1, int(self.budget))
        self.workers = max(1, min(self.workers, self.budget))
        self.windows = 0

    def step(self, w: Window) -> Decision | None:
        """Judges one window; a Decision when the pool should change."""
        self.windows += 1
        for k in list(self.no_more):
            self.no_more[k] -= 1
            if self.no_more[k] <= 0:
                del self.no_more[k]
        threads = self._threads(w)
        if threads != self.threads:
            # Threads first: they cost no core. The process count is judged
            # again once the new count has run a window.
            self.threads = threads
            self.trial, self.settle, self.quiet = None, 1, 0
            return self._decide(f"I/O threads {threads} (read {self._share(w):.0%} of a worker's stage time)")
        if self.settle > 0:
            self.settle -= 1
            return None
        consumer_bound = w.wait < SHRINK_WAIT or (w.backpressure is not None and w.backpressure > GROW_WAIT)
        if self.trial is not None:
            kind, before, n = self.trial
            self.trial = None
            if kind == "grow":
                if w.rate < before * (1 + GAIN):
                    self._cool(self.workers)
                    self.workers = n
                    self.settle = 1
                    return self._decide(f"back to {n}: more gave {w.rate:.1f} batches/s against {before:.1f}")
                # kept; go on judging this window as a steady one
            else:
                if w.rate < before * (1 - GAIN) or w.wait > GROW_WAIT:
                    self._cool(self.workers)
                    self.workers = n
                    self.settle = 1
                    return self._decide(
                        f"back to {n}: {n - 1} gave {w.rate:.1f} batches/s against {before:.1f}, "
                        f"consumer waiting {w.wait:.0%}"
                    )
        if w.wait > GROW_WAIT and not consumer_bound:
            self.quiet = 0
            n = min(self.budget, self.workers + max(1, self.workers // 4))  # a quarter more on a large pool
            if n in self.no_more:
                n = self.workers + 1
            if self.workers < n <= self.budget and n not in self.no_more:
                self.trial = ("grow", w.rate, self.workers)
                self.workers, self.settle = n, 1
                return self._decide(f"try {n}: consumer waiting {w.wait:.0%} at {w.rate:.1f} batches/s")
            return None
        if consumer_bound:
            self.quiet += 1
            n = self.workers - 1
            if self.quiet >= PATIENCE and n >= 1 and n not in self.no_more:
                self.quiet = 0
                self.trial = ("shrink", w.rate, self.workers)
                self.workers, self.settle = n, 1
                return self._decide(f"try {n}: consumer waiting {w.wait:.0%} at {w.rate:.1f} batches/s")
        else:
            self.quiet = 0
        return None

    def _cool(self, n: int) -> None:
        """Count n failed: not tried again for a while."""
        self.failed[n] = self.failed.get(n, 0) + 1
        self.no_more[n] = COOLDOWN << min(3, self.failed[n] - 1)

    def _decide(self, why: str) -> Decision:
        self.log.append((self.workers, self.threads, why))
        self.settled_after = self.windows
        return Decision(self.workers, self.threads, why)

    @staticmethod
    def _share(w: Window) -> float:
        total = sum(w.stages.values())
        return w.stages.get("read", 0.0) / total if total > 0 else 0.0

    def _threads(self, w: Window) -> int:
        """The I/O threads that hide the reads behind the other stages."""
        if not self.threads_wanted or w.received == 0:
            return self.threads
        read = w.stages.get("read", 0.0)
        other = sum(v for k, v in w.stages.items() if k != "read")
        if read <= 0:
            return self.threads
        want = self.max_threads if other <= 0 else math.ceil(MARGIN * read / other)
        want = max(1, min(self.max_threads, want))
        # Hysteresis: up at once, down only below half (the read times of a
        # network file system come and go).
        if want > self.threads or want * 2 < self.threads:
            return want
        return self.threads
