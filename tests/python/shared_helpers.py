"""Factories and a trainer for the tsock.shared tests: a module of its own,
so that the producer process imports the factories by name."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import tsock


class Ids:
    """Sample i: a small array made from i, and the label i (the sample id)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.full((4,), i, np.float32), i


def slow(sample, rng):
    """About 1 ms a sample: the producer is the bottleneck, so a kill lands
    in the middle of an epoch rather than between runs."""
    time.sleep(0.001)
    return sample


def pipeline(n: int, batch_size: int, token: str = ""):
    """A shuffled Pipeline over Ids(n); `token` only makes the key unique to a test."""
    return tsock.Pipeline(Ids(n), batch_size=batch_size, seed=7)


def slow_pipeline(n: int, batch_size: int, token: str = ""):
    """With worker processes: forked by the producer, they must not keep its
    KEY.alive lock (a successor would wait for them) and die with it."""
    return tsock.Pipeline(Ids(n), batch_size=batch_size, seed=7, augment=slow, workers=2)


def _paced(sample, rng):
    time.sleep(0.03)
    return sample


def producer_bound(n: int, batch_size: int, token: str = ""):
    """About 0.12 s a batch of 4: the trainers wait at the head of the ring
    (the stream moves at its producer's pace)."""
    return tsock.Pipeline(Ids(n), batch_size=batch_size, seed=7, augment=_paced)


def unseeded(n: int, batch_size: int, token: str = ""):
    """A Pipeline whose seed is drawn anew by each producer: not reproducible
    (its fingerprint changes), so a successor cannot resume it."""
    return tsock.Pipeline(Ids(n), batch_size=batch_size, seed=int.from_bytes(os.urandom(7), "little"))


def plain(n: int, batch_size: int, token: str = ""):
    """Not a Pipeline: a list of (x, ids) batches, in order (no resume)."""
    return [
        (np.zeros((min(batch_size, n - s), 4), np.float32), np.arange(s, min(s + batch_size, n)))
        for s in range(0, n, batch_size)
    ]


def gated_pipeline(n: int, batch_size: int, token: str, gate_dir: str):
    """pipeline(), made once `gate_dir`/go exists; each producer running it
    first leaves a file factory.PID there (a test kills it at that point)."""
    open(os.path.join(gate_dir, f"factory.{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(gate_dir, "go")):
        time.sleep(0.01)
    return pipeline(n, batch_size)


class StuckUntil:
    """An augment stage that blocks (a dead mount, say) until `gate_dir`/go
    exists; each worker process running it leaves a file worker.PID there."""

    def __init__(self, gate_dir: str):
        self.gate_dir = gate_dir

    def __call__(self, sample, rng):
        open(os.path.join(self.gate_dir, f"worker.{os.getpid()}"), "w").close()
        while not os.path.exists(os.path.join(self.gate_dir, "go")):
            time.sleep(0.05)
        return sample


def stuck_pipeline(n: int, batch_size: int, token: str, gate_dir: str):
    """A Pipeline whose two workers block in their first sample."""
    return tsock.Pipeline(Ids(n), batch_size=batch_size, seed=7, augment=StuckUntil(gate_dir), workers=2)


class StallAfter:
    """An augment stage that passes `count` samples, then blocks each later
    one until `gate_dir`/go exists: a producer running it publishes a batch
    or so and then publishes nothing, with its trainers waiting in next()."""

    def __init__(self, count: int, gate_dir: str):
        self.count = count
        self.gate_dir = gate_dir

    def __call__(self, sample, rng):
        self.count -= 1
        while self.count < 0 and not os.path.exists(os.path.join(self.gate_dir, "go")):
            time.sleep(0.05)
        return sample


def stalling_pipeline(n: int, batch_size: int, token: str, gate_dir: str):
    """pipeline(), stalled after its first batch (StallAfter)."""
    return tsock.Pipeline(Ids(n), batch_size=batch_size, seed=7, augment=StallAfter(batch_size, gate_dir))


def generator(n: int, batch_size: int, token: str = ""):
    """Not re-iterable: its batches come once (an iterator, refused)."""
    return (batch for batch in plain(n, batch_size))


def dying(n: int, batch_size: int, token: str = ""):
    """Ends its process without a word (a crash in native code, say)."""
    os._exit(3)


def failing_once_marked(n: int, batch_size: int, token: str, marker: str):
    """pipeline(), until the file `marker` exists: then the factory fails
    (a catch-up producer started after that)."""
    if os.path.exists(marker):
        raise RuntimeError("the catch-up factory fails: the dataset moved")
    return pipeline(n, batch_size)


def failing(n: int, batch_size: int, token: str = ""):
    raise ValueError(f"dataset {n} is not there (token {token})")


def failing_later(n: int, batch_size: int, token: str = ""):
    """A pipeline whose stage raises from epoch 1 on: the producer fails after epoch 0."""
    return tsock.Pipeline(Ids(n), batch_size=batch_size, seed=1, augment=RaiseAfter(n))


class RaiseAfter:
    """An augment stage that raises after its first `n` samples (epoch 0's,
    with workers=0: it counts in the producer process)."""

    def __init__(self, n: int):
        self.n = n
        self.calls = 0

    def __call__(self, sample, rng):
        self.calls += 1
        if self.calls > self.n:
            raise ValueError("bad sample in the second epoch")
        return sample


def train(factory_name: str, n: int, batch_size: int, token: str, epochs: int, stop_file: str = "") -> None:
    """A trainer: prints one JSON line per epoch (the sample ids it got, the
    producer's pid) and a last one with its counters. With stop_file, it runs
    epochs until that file exists (at least `epochs`)."""
    factory = getattr(sys.modules[__name__], factory_name)
    loader = tsock.shared(factory, n, batch_size, token, linger=0.5, output="numpy")
    print(json.dumps({"attached": loader.producer_pid}), flush=True)
    e = 0
    while e < epochs or (stop_file and not os.path.exists(stop_file)):
        ids = []
        for _x, y in loader:
            ids += np.asarray(y).tolist()
        print(json.dumps({"epoch": e, "ids": ids, "pid": loader.producer_pid}), flush=True)
        e += 1
    print(
        json.dumps(
            {
                "recoveries": loader.recoveries,
                "restarts": loader.restarts,
                "lost": loader.lost_batches,
                "repeated": loader.repeated_batches,
            }
        ),
        flush=True,
    )
    loader.close()
