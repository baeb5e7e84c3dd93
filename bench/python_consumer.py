"""Python consumer cost per batch, against iterating an in-process list.

A producer process publishes small batches (by default 2 float32 tensors of
256 elements) as fast as it can into a deep ring. This process reads them
through tsock.Consumer with numpy, torch and JAX outputs. Each round waits
until the producer has filled the ring, then times draining it, so the figure
is the consumer's own cost per batch (acquire, descriptors, zero-copy arrays
or DLPack, release), not the producer's speed. The baseline iterates a Python
list holding the same arrays (numpy arrays, torch tensors, JAX arrays), in the
same run. A last line gives the streaming rate with producer and consumer
running flat out together (bounded by the Python producer on small batches).

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
PR_SET_PDEATHSIG = 1
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGINT), 0, 0, 0)
if os.getppid() != parent:
    sys.exit(0)
batches = [tuple(np.full(elems, i * tensors + k, np.float32) for k in range(tensors)) for i in range(64)]
with tsock.Producer(None, name, slots=slots, timeout=0) as p:
    i = 0
    try:
        while True:  # until Ctrl-C (SIGINT from the benchmark)
            try:
                p.publish(batches[i % 64])
                i += 1
            except tsock.TsockError as e:
                if e.status != -12:  # TSOCK_EBACKPRESSURE: the ring is full
                    raise
                time.sleep(0.005)
    except KeyboardInterrupt:
        pass
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


def _time_consumer(c: tsock.Consumer, per_round: int, rounds: int, settle: float) -> list[float]:
    """Seconds per batch to drain a ring the producer has just filled; one value per round."""
    it = iter(c)
    out = []
    for _ in range(rounds):
        time.sleep(settle)  # let the producer fill the ring
        n = 0
        t0 = time.perf_counter()
        while n < per_round:
            try:
                batch = next(it)
            except StopIteration:
                continue
            a, b = batch[0], batch[-1]  # noqa: F841
            n += 1
        out.append((time.perf_counter() - t0) / per_round)
    return out


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


def measure(quick: bool = False, tensors: int = 2, elems: int = 256, outputs: str = "numpy,torch,jax") -> dict:
    """Runs the benchmark; every figure is the median over the rounds (seconds per batch)."""
    slots = 1024 if quick else 4096
    rounds = 3 if quick else 10
    per_round = slots - 8
    name = f"bench-py-{os.getpid()}"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    prod = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, name, str(slots), str(tensors), str(elems), str(os.getpid())], env=env
    )
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
            with tsock.Consumer(name, output=output, start="now", timeout=30) as c:
                next(iter(c))  # attached and warmed up
                per = _time_consumer(c, per_round, rounds, settle=0.3 if quick else 0.5)
            rows.append(
                {
                    "output": output,
                    "tsock_s": statistics.median(per),
                    "list_s": statistics.median(base),
                    "tsock_rounds": per,
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
        # Ctrl-C lets the producer close (and remove) its channel.
        prod.send_signal(signal.SIGINT)
        try:
            prod.wait(10)
        except subprocess.TimeoutExpired:
            prod.kill()
            prod.wait()
        Path(f"/dev/shm/tsock.{name}").unlink(missing_ok=True)
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
    if r["dataloader_s"] is not None:
        print(
            "for scale, torch DataLoader(list of batches, batch_size=None), in-process: "
            f"{r['dataloader_s'] * 1e6:.2f} us/batch"
        )
    print(f"streaming, numpy output, producer and consumer together: {r['streaming_per_s']:,.0f} batches/s")


if __name__ == "__main__":
    main()
