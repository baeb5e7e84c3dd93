"""Resume: tsock's 48-byte state against torchdata's StatefulDataLoader, in
one run, over the same map-style dataset, batch size, shuffle and workers.

For each system:

- state: the size of state_dict() taken mid-epoch (pickled, for
  StatefulDataLoader's dict of dicts; tsock's is 48 bytes of one key);
- state_dict() call: its median time mid-epoch;
- per step: what having resume costs a step. StatefulDataLoader against a
  plain DataLoader of the same configuration (its workers send their state
  with every batch at the default snapshot_every_n_steps=1); tsock's
  Consumer with its position tracking against the same Consumer with it
  replaced by a no-op (A/B in one process);
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
    plain = _steps_per_s(_torch_loader(n, False, workers), steps)
    stateful = _steps_per_s(_torch_loader(n, True, workers), steps)
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


def _serve(pipe, channel: str, epochs: int, start=None):
    import tsock

    producer = tsock.Producer(pipe, channel, wait_readers=1)

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


def tsock_figures(n: int, workers: int, positions: list[int], steps: int, channel: str) -> dict:
    import tsock

    with _pipeline(n, 0) as ref_pipe:
        reference = [b[1].tolist() for b in ref_pipe.batches(0)]
    rates = {}
    for mode in ("tracking", "none", "tracking2", "none2"):  # alternated: the machine's load drifts
        pipe = _pipeline(n, workers)
        producer, thread = _serve(pipe, channel, epochs=None)
        with tsock.Consumer(channel, timeout=60) as c:
            if mode.startswith("none"):
                c._made = _NoTracking()
            it = iter(c)
            next(it)
            t = time.perf_counter()
            for _ in range(steps):
                try:
                    next(it)
                except StopIteration:
                    it = iter(c)
            rates.setdefault(mode.rstrip("2"), []).append(steps / (time.perf_counter() - t))
        producer.close()
        thread.join(60)
        pipe.close()
    out = {"steps_per_s": max(rates["tracking"]), "steps_per_s_untracked": max(rates["none"]), "resume": []}
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
        f"| steps/s with resume, against without | {ts['steps_per_s']:.0f} / {ts['steps_per_s_untracked']:.0f} "
        f"= {ts['steps_per_s'] / ts['steps_per_s_untracked']:.2f} | {td['steps_per_s']:.0f} / "
        f"{td['steps_per_s_plain']:.0f} (DataLoader) = {td['steps_per_s'] / td['steps_per_s_plain']:.2f} |",
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
