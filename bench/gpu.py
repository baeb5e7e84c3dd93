"""The GPU path: K trainers on one GPU fed by one producer, per-trainer batch
latency and host-to-device bytes, for

  tsock-device   the producer copies each batch once into its device pool;
                 trainers read it zero-copy through CUDA IPC
                 (Producer(device=), Consumer(device=));
  tsock-copy     every trainer copies every batch to the GPU itself, out of
                 pinned shared memory (Consumer(device=, device_path="never")):
                 the per-trainer copy that tsock-device removes;
  tensorsocket   the `tensorsocket` package in CUDA mode: its producer moves
                 each batch to the GPU once and sends CUDA IPC handles.

A batch is a float32 tensor of --batch-mb MiB and an int64 timestamp taken
just before it is published. A trainer reads the timestamp on the GPU
(.item(), which waits for the batch's data on its stream), so its latency
is publish -> usable on the trainer's GPU (the first 8 batches, stamped
while the trainers attach, are left out); then it reads the whole batch
(a sum) and runs a --step-ms kernel. Host-to-device bytes are counted from
what each system copies: batches x size, times K for tsock-copy.

Needs a CUDA build of PyTorch and a GPU; prints "skipped: ..." and exits 0
otherwise (it is a benchmark, not a test).

    python bench/gpu.py [--k 1,2,4] [--systems tsock-device,tsock-copy,tensorsocket]
                        [--batches 300] [--batch-mb 16] [--step-ms 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import ROOT, Out, _check, _free_ports, _read, _tell, child_env, run_all  # noqa: E402 - the runner's plumbing, shared

SYSTEMS = ("tsock-device", "tsock-copy", "tensorsocket")


def _torch():
    sys.path.insert(0, str(ROOT / "python"))
    import torch

    return torch


def gpu_missing() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    try:
        torch = _torch()
    except ImportError:
        return "PyTorch is not installed"
    if torch.version.cuda is None:
        return f"PyTorch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    return None


# ---- the processes ----------------------------------------------------------------------------------------


ROWS = 64  # samples per batch: tensorsocket slices batches by rows
SLOTS = 8  # tsock's ring
# The first batches are stamped while the trainers still attach (a producer
# waits for its readers; CUDA opens its IPC handles): left out of latency.
WARMUP = SLOTS


class Stamped:
    """The loader: --batches host batches (x, t), x float32 of --batch-mb
    MiB as ROWS rows, t the time it was handed over, per row. One payload
    is reused: the copies are what is measured."""

    def __init__(self, torch, a: Namespace):
        self.torch, self.n = torch, a.batches
        self.x = torch.arange(a.batch_mb * 2**20 // 4, dtype=torch.float32).reshape(ROWS, -1)

    def __len__(self):
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            yield (self.x, self.torch.full((ROWS,), time.monotonic_ns(), dtype=self.torch.int64))


def producer(a: Namespace) -> None:
    torch = _torch()
    out = Out(a.out)
    if a.system == "tensorsocket":
        from tensorsocket import TensorProducer

        p = [int(x) for x in a.ports.split(",")]
        # It moves each (collated) batch to the GPU itself when CUDA is
        # there. producer_batch_size=2: 1 fails in 0.0.5 (see e2e.py).
        src = TensorProducer(
            Stamped(torch, a), port=p[0], ack_port=p[1], heart_ports=(p[2], p[3]), producer_batch_size=2
        )
    else:
        import tsock

        device = "cuda:0" if a.system == "tsock-device" else None
        src = tsock.Producer(None, a.name, slots=SLOTS, wait_readers=a.k, timeout=300, device=device)
    out(ready=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    if a.system == "tensorsocket":
        while len(src.hb.consumers) < a.k:
            time.sleep(0.05)
        for _ in src:
            pass
    else:
        for batch in Stamped(torch, a):
            src.publish(batch)
        src.end_epoch()
    out(wall=time.monotonic() - t0, done=True)
    sys.stdin.readline()
    if a.system == "tensorsocket":
        src.join()
    else:
        src.close()


def trainer(a: Namespace) -> None:
    torch = _torch()
    out = Out(a.out)
    torch.cuda.init()
    cycles = int(a.step_ms * 1e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    out(ready=True)
    sys.stdin.readline()
    if a.system == "tensorsocket":
        from tensorsocket import TensorConsumer

        p = [int(x) for x in a.ports.split(",")]
        source = TensorConsumer(port=p[0], ack_port=p[1], heart_ports=(p[2], p[3]), batch_size=ROWS)
    else:
        import tsock

        path = "require" if a.system == "tsock-device" else "never"
        source = tsock.Consumer(a.name, output="torch", device="cuda:0", device_path=path, timeout=120)
    lat, t0, total = [], None, 0.0
    for x, t in source:
        published = int(t[0].item())  # waits for the batch on this stream
        lat.append(time.monotonic_ns() - published)
        t0 = t0 or time.monotonic()
        total += float(x.sum())  # reads the whole batch on the GPU
        torch.cuda._sleep(cycles)  # the training step
    torch.cuda.synchronize()
    wall = time.monotonic() - (t0 or time.monotonic())
    placement = getattr(source, "placement", "cuda-ipc")
    out(latency_ns=lat, wall=wall, placement=placement, checksum=total, done=True)


# ---- the runner --------------------------------------------------------------------------------------------


def run_config(system: str, k: int, a: Namespace, tmp: Path) -> dict:
    base = [sys.executable, str(Path(__file__).resolve()), "--k", str(k), "--system", system]
    base += ["--batches", str(a.batches), "--batch-mb", str(a.batch_mb), "--step-ms", str(a.step_ms)]
    base += ["--name", f"gpu-{os.getpid()}-{system}-{k}", "--ports", ",".join(map(str, _free_ports(4)))]
    env = child_env()
    procs, files = [], []
    try:
        for role, i in [("producer", 0)] + [("trainer", i) for i in range(k)]:
            f = tmp / f"{system}-{k}-{role}-{i}.jsonl"
            cmd = base + ["--role", role, "--out", str(f)]
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, text=True, env=env, stdout=subprocess.DEVNULL))
            files.append(f)
        deadline = time.monotonic() + a.timeout
        while not all(any(r.get("ready") for r in _read(f)) for f in files):
            _check(procs, deadline, "start")
            time.sleep(0.05)
        _tell(procs, "go\n")
        while not all(any(r.get("done") for r in _read(f)) for f in files):
            _check(procs[1:], deadline, "run")
            time.sleep(0.1)
        _tell(procs, "stop\n")
        for p in procs:
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    done = [next(r for r in _read(f) if r.get("done")) for f in files[1:]]
    got = [len(d["latency_ns"]) for d in done]
    per_trainer = []
    for d in done:
        n = len(d["latency_ns"])
        ms = sorted(v / 1e6 for v in d["latency_ns"][WARMUP:])
        per_trainer.append(
            {
                "batches": n,
                "p50_ms": statistics.median(ms),
                "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
                # the clock starts at the first batch: the n - 1 after it
                "batches_per_s": (n - 1) / d["wall"] if d["wall"] > 0 else None,
                "placement": d["placement"],
            }
        )
    copies = k if system == "tsock-copy" else 1
    return {
        "system": system,
        "k": k,
        "per_trainer": per_trainer,
        "p50_ms": statistics.median(t["p50_ms"] for t in per_trainer),
        "h2d_bytes": copies * max(got) * a.batch_mb * 2**20,
        "batches": max(got),
    }


def measure(a: Namespace, log=print) -> dict:
    from run import _load, machine

    torch = _torch()
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "batch_mb": a.batch_mb}
    res["machine"] = machine()
    res.update(batches=a.batches, step_ms=a.step_ms)
    with tempfile.TemporaryDirectory(prefix="tsock-gpu-") as tmp:
        res["runs"], res["failures"] = run_all(
            a,
            lambda system, k: run_config(system, k, a, Path(tmp)),
            lambda r: (
                f"latency p50 {r['p50_ms']:7.3f} ms, p99 {max(t['p99_ms'] for t in r['per_trainer']):7.3f} ms, "
                f"H2D {r['h2d_bytes'] / 2**30:6.2f} GiB for {r['batches']} batches, "
                f"placement {','.join(sorted({t['placement'] for t in r['per_trainer']}))}"
            ),
            log,
        )
    res["machine"]["load_end"] = _load()
    return res


def parse(argv=None) -> Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", default="1,2,4")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--batch-mb", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--role", choices=["trainer", "producer"])
    ap.add_argument("--system", choices=SYSTEMS)
    ap.add_argument("--name")
    ap.add_argument("--ports")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.role:
        a.k = int(a.k)
    else:
        a.k = [int(x) for x in a.k.split(",")]
        a.systems = [s for s in a.systems.split(",") if s]
        if set(a.systems) - set(SYSTEMS):
            ap.error(f"unknown systems {sorted(set(a.systems) - set(SYSTEMS))}")
        if a.batches <= WARMUP:
            ap.error(f"--batches must exceed the {WARMUP} warm-up batches left out of latency")
    return a


def main() -> int:
    a = parse()
    if a.role == "trainer":
        trainer(a)
        return 0
    if a.role == "producer":
        producer(a)
        return 0
    why = gpu_missing()
    if why is not None:
        print(f"bench/gpu.py skipped: {why}")
        return 0
    res = measure(a)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
