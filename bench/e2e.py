"""End-to-end sharing: K trainers fed by (a) a DataLoader each, (b) one tsock
producer, (c) one TensorSocket producer (the `tensorsocket` package).

The pipeline is the sweep's (examples/python/sweep.py, shapes_data.py):
JPEG decode, random resized crop, flip, normalise, batches of 64, with
DataLoader workers = CPUs. Each trainer trains a small model (a linear
classifier on 4x4-pooled images) for E epochs and reports, per epoch, the
samples it got, the wall time and its CPU time (process + reaped DataLoader
workers); producers report the same. The runner samples the whole process
tree's RSS and PSS every 0.25 s and keeps the peak of the sums.

    python bench/e2e.py [--quick] [--k 1,2,4] [--systems own,tsock,tensorsocket]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from argparse import Namespace
from pathlib import Path

from proctree import descendants

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "python"
SYSTEMS = ("own", "tsock", "tensorsocket")
WORKERS = os.cpu_count() or 1


def cpu_now() -> float:
    """CPU seconds of this process and of its reaped children (DataLoader workers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


# ---- the processes ----------------------------------------------------------------------------------------


def _setup(a: Namespace):
    sys.path[:0] = [str(EXAMPLES), str(ROOT / "python")]
    import torch

    torch.set_num_threads(1)
    return torch


def make_loader(a: Namespace):
    import shapes_data
    import sweep

    folder = shapes_data.ensure_dataset(Path(a.data_dir), a.train, 1)
    args = Namespace(train_size=a.train, val_size=1, batch_size=64, workers=WORKERS, seed=a.seed)
    return sweep.make_loaders(args, folder)[0]


def small_model(torch):
    nn = torch.nn
    return nn.Sequential(nn.AvgPool2d(4), nn.Flatten(), nn.Linear(3 * 10 * 10, 10))


class Out:
    """JSON lines to the runner's result file."""

    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)

    def __call__(self, **kw):
        self.f.write(json.dumps(kw) + "\n")


def trainer(a: Namespace) -> None:
    torch = _setup(a)
    import torch.nn.functional as F

    out = Out(a.out)
    torch.manual_seed(a.seed)
    model = small_model(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if a.system == "tsock":
        import tsock
    elif a.system == "tensorsocket":
        from tensorsocket import TensorConsumer
    out(ready=True)
    sys.stdin.readline()  # "go": every process is up
    # The consumers connect after "go": their producer starts publishing then.
    if a.system == "own":
        source = make_loader(a)
    elif a.system == "tsock":
        source = tsock.Consumer(a.name, output="torch", timeout=120)
    else:
        p = [int(x) for x in a.ports.split(",")]
        source = TensorConsumer(port=p[0], ack_port=p[1], heart_ports=(p[2], p[3]), batch_size=64)
    for epoch in range(a.epochs):
        t0, c0, n = time.monotonic(), cpu_now(), 0
        for x, y in source:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            n += len(y)
        out(epoch=epoch, samples=n, wall=time.monotonic() - t0, cpu=cpu_now() - c0)
    out(done=True)


def producer(a: Namespace) -> None:
    _setup(a)
    out = Out(a.out)
    loader = make_loader(a)
    if a.system == "tsock":
        import tsock

        src = tsock.Producer(loader, name=a.name, slots=16, wait_readers=a.k, timeout=300)
    else:
        from tensorsocket import TensorProducer

        p = [int(x) for x in a.ports.split(",")]
        # producer_batch_size=2: its default, 8, runs 3-4x slower here (every
        # consumer's slices pickle the whole collated batch), 1 fails with an
        # IndexError in 0.0.5.
        src = TensorProducer(loader, port=p[0], ack_port=p[1], heart_ports=(p[2], p[3]), producer_batch_size=2)
    out(ready=True)
    sys.stdin.readline()
    if a.system == "tensorsocket":
        while len(src.hb.consumers) < a.k:  # it starts with whoever has said hello: wait for all
            time.sleep(0.05)
    for epoch in range(a.epochs):
        t0, c0 = time.monotonic(), cpu_now()
        if a.system == "tsock":
            for batch in loader:
                src.publish(batch)
            src.end_epoch()
        else:
            for _ in src:
                pass
        out(epoch=epoch, wall=time.monotonic() - t0, cpu=cpu_now() - c0)
    out(done=True)
    sys.stdin.readline()  # "stop": the trainers have finished
    if a.system == "tsock":
        src.close()
    else:
        src.join()


# ---- the runner --------------------------------------------------------------------------------------------


def _mem(pid: int) -> tuple[int, int]:
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss * 1024, pss * 1024


class MemSampler(threading.Thread):
    """Peak of the sums of RSS and PSS over every process below this one."""

    def __init__(self, period: float = 0.25):
        super().__init__(daemon=True)
        self.period, self.stop, self.rss, self.pss = period, threading.Event(), 0, 0

    def run(self):
        me = os.getpid()
        while not self.stop.wait(self.period):
            tot = [_mem(p) for p in descendants(me)]
            self.rss = max(self.rss, sum(t[0] for t in tot))
            self.pss = max(self.pss, sum(t[1] for t in tot))


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def child_env() -> dict:
    """The environment of a benchmark's processes: this repository's package
    ahead of the caller's PYTHONPATH (which may hold packages carried beside
    it, such as tensorsocket), and the libraries of `make build` unless
    TSOCK_LIBRARY_DIR names others."""
    paths = [str(ROOT / "python")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    env.setdefault("TSOCK_LIBRARY_DIR", str(ROOT / "build"))
    return env


def _read(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def run_config(system: str, k: int, a: Namespace, tmp: Path) -> dict:
    """Runs K trainers fed by `system`; returns per-trainer and total figures."""
    base = [sys.executable, str(Path(__file__).resolve()), "--epochs", str(a.epochs), "--train", str(a.train)]
    base += ["--data-dir", str(a.data_dir), "--k", str(k), "--system", system]
    base += ["--name", f"e2e-{os.getpid()}-{system}-{k}", "--ports", ",".join(map(str, _free_ports(4)))]
    roles = [("producer", None)] if system != "own" else []
    roles += [("trainer", i) for i in range(k)]
    procs, files = [], []
    env = child_env()
    mem = MemSampler()
    mem.start()
    t_start = time.monotonic()
    try:
        for role, i in roles:
            f = tmp / f"{system}-{k}-{role}-{i}.jsonl"
            f.unlink(missing_ok=True)
            cmd = base + ["--role", role, "--out", str(f), "--seed", str(a.seed + (i or 0))]
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, text=True, env=env, stdout=subprocess.DEVNULL))
            files.append(f)
        deadline = time.monotonic() + a.timeout
        while not all(any(r.get("ready") for r in _read(f)) for f in files):
            _check(procs, deadline, "start")
            time.sleep(0.05)
        _tell(procs, "go\n")
        trainers = procs[len(procs) - k :]
        while not all(any(r.get("done") for r in _read(f)) for f in files[len(files) - k :]):
            _check(trainers, deadline, "run")
            time.sleep(0.1)
        _tell(procs, "stop\n")
        cpu_total = 0.0
        for p in procs:
            _, status, ru = os.wait4(p.pid, 0)  # the whole subtree's CPU, startup included
            p.returncode = os.waitstatus_to_exitcode(status)
            cpu_total += ru.ru_utime + ru.ru_stime
    finally:
        mem.stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = [_read(f) for f in files]
    epochs = [[r for r in rep if "epoch" in r] for rep in reports]
    tr = epochs[len(epochs) - k :]
    skip = 1 if a.epochs > 2 else 0  # the first epoch includes start-up skew
    per_trainer = [statistics.median([e["samples"] / e["wall"] for e in t[skip:]]) for t in tr]
    cpu_epoch = statistics.median([sum(rep[e]["cpu"] for rep in epochs) for e in range(skip, a.epochs)])
    samples_epoch = statistics.median([sum(t[e]["samples"] for t in tr) for e in range(skip, a.epochs)])
    return {
        "system": system,
        "k": k,
        "per_trainer": per_trainer,
        "trainer_rate": statistics.median(per_trainer),
        "aggregate": sum(per_trainer),
        "cpu_epoch": cpu_epoch,
        "samples_epoch": samples_epoch,
        "cpu_per_sample_ms": 1e3 * cpu_epoch / samples_epoch,
        "cpu_total": cpu_total,
        "peak_rss": mem.rss,
        "peak_pss": mem.pss,
        "wall": time.monotonic() - t_start,
        "epochs": epochs,
    }


def _tell(procs, line: str) -> None:
    """Sends line to each process still running. One may exit between the
    check and the write (a trainer ends once it has reported): its closed
    pipe is not an error."""
    for p in procs:
        if p.poll() is not None:
            continue
        try:
            p.stdin.write(line)
            p.stdin.flush()
        except BrokenPipeError:
            pass


def _check(procs, deadline: float, phase: str) -> None:
    for p in procs:
        if p.poll() is not None:
            raise RuntimeError(f"{' '.join(p.args[-12:])} exited with status {p.returncode} during {phase}")
    if time.monotonic() > deadline:
        raise RuntimeError(f"timed out during {phase}")


def costs(a: Namespace) -> dict:
    """In-process CPU per sample of the pipeline and of one training step, for
    the ideal-sharing bound K(P+M)/(P+KM)."""
    torch = _setup(a)
    import torch.nn.functional as F

    ds = make_loader(a).dataset
    n = 300 if a.quick else 1000
    t = time.process_time()
    for i in range(n):
        ds[i % len(ds)]
    pipe = (time.process_time() - t) / n
    model = small_model(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 3, 40, 40), torch.randint(0, 10, (64,))
    steps = 50 if a.quick else 200
    t = time.process_time()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {"pipeline_ms": 1e3 * pipe, "model_ms": 1e3 * (time.process_time() - t) / (steps * 64)}


def tensorsocket_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("tensorsocket")
    except Exception:
        return None


NOTES = """TensorSocket as run here: `tensorsocket==0.0.5` from PyPI with its dependencies (pyzmq, tornado, torch;
requirements/bench.in), unchanged. It runs on CPU tensors: its producer moves each collated batch into shared
memory (`share_memory_()`) but sends it with `send_pyobj`, which pickles the storage whole, so each trainer's
slice carries a copy of the whole collated batch, and PUB/SUB hands every trainer every trainer's slices,
which it all unpickles (traffic grows with K squared). `producer_batch_size=2` (two loader batches per
broadcast): its default, 8, ran about 3.5x slower in a trial here, and 1 fails with an `IndexError` in 0.0.5.
It drops the loader batches of an epoch that do not fill a last group of two: samples/s counts what trainers
received. The producer starts once all K trainers have answered its heartbeat; its sockets are TCP on 4 free
ports (it binds all interfaces)."""


def run_all(a: Namespace, run, describe, log) -> tuple[list, dict]:
    """run(system, k) for every K and system of a: the results, and the
    failures by "system/K" (reported in the document, never hidden)."""
    runs, failures = [], {}
    for k in a.k:
        for system in a.systems:
            try:
                r = run(system, k)
            except Exception as e:  # noqa: BLE001 - kept as a failure
                failures[f"{system}/{k}"] = f"{type(e).__name__}: {e}"
                log(f"  {system:>13} K={k}: FAILED: {e}")
                continue
            runs.append(r)
            log(f"  {system:>13} K={k}: {describe(r)}")
    return runs, failures


def measure(a: Namespace, tmp: Path, log=print) -> dict:
    res = {"epochs": a.epochs, "train": a.train, "workers": WORKERS, "batch": 64, "runs": [], "failures": {}}
    res["costs"] = costs(a)
    log(f"  pipeline {res['costs']['pipeline_ms']:.3f} ms/sample, model step {res['costs']['model_ms']:.4f} ms/sample")
    res["runs"], res["failures"] = run_all(
        a,
        lambda system, k: run_config(system, k, a, tmp),
        lambda r: (
            f"{r['trainer_rate']:7.0f} samples/s per trainer, aggregate {r['aggregate']:7.0f}, "
            f"{r['cpu_epoch']:6.2f} CPU s/epoch, peak PSS {r['peak_pss'] / 2**20:6.0f} MiB ({r['wall']:.0f} s)"
        ),
        log,
    )
    return res


def parse(argv=None) -> Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--k", default=None, help="trainer counts (default 1,2,4; --quick 1,2)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--epochs", type=int, default=None, help="epochs per run (default 5; --quick 2)")
    ap.add_argument("--train", type=int, default=None, help="images per epoch (default 3000; --quick 640)")
    ap.add_argument("--data-dir", default=str(ROOT / "build" / "sweep-data"))
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    # process roles (internal)
    ap.add_argument("--role", choices=["trainer", "producer"])
    ap.add_argument("--system", choices=SYSTEMS)
    ap.add_argument("--name")
    ap.add_argument("--ports")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    a.epochs = a.epochs or (2 if a.quick else 5)
    a.train = a.train or (640 if a.quick else 3000)
    if a.role:
        a.k = int(a.k)
    else:
        a.k = [int(x) for x in (a.k or ("1,2" if a.quick else "1,2,4")).split(",")]
        a.systems = [s for s in a.systems.split(",") if s]
        unknown = set(a.systems) - set(SYSTEMS)
        if unknown:
            ap.error(f"unknown systems {sorted(unknown)}")
    return a


def main() -> None:
    a = parse()
    if a.role == "trainer":
        return trainer(a)
    if a.role == "producer":
        return producer(a)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tsock-e2e-") as tmp:
        res = measure(a, Path(tmp))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
