"""Resume: tsock's 48-byte state against torchdata's StatefulDataLoader, in
one run, over the same map-style dataset, batch size, shuffle and workers.

For each system:

- state: the size of state_dict() taken mid-epoch (pickled, for
  StatefulDataLoader's dict of dicts; tsock's is 48 bytes of one key);
- state_dict() call: its median time mid-epoch;
- per step: what having resume costs a step. StatefulDataLoader against a
  plain DataLoader of the same configuration (its workers send their state
  with every batch at the default snapshot_every_n_steps=1): time per step
  over a run of steps, the median of 3 alternated runs each; tsock: the Consumer's time per next() with the ring
  full (the producer ahead), its position tracking against a no-op in its
  place, alternated round by round in one consumer (the fastest round of
  each);
- first batch after resume, at an early and a late step of an epoch: a new
  loader given the state until its first batch (tsock: the producer
  restarted at the state, Producer.run(start=state), and Consumer(state=);
  StatefulDataLoader: load_state_dict() then next()), the batch checked
  against the uninterrupted run's.

    python bench/resume.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BATCH = 64
NOTES = (
    "Dataset: map-style, each sample a 3x32x32 float32 array computed from its index (about 0.1 ms of numpy), "
    "label = index; batches of 64, shuffled with a fixed seed, 2 worker processes. StatefulDataLoader is torchdata's "
    "at its defaults (snapshot_every_n_steps=1). tsock's first batch after resume includes starting the producer's "
    "pipeline workers and creating its channel; StatefulDataLoader's includes starting its workers."
)


class Synthetic:
    """Sample i: a 3x32x32 float32 array made from i (some numpy work, as a
    decode would be), and the label i."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = np.sin(np.arange(3 * 32 * 32, dtype=np.float32) * (i + 1) * 1e-3).reshape(3, 32, 32)
        return np.tanh(x * 0.5 + x**2 * 0.1), i


def _median_call_us(fn, calls: int = 20) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


# ---- torchdata ----


def _torch_loader(n: int, stateful: bool, workers: int):
    import torch
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    gen = torch.Generator()
    gen.manual_seed(0)
    cls = StatefulDataLoader if stateful else DataLoader
    return cls(Synthetic(n), batch_size=BATCH, shuffle=True, generator=gen, num_workers=workers)


def _steps_per_s(loader, steps: int) -> float:
    it = iter(loader)
    next(it)  # workers started
    t = time.perf_counter()
    for _ in range(steps):
        next(it)
    return steps / (time.perf_counter() - t)


def torchdata_figures(n: int, workers: int, positions: list[int], steps: int) -> dict:
    rates = {True: [], False: []}
    for _ in range(3):  # alternated: the machine's load drifts
        for stateful in (False, True):
            rates[stateful].append(_steps_per_s(_torch_loader(n, stateful, workers), steps))
    plain, stateful = statistics.median(rates[False]), statistics.median(rates[True])
    loader = _torch_loader(n, True, workers)
    reference = [b[1].tolist() for b in loader]  # the uninterrupted epoch (epoch 0)
    out = {"steps_per_s_plain": plain, "steps_per_s": stateful, "resume": []}
    for k in positions:
        loader = _torch_loader(n, True, workers)
        it = iter(loader)
        for _ in range(k):
            next(it)
        state = loader.state_dict()
        out["state_bytes"] = len(pickle.dumps(state))
        out["state_dict_us"] = _median_call_us(loader.state_dict)
        del it, loader
        t = time.perf_counter()
        resumed = _torch_loader(n, True, workers)
        resumed.load_state_dict(state)
        first = next(iter(resumed))
        took = time.perf_counter() - t
        out["resume"].append({"step": k, "first_batch_s": took, "exact": first[1].tolist() == reference[k]})
        del resumed
    return out


# ---- tsock ----


class _NoTracking:
    """A stand-in for the Consumer's position deque: the A/B baseline."""

    def append(self, _):
        pass

    def popleft(self):
        return (None, None)

    def clear(self):
        pass

    def __bool__(self):
        return False


def _serve(pipe, channel: str, epochs: int, start=None, **options):
    import tsock

    producer = tsock.Producer(pipe, channel, wait_readers=1, **options)

    def run():
        try:
            producer.run(epochs=epochs, start=start)
        except tsock.TsockError:
            if not producer._closed:
                raise  # closed under it by the measurement: that is how it stops

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return producer, thread


def _pipeline(n: int, workers: int):
    import tsock

    return tsock.Pipeline(Synthetic(n), batch_size=BATCH, seed=0, workers=workers)


def _consumer_step_us(channel: str, pipe, rounds: int) -> dict:
    """A Consumer's time per next() with the ring full (no waiting for the
    producer): rounds alternate the position tracking and a no-op in its
    place, in one consumer; the fastest round of each (the machine is
    shared: a round preempted midway says nothing about the code)."""
    import tsock

    slots, per_round = 32, 24
    producer, thread = _serve(pipe, channel, epochs=None, slots=slots)
    times = {"tracking": [], "none": []}
    with tsock.Consumer(channel, timeout=60) as c:
        tracking = c._made
        it = iter(c)
        next(it)
        for r in range(rounds):
            mode = "tracking" if r % 2 == 0 else "none"
            c._made = tracking if mode == "tracking" else _NoTracking()
            time.sleep(0.3)  # the producer fills the ring again
            t = time.perf_counter()
            for _ in range(per_round):
                try:
                    next(it)
                except StopIteration:
                    it = iter(c)
            times[mode].append((time.perf_counter() - t) / per_round)
        c._made = tracking
    producer.close()
    thread.join(60)
    return {mode: 1e6 * min(v) for mode, v in times.items()}


def tsock_figures(n: int, workers: int, positions: list[int], steps: int, channel: str) -> dict:
    import tsock

    with _pipeline(n, 0) as ref_pipe:
        reference = [b[1].tolist() for b in ref_pipe.batches(0)]
    with _pipeline(n, workers) as pipe:
        step = _consumer_step_us(channel, pipe, rounds=6 if steps < 50 else 40)
    out = {"step_us": step["tracking"], "step_us_untracked": step["none"], "resume": []}
    for k in positions:
        pipe = _pipeline(n, workers)
        producer, thread = _serve(pipe, channel, epochs=1)
        with tsock.Consumer(channel, timeout=60) as c:
            it = iter(c)
            for _ in range(k):
                next(it)
            state = c.state_dict()
            out["state_bytes"] = len(state["tsock"])
            out["state_dict_us"] = _median_call_us(c.state_dict)
        producer.close()
        thread.join(60)
        pipe.close()
        t = time.perf_counter()
        pipe = _pipeline(n, workers)
        producer, thread = _serve(pipe, channel, epochs=1, start=state)
        with tsock.Consumer(channel, timeout=60, state=state) as c:
            first = next(iter(c))
            took = time.perf_counter() - t
            exact = first[1].tolist() == reference[k]
        producer.close()
        thread.join(60)
        pipe.close()
        out["resume"].append({"step": k, "first_batch_s": took, "exact": exact})
    return out


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller dataset and fewer steps (the smoke run)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    a.n = 1280 if a.quick else 12800  # 20 or 200 batches an epoch
    a.steps = 10 if a.quick else 150
    batches = a.n // BATCH
    a.positions = [2, batches - 3]
    return a


def measure(a: argparse.Namespace) -> dict:
    channel = f"bench-resume-{os.getpid()}"
    res = {
        "samples": a.n,
        "batch": BATCH,
        "workers": a.workers,
        "torchdata": torchdata_figures(a.n, a.workers, a.positions, a.steps),
        "tsock": tsock_figures(a.n, a.workers, a.positions, a.steps, channel),
        "notes": NOTES,
    }
    try:
        import torchdata

        res["torchdata_version"] = torchdata.__version__
    except ImportError:
        pass
    return res


def table(res: dict) -> list[str]:
    td, ts = res["torchdata"], res["tsock"]
    rows = [
        "| | tsock | StatefulDataLoader |",
        "| --- | --- | --- |",
        f"| state | {ts['state_bytes']} bytes | {td['state_bytes']} bytes (pickled) |",
        f"| state_dict() call | {ts['state_dict_us']:.1f} us | {td['state_dict_us']:.1f} us |",
        f"| a step with resume against without | {ts['step_us']:.1f} / {ts['step_us_untracked']:.1f} us per next() "
        f"= {ts['step_us'] / ts['step_us_untracked']:.2f} (ring full) | {1e6 / td['steps_per_s']:.0f} / "
        f"{1e6 / td['steps_per_s_plain']:.0f} us per step (DataLoader) = "
        f"{td['steps_per_s_plain'] / td['steps_per_s']:.2f} (throughput) |",
    ]
    for a, b in zip(ts["resume"], td["resume"]):
        exact = {True: "exact", False: "WRONG BATCH"}
        rows.append(
            f"| first batch after resume at step {a['step']} | {1e3 * a['first_batch_s']:.0f} ms ({exact[a['exact']]})"
            f" | {1e3 * b['first_batch_s']:.0f} ms ({exact[b['exact']]}) |"
        )
    return rows


def main(argv=None) -> int:
    a = parse(argv)
    res = measure(a)
    print(f"{a.n} samples, batches of {BATCH}, {a.workers} workers")
    print("\n".join(table(res)))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    wrong = [r for s in ("tsock", "torchdata") for r in res[s]["resume"] if not r["exact"]]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
