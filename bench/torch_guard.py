"""What the read-only guard (tsock.ReadOnlyTensor) costs a training step.

One batch is read from a real channel (so the consumer's mapping is
registered, as in a trainer) and kept; a training step (forward, backward,
SGD) of a small MLP is timed on it as the consumer hands it out (guarded)
and on a plain tensor over the same memory (the baseline), interleaved in
the same run, eager and under torch.compile. A small model makes the guard's
fixed cost per step as visible as it can be. Also the cost of one operation
on the batch (x.sum()), where the guard's Python hook is all the difference.

    python bench/torch_guard.py [--quick]

Prints microseconds per call and the ratio guarded / plain (1.00: no cost),
for the median round and for the fastest round of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np
import torch
import tsock

ROWS, FEATURES, HIDDEN, CLASSES = 64, 256, 256, 10


def _timed(fn, x, reps: int) -> float:
    """Seconds per call of fn(x), over reps calls."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - t0) / reps


def compare(fn, guarded, plain, reps: int, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds per call on the guarded and the plain input, one figure per
    round, alternating rounds so drifts in machine load hit both alike."""
    fn(guarded), fn(plain)  # warm up (and compile, for compiled fns)
    g, p = [], []
    for _ in range(rounds):
        g.append(_timed(fn, guarded, reps))
        p.append(_timed(fn, plain, reps))
    return g, p


def make_step(compiled: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    target = torch.zeros(ROWS, dtype=torch.int64)

    def step(x):
        loss = torch.nn.functional.cross_entropy(forward(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a few seconds plus compiling)")
    args = ap.parse_args()
    reps, rounds = (50, 5) if args.quick else (200, 15)
    torch.set_num_threads(1)  # steadier timings on a shared machine

    name = f"bench-guard-{os.getpid()}"
    data = [np.random.default_rng(0).standard_normal((ROWS, FEATURES)).astype(np.float32)]
    producer = tsock.Producer(data, name, slots=4, wait_readers=1)
    thread = threading.Thread(target=producer.run)
    thread.start()
    try:
        with tsock.Consumer(name, output="torch", timeout=30) as c:
            guarded = next(iter(c))
            # The same memory, no guard (guarded.as_subclass refuses to drop it).
            plain = torch.Tensor.as_subclass(guarded, torch.Tensor)
            assert type(guarded) is tsock.ReadOnlyTensor and plain.data_ptr() == guarded.data_ptr()
            print(f"torch {torch.__version__}, batch {ROWS}x{FEATURES}, MLP {FEATURES}-{HIDDEN}-{CLASSES}, 1 thread")
            # The median, and the fastest round (what the code costs when the
            # machine's other load leaves it alone).
            print(
                f"{'what':28} {'guarded us':>11} {'plain us':>9} {'ratio':>6} "
                f"{'best: guarded':>14} {'plain':>7} {'ratio':>6}"
            )
            cases = [
                ("one op (x.sum())", lambda x: x.sum()),
                ("train step, eager", make_step(False)),
                ("train step, torch.compile", make_step(True)),
            ]
            for what, fn in cases:
                g, p = compare(fn, guarded, plain, reps, rounds)
                med_g, med_p, best_g, best_p = statistics.median(g), statistics.median(p), min(g), min(p)
                print(
                    f"{what:28} {med_g * 1e6:11.1f} {med_p * 1e6:9.1f} {med_g / med_p:6.2f} "
                    f"{best_g * 1e6:14.1f} {best_p * 1e6:7.1f} {best_g / best_p:6.2f}"
                )
    finally:
        thread.join()
        producer.close()


if __name__ == "__main__":
    main()
