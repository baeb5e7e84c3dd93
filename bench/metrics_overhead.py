"""What Consumer's accounting (stats(), tsock.metrics) costs per batch.

One process publishes a ring's worth of small batches, then drains it
through one Consumer, timed; rounds alternate between next(consumer) (with
the accounting: two time.perf_counter_ns reads and a few additions per
batch) and consumer._next_profiled() (the same call without it), so both
are measured in the same run under the same load. Prints the median cost
per batch of each, their ratio, and the extra time as a share of a training
step of --step-ms milliseconds.

    python bench/metrics_overhead.py [--rounds 40] [--slots 512] [--step-ms 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import numpy as np  # noqa: E402
import tsock  # noqa: E402


def drain(take, n: int) -> float:
    """Seconds to take n batches."""
    t0 = time.perf_counter()
    for _ in range(n):
        take()
    return time.perf_counter() - t0


def measure(rounds: int, slots: int) -> dict:
    """Median ns per batch with and without the accounting."""
    name = f"bench-metrics-{os.getpid()}"
    batch = (np.zeros(256, np.float32), np.zeros(256, np.float32))
    times = {"accounted": [], "bare": []}
    with tsock.Producer(None, name, slots=slots) as p:
        p.publish(batch)  # makes the channel; the consumer starts after it
        with tsock.Consumer(name, start="now", timeout=30, lifetime="step") as c:
            takes = {"accounted": c.__next__, "bare": c._next_profiled}
            for r in range(2 * rounds):
                kind = ("accounted", "bare")[r % 2]
                for _ in range(slots - 1):
                    p.publish(batch)
                times[kind].append(drain(takes[kind], slots - 1) / (slots - 1) * 1e9)
            c.stats()
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--step-ms", type=float, default=1.0)
    a = ap.parse_args(argv)
    r = measure(a.rounds, a.slots)
    extra = r["accounted"] - r["bare"]
    print(f"next(consumer), accounted: {r['accounted']:.0f} ns/batch (median of {a.rounds} rounds)")
    print(f"the same call without it:  {r['bare']:.0f} ns/batch")
    print(f"ratio {r['accounted'] / r['bare']:.3f}: {extra:+.0f} ns/batch")
    print(f"as a share of a {a.step_ms:g} ms step: {100 * extra / (a.step_ms * 1e6):.4f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
