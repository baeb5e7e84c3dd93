"""Pipeline(workers="auto") against a sweep of hand-set worker counts, same
run, on two sources:

- io: read = a sleep of --read-ms per sample (a network file system's
  latency, no CPU), decode a few microseconds;
- decode: no read, decode = --decode-ms of CPU per sample holding the GIL.

Each hand-set configuration runs --seconds after a warm-up of one second
(--repeats times, alternating the order; the median);
auto runs --auto-seconds from a cold start (its workers start at the first
batch). Reported per source: batches/s of every configuration, the best
hand-set one (and the best with no more workers than the CPU budget: on a
machine shared with CPU hogs more processes than CPUs take a larger share
of them, which auto's budget forbids), the best one run again right after
auto (a back-to-back pair, as the load drifts over a sweep), auto's rate over its last --tail seconds as a ratio of that
best, auto's rate over the whole run, and the time auto took to settle (its
last change to the configuration it ended with, not counting tries taken
back). The consumer sums every batch.

    python bench/autosize.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from argparse import Namespace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

BATCH = 16
NOTES = """The I/O-bound source sleeps in `read` (no CPU: a network file system's latency); the decode-bound one
burns CPU in `decode`, holding the GIL. Hand-set configurations are `workers=N` (each sample's stages in turn,
as before) and, for the I/O source, `io_threads=T` too. `workers="auto"` (with `io_threads="auto"` on the I/O
source: read threads are opt-in) starts from one worker and one read thread, with cpu_budget = the CPUs of the
process. The machine is shared with other jobs: ratios within 10% of
1 are equal."""


class _Read:
    """read: a sleep of `ms` (a network file system's latency), then 1 KiB."""

    def __init__(self, ms: float):
        self.ms = ms

    def __call__(self, i):
        time.sleep(self.ms / 1000)
        return int(i).to_bytes(8, "little") * 128


def decode_bytes(b):
    return np.frombuffer(b, np.uint8).astype(np.float32)


class _Burn:
    """decode: about `ms` of CPU per sample (numpy in small steps: holds the GIL)."""

    def __init__(self, ms: float):
        self.ms = ms
        self.steps = None

    def calibrate(self) -> None:
        x = np.arange(256, dtype=np.uint64)
        n, t0 = 0, time.process_time()
        while time.process_time() - t0 < 0.2:
            x = self._step(x)
            n += 1
        self.steps = max(1, int(n * self.ms / 1000 / (time.process_time() - t0)))

    @staticmethod
    def _step(x):
        return (x * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)) >> np.uint64(1)

    def __call__(self, i):
        x = np.full(256, i, np.uint64)
        for _ in range(self.steps):
            x = self._step(x)
        return x.astype(np.float32)


def _pipeline(source: str, a: Namespace, burn, **kw):
    import tsock

    n = 1 << 20  # long enough never to end an epoch
    if source == "io":
        return tsock.Pipeline(range(n), batch_size=BATCH, read=_Read(a.read_ms), decode=decode_bytes, seed=0, **kw)
    return tsock.Pipeline(range(n), batch_size=BATCH, decode=burn, seed=0, **kw)


def _run(pipe, seconds: float, warmup: float) -> dict:
    """Batches/s over `seconds` after `warmup`, and the rate over time."""
    t_start = time.monotonic()
    marks = []  # (seconds since start, batches)
    n = 0
    t_end = t_start + warmup + seconds
    for batch in pipe.batches(0):
        float(batch.sum())
        n += 1
        now = time.monotonic()
        marks.append((now - t_start, n))
        if now >= t_end:
            break
    pipe.close()
    after = [(t, k) for t, k in marks if t >= warmup]
    t0, k0 = after[0] if after else marks[0]
    t1, k1 = marks[-1]
    return {"batches_per_s": (k1 - k0) / (t1 - t0) if t1 > t0 else 0.0, "marks": marks}


def _rate_between(marks, t_from: float) -> float:
    after = [(t, k) for t, k in marks if t >= t_from]
    if len(after) < 2:
        return 0.0
    return (after[-1][1] - after[0][1]) / (after[-1][0] - after[0][0])


def settled_at(changes: list, final: tuple) -> float:
    """When the pool reached the configuration it ended with for good: the
    time of the last change into it, tries that were taken back skipped."""
    at = 0.0
    cfg = None
    for i, (t, workers, threads, why) in enumerate(changes):
        new = (workers, threads)
        taken_back = why.startswith("try") and i + 1 < len(changes) and changes[i + 1][3].startswith("back to")
        if taken_back or why.startswith("back to") and new == cfg:
            continue
        if new != cfg:
            cfg, at = new, t
    return at if cfg == final or cfg is None else changes[-1][0]


def measure(a: Namespace, log=print) -> dict:
    burn = _Burn(a.decode_ms)
    burn.calibrate()
    budget = len(os.sched_getaffinity(0))
    res = {"batch": BATCH, "read_ms": a.read_ms, "decode_ms": a.decode_ms, "budget": budget, "sources": []}
    res.update(seconds=a.seconds, repeats=a.repeats, tail=a.tail)
    sweeps = {
        "io": [{"workers": w} for w in a.io_workers] + [{"workers": w, "io_threads": BATCH} for w in (1, budget)],
        "decode": [{"workers": w} for w in a.decode_workers],
    }
    for source, configs in sweeps.items():
        rates: list = [[] for _ in configs]
        for rep in range(a.repeats):  # the sweep's repeats alternate direction
            for k in range(len(configs)) if rep % 2 == 0 else reversed(range(len(configs))):
                rates[k].append(_run(_pipeline(source, a, burn, **configs[k]), a.seconds, 1.0)["batches_per_s"])
        rows = []
        for kw, rs in zip(configs, rates):
            rows.append({"config": kw, "batches_per_s": statistics.median(rs), "runs": rs})
            log(f"  {source:6} {_label(kw):>24}: {statistics.median(rs):7.1f} batches/s (median of {len(rs)})")
        best = max(rows, key=lambda r: r["batches_per_s"])
        within = [r for r in rows if r["config"]["workers"] <= budget]
        best_in = max(within, key=lambda r: r["batches_per_s"]) if within else best
        # Read threads are opt-in (a read must be thread-safe): this read is.
        auto = {"workers": "auto", "io_threads": "auto"} if source == "io" else {"workers": "auto"}
        pipe = _pipeline(source, a, burn, **auto)
        r = _run(pipe, a.auto_seconds, 0.0)
        changes = [list(c) for c in pipe._pool_box[0].changes]
        final = (pipe._pool_box[0].workers, pipe._pool_box[0].threads)
        tail = _rate_between(r["marks"], max(0.0, r["marks"][-1][0] - a.tail))
        settle = settled_at([tuple(c) for c in changes], final)
        # The load of a shared machine drifts over a sweep: the best hand-set
        # configuration once more, right after auto, for a back-to-back pair.
        again = _run(_pipeline(source, a, burn, **best["config"]), a.tail, 1.0)["batches_per_s"]
        out = {
            "source": source,
            "hand": rows,
            "best": best,
            "auto": {
                "batches_per_s_tail": tail,
                "batches_per_s_whole": r["batches_per_s"],
                "settled_s": settle,
                "final": {"workers": final[0], "threads": final[1]},
                "changes": changes,
                "seconds": a.auto_seconds,
            },
            "best_within_budget": best_in,
            "best_again": again,
            "ratio_pair": tail / again if again else 0.0,
            "ratio_within_budget": tail / best_in["batches_per_s"] if best_in["batches_per_s"] else 0.0,
            "ratio_tail": tail / best["batches_per_s"] if best["batches_per_s"] else 0.0,
            "ratio_whole": r["batches_per_s"] / best["batches_per_s"] if best["batches_per_s"] else 0.0,
        }
        res["sources"].append(out)
        log(
            f"  {source:6} {'auto':>24}: {tail:7.1f} batches/s over the last {a.tail:g} s "
            f"({out['ratio_tail']:.2f}x the best hand-set, {_label(best['config'])}); "
            f"{out['ratio_whole']:.2f}x over all {a.auto_seconds:g} s; settled at {settle:.1f} s on "
            f"{final[0]} workers, {final[1] if final[1] is not None else 'no'} read threads"
        )
        log(
            f"  {source:6} {'':>24}  back-to-back with the best hand-set ({again:.1f} batches/s right after): "
            f"{out['ratio_pair']:.2f}x; against the best within the budget ({_label(best_in['config'])}): "
            f"{out['ratio_within_budget']:.2f}x"
        )
    return res


def _label(kw: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in kw.items())


def parse(argv=None) -> Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--read-ms", type=float, default=5.0)
    ap.add_argument("--decode-ms", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=None, help="per hand-set configuration (default 5; --quick 2)")
    ap.add_argument("--auto-seconds", type=float, default=None, help="the auto run (default 40; --quick 15)")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each hand-set one (default 2; --quick 1)")
    ap.add_argument("--tail", type=float, default=None, help="auto's rate over its last seconds (default 10)")
    ap.add_argument("--io-workers", default="1,2,4,8,16")
    ap.add_argument("--decode-workers", default="1,2,3,4")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    a.seconds = a.seconds or (2.0 if a.quick else 5.0)
    a.auto_seconds = a.auto_seconds or (15.0 if a.quick else 40.0)
    a.repeats = a.repeats or (1 if a.quick else 2)
    a.tail = a.tail or (5.0 if a.quick else 10.0)
    a.io_workers = [int(x) for x in a.io_workers.split(",")]
    a.decode_workers = [int(x) for x in a.decode_workers.split(",")]
    return a


def main() -> None:
    a = parse()
    res = measure(a)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()


def table(r: dict) -> list[str]:
    """The document's lines for a results dict of measure()."""
    L = ["| source | configuration | batches/s | / best hand-set |", "|---|---|--:|--:|"]
    for src in r["sources"]:
        best = src["best"]["batches_per_s"]
        for row in src["hand"]:
            mark = " (best)" if row["config"] == src["best"]["config"] else ""
            L.append(
                f"| {src['source']} | {_label(row['config'])}{mark} | {row['batches_per_s']:.1f} | "
                f"{row['batches_per_s'] / best:.2f} |"
            )
        au = src["auto"]
        fin = au["final"]
        L.append(
            f"| {src['source']} | **auto**, last {r.get('tail', 10):g} s (ended on {fin['workers']} workers, "
            f"{fin['threads'] if fin['threads'] is not None else 'no'} read threads; settled at "
            f"{au['settled_s']:.1f} s) | {au['batches_per_s_tail']:.1f} | **{src['ratio_tail']:.2f}** |"
        )
        if "best_again" in src:
            L.append(
                f"| {src['source']} | best hand-set again, right after auto (back-to-back pair) | "
                f"{src['best_again']:.1f} | auto / it: **{src['ratio_pair']:.2f}** |"
            )
        L.append(
            f"| {src['source']} | auto, whole {au['seconds']:g} s from a cold start | "
            f"{au['batches_per_s_whole']:.1f} | {src['ratio_whole']:.2f} |"
        )
    return L
