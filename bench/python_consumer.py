"""Python consumer cost per batch, against iterating an in-process list,
and the cost of batch lifetimes.

A producer process publishes small batches (by default 2 float32 tensors of
256 elements) as fast as it can into a deep ring. This process reads them
through tsock.Consumer with numpy, torch and JAX outputs. Each round waits
until the producer has filled the ring, then times draining it, so the figure
is the consumer's own cost per batch (acquire, descriptors, zero-copy arrays
or DLPack, release), not the producer's speed. The baseline iterates a Python
list holding the same arrays (numpy arrays, torch tensors, JAX arrays), in the
same run.

Two consumers read the same ring side by side, one with the default
lifetime="referenced" (a batch stays valid while referenced), one with
lifetime="step" (valid until the next batch, no bookkeeping: the old
contract), and the rounds alternate between them, so that their ratio is the
cost of the default in the common loop (nothing kept), measured under the
same load.

The cost of keeping a batch: the same drain, with every batch kept in a
list, against the plain loop, for a small batch and a large one; the extra
time divided by the batches kept (copied out) is what one keep costs.

A last line gives the streaming rate with producer and consumer running flat
out together (bounded by the Python producer on small batches).

    python bench/python_consumer.py [--quick] [--tensors 2] [--elems 256]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import numpy as np  # noqa: E402
import tsock  # noqa: E402

# The producer never blocks on a full ring (timeout=0, then a nap): a blocked
# producer is woken by every release, which would charge its wake-ups to the
# consumer being measured.
#
# It dies with the benchmark: the kernel sends it SIGINT (a clean close that
# removes the channel) when the benchmark exits, however it exits (killed,
# too); a benchmark already gone before that was set up is caught by its
# parent pid.
PRODUCER = """
import ctypes, os, signal, sys, time, numpy as np, tsock
name = sys.argv[1]
slots, tensors, elems, parent = (int(a) for a in sys.argv[2:6])
# SIGINT only sets a flag: a KeyboardInterrupt raised while the channel
# was being created (the window is wide on a loaded machine) left it in
# /dev/shm, with no producer to remove it.
stop = []
signal.signal(signal.SIGINT, lambda *_: stop.append(1))
PR_SET_PDEATHSIG = 1
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGINT), 0, 0, 0)
if os.getppid() != parent:
    sys.exit(0)
batches = [tuple(np.full(elems, i * tensors + k, np.float32) for k in range(tensors)) for i in range(64)]
with tsock.Producer(None, name, slots=slots, timeout=0) as p:
    i = 0
    while not stop:  # until SIGINT (from the benchmark, or its death)
        try:
            p.publish(batches[i % 64])
            i += 1
        except tsock.TsockError as e:
            if e.status != -12:  # TSOCK_EBACKPRESSURE: the ring is full
                raise
            time.sleep(0.005)
"""


def _time_list(items, repeat: int) -> list[float]:
    """Seconds per item to iterate `items`, unpacking each batch; one value per round."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for batch in items:
            a, b = batch[0], batch[-1]  # noqa: F841 - the work a training loop does with a batch
        out.append((time.perf_counter() - t0) / len(items))
    return out


def _time_iter(make, n: int, repeat: int) -> list[float]:
    """Seconds per item to iterate a fresh iterable from make(); one value per round."""
    out = []
    for _ in range(repeat):
        iterable = make()
        t0 = time.perf_counter()
        for batch in iterable:
            a, b = batch[0], batch[-1]  # noqa: F841
        out.append((time.perf_counter() - t0) / n)
    return out


def _drain(it, n: int, keep: list | None = None) -> tuple[float, float]:
    """Seconds per batch to take n batches from `it` (a consumer's
    iterator), unpacking each: elapsed, and this thread's CPU time (which a
    loaded machine's waits for a CPU do not inflate: the ring is full, the
    consumer never sleeps). keep: a list every batch is appended to."""
    got = 0
    t0, c0 = time.perf_counter(), time.thread_time()
    while got < n:
        try:
            batch = next(it)
        except StopIteration:
            continue
        a, b = batch[0], batch[-1]  # noqa: F841
        if keep is not None:
            keep.append(batch)
        got += 1
    return (time.perf_counter() - t0) / n, (time.thread_time() - c0) / n


def _time_lifetimes(name: str, output: str, per_round: int, rounds: int, settle: float) -> dict:
    """Seconds per batch (elapsed, CPU) for the default lifetime and for
    lifetime="step", one pair each per round: both consumers read the ring
    the producer has just filled (it waits for the slower one), in turn,
    the order swapped every round."""
    with (
        tsock.Consumer(name, output=output, start="now", timeout=30) as ref,
        tsock.Consumer(name, output=output, start="now", timeout=30, lifetime="step") as step,
    ):
        its = {"referenced": iter(ref), "step": iter(step)}
        for it in its.values():
            next(it)  # attached and warmed up
        # Start both at the same batch: the one attached first skips ahead.
        while True:
            seqs = {k: c._reader.held[-1].lease.seq for k, c in (("referenced", ref), ("step", step))}
            if seqs["referenced"] == seqs["step"]:
                break
            behind = min(seqs, key=seqs.get)
            next(its[behind])
        times = {"referenced": [], "step": []}
        for r in range(rounds):
            time.sleep(settle)  # let the producer fill the ring
            order = ("referenced", "step") if r % 2 == 0 else ("step", "referenced")
            for k in order:
                times[k].append(_drain(its[k], per_round))
        assert ref._life.kept == 0, "the plain loop copied a batch"
    return times


def _keep_cost(name: str, slots: int, rounds: int, settle: float) -> dict:
    """Per round, the CPU seconds to drain `slots` batches keeping each, and
    not keeping any, and the batches copied out; medians, and the cost of
    one keep: (kept time - plain time) / keeps. (The copy is CPU work in
    this thread: its memcpy and page faults.)"""
    keep_t, plain_t, keeps = [], [], []
    with tsock.Consumer(name, start="now", timeout=30) as c:
        it = iter(c)
        next(it)
        for r in range(rounds):
            for keeping in (r % 2 == 0, r % 2 != 0):
                time.sleep(settle)
                kept = [] if keeping else None
                before = c._life.kept
                t = _drain(it, slots, kept)[1] * slots
                if keeping:
                    keep_t.append(t)
                    keeps.append(c._life.kept - before)
                    del kept  # the batches go back (or their copies are freed) at the next settle
                else:
                    plain_t.append(t)
    per_keep = [(k - p) / n for k, p, n in zip(keep_t, plain_t, keeps) if n]
    return {
        "keep_round_s": statistics.median(keep_t),
        "plain_round_s": statistics.median(plain_t),
        "keeps_per_round": statistics.median(keeps),
        "per_keep_s": statistics.median(per_keep),
    }


def _producer(name: str, slots: int, tensors: int, elems: int, env: dict) -> subprocess.Popen:
    args = [name, str(slots), str(tensors), str(elems), str(os.getpid())]
    return subprocess.Popen([sys.executable, "-c", PRODUCER, *args], env=env)


def _stop(prod: subprocess.Popen, name: str) -> None:
    # Ctrl-C lets the producer close (and remove) its channel.
    prod.send_signal(signal.SIGINT)
    try:
        prod.wait(10)
    except subprocess.TimeoutExpired:
        prod.kill()
        prod.wait()
    Path(f"/dev/shm/tsock.{name}").unlink(missing_ok=True)


def _streaming(c: tsock.Consumer, seconds: float) -> float:
    it = iter(c)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        try:
            next(it)
        except StopIteration:
            continue
        n += 1
    return n / (time.perf_counter() - t0)


# The cost of keeping a batch, for these sizes (tensors x float32 elements):
# a small batch (two tensors of 256 elements) and a large one (one tensor of
# 8 MiB, as a batch of images: 64 x 3 x 112 x 112 bytes is 2.4 MiB, ImageNet's
# 256 x 3 x 224 x 224 is 37 MiB).
KEEP_SIZES = {"small": (2, 256), "large": (1, 2 * 1024 * 1024)}


def measure(quick: bool = False, tensors: int = 2, elems: int = 256, outputs: str = "numpy,torch,jax") -> dict:
    """Runs the benchmark; every figure is the median over the rounds (seconds per batch)."""
    slots = 1024 if quick else 4096
    rounds = 3 if quick else 10
    per_round = slots - 8
    name = f"bench-py-{os.getpid()}"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    prod = _producer(name, slots, tensors, elems, env)
    rows = []
    try:
        arrays = [tuple(np.full(elems, i, np.float32) for _ in range(tensors)) for i in range(per_round)]
        for output in outputs.split(","):
            if output == "numpy":
                items = arrays
            elif output == "torch":
                import torch

                items = [tuple(torch.from_numpy(a) for a in b) for b in arrays]
            else:
                import jax.numpy as jnp

                items = [tuple(jnp.asarray(a) for a in b) for b in arrays]
            base = _time_list(items, rounds)
            t = _time_lifetimes(name, output, per_round, rounds, settle=0.3 if quick else 0.5)
            per, step = [w for w, _ in t["referenced"]], [w for w, _ in t["step"]]
            per_cpu, step_cpu = [c for _, c in t["referenced"]], [c for _, c in t["step"]]
            rows.append(
                {
                    "output": output,
                    "tsock_s": statistics.median(per),
                    "step_s": statistics.median(step),
                    "tsock_cpu_s": statistics.median(per_cpu),
                    "step_cpu_s": statistics.median(step_cpu),
                    # per round, then the median: the two ran side by side
                    "lifetime_ratio": statistics.median(a / b for a, b in zip(per_cpu, step_cpu)),
                    "lifetime_ratio_elapsed": statistics.median(a / b for a, b in zip(per, step)),
                    "list_s": statistics.median(base),
                    "tsock_rounds": per,
                    "step_rounds": step,
                    "list_rounds": base,
                }
            )
        with tsock.Consumer(name, start="now", timeout=30) as c:
            stream = _streaming(c, 1.0 if quick else 3.0)
        loader = None
        if "torch" in sys.modules:
            # For scale: what a torch DataLoader costs per batch in-process,
            # with no worker, no collate and no sampling of its own.
            from torch.utils.data import DataLoader

            items = [tuple(sys.modules["torch"].from_numpy(a) for a in b) for b in arrays]
            loader = statistics.median(_time_iter(lambda: DataLoader(items, batch_size=None), len(items), rounds))
    finally:
        _stop(prod, name)
    keep = {}
    for size, (n, count) in KEEP_SIZES.items():
        kname = f"{name}-keep-{size}"
        keep_slots = 64 if size == "small" else 8
        prod = _producer(kname, keep_slots, n, count, env)
        try:
            r = _keep_cost(kname, keep_slots, 3 if quick else 10, settle=0.3 if quick else 0.5)
        finally:
            _stop(prod, kname)
        keep[size] = dict(r, tensors=n, elems=count, batch_bytes=n * count * 4, slots=keep_slots)
    import platform

    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for mod in ("torch", "jax"):
        if mod in sys.modules:
            versions[mod] = sys.modules[mod].__version__
    return {
        "tensors": tensors,
        "elems": elems,
        "slots": slots,
        "rounds": rounds,
        "per_round": per_round,
        "rows": rows,
        "dataloader_s": loader,
        "streaming_per_s": stream,
        "keep": keep,
        "versions": versions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a few seconds)")
    ap.add_argument("--tensors", type=int, default=2)
    ap.add_argument("--elems", type=int, default=256)
    ap.add_argument("--outputs", default="numpy,torch,jax")
    args = ap.parse_args()
    r = measure(args.quick, args.tensors, args.elems, args.outputs)
    print(f"tsock Python consumer, batches of {args.tensors} x float32[{args.elems}], ring of {r['slots']} slots")
    versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items())
    print(f"{os.cpu_count()} CPUs, {versions}; median of {r['rounds']} rounds of {r['per_round']} batches")
    print(f"{'output':8} {'tsock us/batch':>15} {'tsock batches/s':>16} {'list us/batch':>14} {'ratio':>8}")
    for row in r["rows"]:
        per, base = row["tsock_s"], row["list_s"]
        print(f"{row['output']:8} {per * 1e6:15.2f} {1 / per:16,.0f} {base * 1e6:14.3f} {per / base:7.0f}x")
    print("batch lifetimes, same rounds: default (valid while referenced) against lifetime='step' (the old contract)")
    print(f"{'output':8} {'default CPU us':>15} {'step CPU us':>12} {'default/step':>13} {'elapsed ratio':>14}")
    for row in r["rows"]:
        print(
            f"{row['output']:8} {row['tsock_cpu_s'] * 1e6:15.2f} {row['step_cpu_s'] * 1e6:12.2f}"
            f" {row['lifetime_ratio']:12.3f}x {row['lifetime_ratio_elapsed']:13.3f}x"
        )
    for size, k in r["keep"].items():
        mib = k["batch_bytes"] / 2**20
        gbs = k["batch_bytes"] / k["per_keep_s"] / 1e9
        print(
            f"keeping a {size} batch ({k['tensors']} x float32[{k['elems']}], {mib:.3g} MiB): "
            f"{k['per_keep_s'] * 1e6:.1f} us of CPU per batch kept ({gbs:.2f} GB/s); a round of {k['slots']} "
            f"batches: {k['plain_round_s'] * 1e3:.2f} ms plain, {k['keep_round_s'] * 1e3:.2f} ms keeping each "
            f"({k['keeps_per_round']:.0f} copied out)"
        )
    if r["dataloader_s"] is not None:
        print(
            "for scale, torch DataLoader(list of batches, batch_size=None), in-process: "
            f"{r['dataloader_s'] * 1e6:.2f} us/batch"
        )
    print(f"streaming, numpy output, producer and consumer together: {r['streaming_per_s']:,.0f} batches/s")


if __name__ == "__main__":
    main()
