"""The decoded-sample cache in a hyper-parameter sweep (issue 15, part 4):
K trainers for E epochs, all at once, on one node, fed by

- dataloader: a torch DataLoader each (persistent workers), the baseline;
- tsock: one shared tsock.Pipeline in a producer process, published once
  to every trainer (tsock.Producer, tsock.Consumer), no cache;
- tsock+belady@X, tsock+lru@X: the same with Pipeline(cache_bytes=...) of
  X% of the decoded dataset, cache_policy "belady" or "lru", kept on
  (cache_auto_off=False: the policy's own figures);
- tsock+auto@X: Belady as users get it by default, turned off in each
  worker where it costs more time than its hits save (cache_auto_off).

Two sources over the same JPEG files (generated once into build/):
"decode" (decode-bound: PIL decodes the whole image, a random flip as
augment) and "io" (I/O-bound: each read sleeps LATENCY + size / BANDWIDTH,
a network file system's model, then a light decode: PIL's 1/8-scale DCT
draft). The worker budget is the same for every system: W = K worker
processes in all (one per trainer's DataLoader; all W in the shared
pipeline). A trainer reads every batch (sums it) and does nothing else.

Per run, in fresh processes: aggregate throughput (samples delivered to all
trainers per second of wall time, from "go" to the last trainer's last
batch) and CPU per sample (CPU seconds of every process below the runner:
producer, its workers, trainers, their DataLoader workers, over the same
interval, read from /proc, / samples delivered). Then the hit rates of
Belady, LRU and fill-once against cache size on the same order, by
simulation (tsock._cache_policy.simulate), with the store's measured ones.

    python bench/cache_sweep.py [--quick] [--k 4] [--epochs 5] [--images 512] [--sources decode,io]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import numpy as np
from e2e import Out, child_env  # JSON lines to the runner's result file; its processes' environment
from proctree import descendants

ROOT = Path(__file__).resolve().parents[1]
BATCH = 32
LATENCY_S = 0.002  # the I/O model: per read ...
BANDWIDTH = 100e6  # ... plus size / 100 MB/s, per reader (no shared cap)
SOURCES = ("decode", "io")
_TICK = os.sysconf("SC_CLK_TCK")


NOTES = """How to read it. The DataLoader baseline decodes every sample K times (each trainer its own order)
and is CPU-bound on the 2 CPUs; sharing decodes it once, and the cache skips `read` and `decode` for a hit. What
neither removes: the trainers' own work (a sum of each batch, K times), the producer's copy of each batch into the
ring, a cache lookup per sample (a `pread` of the sample, docs/CACHE.md "Measured"), the Pipeline's per-sample
Python (seeding, collate) and, with LRU, its eviction under the lock at every miss once the cache is full. Belady
ranks at a miss only where an eviction can gain a hit (docs/CACHE.md "Eviction"): not for one shared pipeline, whose
full cache keeps what it holds (before that change, 0.17-0.25 ms a miss, bench/belady_cost.py, against a 0.28 ms
decode). On 2 CPUs all of it comes from the same CPUs as decoding, so
sharing gains less than K and the cache less than 1 / (1 - hit rate) on top of it: CoorDL's 5.7x (K = 4, 50%
cache, against a DataLoader each) is not reached on this machine; the ratio is in the Targets table.

With one shared pipeline every sample is computed once an epoch in one order, so the hit rate is at most the
cached fraction × (E - 1) / E whatever the policy: Belady and fill-once both reach it (they tie: a fresh
permutation each epoch leaves nothing better to keep, so the store's Belady keeps what it holds there), LRU
falls far below it (it evicts what the next epoch needs first). Belady's edge over fill-once is with pipelines of
their own sharing one cache (the right-hand plot). A measured rate a little off the simulated one is not an
error: the workers prefetch across an epoch boundary (W × prefetch batches in flight), so the real trace
interleaves two epochs, which the simulated one (the order, epoch after epoch) does not. The I/O-bound source's
reads sleep: there the limit is W readers' latency, not the CPUs, until the cache removes the reads. One run of
each system on a VM shared with other jobs: runs of a few seconds move by 20-50% from one run to the next
(compare the hit rates and the CPU per sample, which move less, and read ratios within that as equal)."""


def systems(sizes) -> list[str]:
    out = ["dataloader", "tsock"]
    for pct in sizes:
        out += [f"tsock+belady@{pct}", f"tsock+lru@{pct}", f"tsock+auto@{pct}"]
    return out


def parse_system(name: str) -> tuple[str | None, int]:
    """(policy, percent) of a system's name; (None, 0) without a cache."""
    if "+" not in name:
        return None, 0
    policy, pct = name.split("+", 1)[1].split("@")
    return policy, int(pct)


# ---- the data and the stages (module level: the cache key hashes their code) ----


def make_images(folder: Path, n: int, side: int) -> list[str]:
    """n JPEGs of side x side (smooth colour waves plus noise, quality 90),
    made once per (n, side) and reused."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    paths = [str(folder / f"{i:05d}.jpg") for i in range(n)]
    if all(os.path.exists(p) for p in paths):
        return paths
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:side, 0:side].astype(np.float32)
    for i, p in enumerate(paths):
        f = rng.uniform(3, 12, 6)
        img = np.stack([np.sin(xx / f[c] + i) * 60 + np.cos(yy / f[c + 3] + c) * 60 + 128 for c in range(3)], -1)
        img += rng.normal(0, 20, img.shape)
        tmp = p + ".tmp"
        Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(tmp, "JPEG", quality=90)
        os.replace(tmp, p)
    return paths


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_remote(path: str) -> bytes:
    """A read from a network file system: LATENCY_S + size / BANDWIDTH of waiting."""
    data = read_file(path)
    time.sleep(LATENCY_S + len(data) / BANDWIDTH)
    return data


def decode_full(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def decode_light(data: bytes) -> np.ndarray:
    """PIL's draft mode: the JPEG decoded at 1/8 scale in the DCT domain."""
    from PIL import Image

    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (im.width // 8, im.height // 8))
    return np.asarray(im.convert("RGB"))


def flip(x: np.ndarray, rng) -> np.ndarray:
    return x[:, ::-1] if rng.random() < 0.5 else x


STAGES = {"decode": (read_file, decode_full), "io": (read_remote, decode_light)}


class Files:
    """The DataLoader's dataset: the same read and decode, flip from Python's generator."""

    def __init__(self, paths: list[str], source: str):
        self.paths, self.source = paths, source

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> np.ndarray:
        import random

        read, decode = STAGES[self.source]
        x = decode(read(self.paths[i]))
        return np.ascontiguousarray(x[:, ::-1]) if random.random() < 0.5 else x


def pipeline(a: Namespace, paths: list[str], system: str, **kw):
    import tsock

    read, decode = STAGES[a.source]
    policy, pct = parse_system(system)
    if policy:
        auto = policy == "auto"
        kw.update(cache_bytes=cache_budget(a, paths, pct), cache_dir=a.cache_dir)
        kw.update(cache_policy="belady" if auto else policy, cache_auto_off=auto)
    return tsock.Pipeline(paths, batch_size=BATCH, read=read, decode=decode, augment=flip, seed=a.seed, **kw)


def cache_budget(a: Namespace, paths: list[str], pct: int) -> int:
    """cache_bytes holding pct% of the decoded samples (all one size here)."""
    from tsock import _cache_codec, _cache_segment

    read, decode = STAGES[a.source]
    size = len(_cache_codec.encode(decode(read_file(paths[0]))))
    return _cache_segment.budget_for(len(paths), size, round(len(paths) * pct / 100))


# ---- the processes ----


def trainer(a: Namespace) -> None:
    import warnings

    # torch's collate of PIL's read-only arrays: it copies them into the batch
    warnings.filterwarnings("ignore", "The given NumPy array is not writable")
    out = Out(a.out)
    paths = make_images(Path(a.data_dir), a.images, a.side)
    if a.system == "dataloader":
        import torch
        from torch.utils.data import DataLoader

        torch.set_num_threads(1)
        g = torch.Generator()
        g.manual_seed(a.seed + a.rank)  # each trial its own order
        source = DataLoader(
            Files(paths, a.source),
            batch_size=BATCH,
            shuffle=True,
            generator=g,
            num_workers=a.workers // a.k,
            persistent_workers=True,
            multiprocessing_context="fork",
        )
    else:
        import tsock
    out(ready=True)
    _wait_for(a.go)
    if a.system != "dataloader":
        source = tsock.Consumer(a.name, output="numpy", timeout=120)
    for epoch in range(a.epochs):
        n = 0
        for b in source:
            x = np.asarray(b)
            float(x.sum())  # the trainer's work: it reads every byte of its batch
            n += len(x)
        out(epoch=epoch, samples=n, t=time.monotonic())
    out(done=True)
    _wait_for(a.stop)  # the runner has read the CPU times


def producer(a: Namespace) -> None:
    import tsock

    out = Out(a.out)
    paths = make_images(Path(a.data_dir), a.images, a.side)
    pipe = pipeline(a, paths, a.system, workers=a.workers)
    prod = tsock.Producer(pipe, a.name, slots=16, wait_readers=a.k, timeout=300)
    out(ready=True)
    _wait_for(a.go)
    prod.run(epochs=a.epochs)
    stats = pipe.cache_stats()
    out(cache=stats.get("segment") if stats else None)
    out(done=True)
    _wait_for(a.stop)
    prod.close()
    pipe.close()


def _wait_for(path: str, poll: float = 0.005) -> None:
    while not os.path.exists(path):
        time.sleep(poll)


def host(a: Namespace) -> None:
    """Forks the run's processes (the producer, if any, then the K trainers)
    once the modules every one of them needs are imported: torch takes 5 CPU
    seconds to import on a loaded 2-CPU VM, K times in parallel otherwise.
    Start-up is outside the measured interval either way; a child imports
    tsock itself (its library is loaded after the fork)."""
    if a.system == "dataloader":
        import torch
        import torch.utils.data  # noqa: F401

        torch.set_num_threads(1)
    import PIL.Image  # noqa: F401

    roles = ([] if a.system == "dataloader" else [("producer", 0)]) + [("trainer", i) for i in range(a.k)]
    pids = []
    for role, i in roles:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                a.rank, a.out = i, f"{a.out}-{role}-{i}.jsonl"
                producer(a) if role == "producer" else trainer(a)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    failed = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        failed |= os.waitstatus_to_exitcode(status) != 0
    sys.exit(1 if failed else 0)


# ---- the runner ----


def tree_cpu(root: int) -> float:
    """CPU seconds of every live process below root, with the children each has reaped."""
    total = 0
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
        except (OSError, IndexError, ValueError):
            pass
    return total / _TICK


def _read(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def _check(proc, deadline: float, phase: str) -> None:
    if proc.poll() is not None:
        raise RuntimeError(f"exited with status {proc.returncode} during {phase}: {proc.stderr.read()[-2000:]}")
    if time.monotonic() > deadline:
        raise RuntimeError(f"timed out during {phase}")


def run_config(a: Namespace, source: str, system: str, tmp: Path) -> dict:
    """K trainers fed by `system` on `source`, in fresh processes."""
    base = [sys.executable, str(Path(__file__).resolve()), "--k", str(a.k), "--epochs", str(a.epochs)]
    base += ["--images", str(a.images), "--side", str(a.side), "--data-dir", str(a.data_dir), "--seed", str(a.seed)]
    base += ["--workers", str(a.workers), "--cache-dir", str(a.cache_dir), "--source", source, "--system", system]
    base += ["--name", f"cachebench-{os.getpid()}-{source}-{system.replace('+', '-').replace('@', '-')}"]
    roles = ([] if system == "dataloader" else [("producer", 0)]) + [("trainer", i) for i in range(a.k)]
    env = child_env()
    stem = tmp / f"{source}-{system}"
    files = [Path(f"{stem}-{role}-{i}.jsonl") for role, i in roles]
    go, stop = Path(f"{stem}.go"), Path(f"{stem}.stop")
    for f in files + [go, stop]:
        f.unlink(missing_ok=True)
    cmd = base + ["--role", "host", "--out", str(stem), "--go", str(go), "--stop", str(stop)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + a.timeout
        while not all(any(r.get("ready") for r in _read(f)) for f in files):
            _check(proc, deadline, "start")
            time.sleep(0.05)
        cpu0, t0 = tree_cpu(os.getpid()), time.monotonic()
        go.touch()
        while not all(any(r.get("done") for r in _read(f)) for f in files):
            _check(proc, deadline, "run")
            time.sleep(0.02)
        cpu = tree_cpu(os.getpid()) - cpu0
        stop.touch()
        _, err = proc.communicate(timeout=60)
        if proc.returncode:
            raise RuntimeError(f"exit status {proc.returncode}: {err[-2000:]}")
    finally:
        if proc.poll() is None:  # a failure: the host and every process it started
            for pid in [proc.pid] + descendants(proc.pid):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            proc.wait()
    reports = [_read(f) for f in files]
    trainers = [[r for r in rep if "epoch" in r] for rep in reports[len(reports) - a.k :]]
    samples = sum(e["samples"] for t in trainers for e in t)
    end = max(e["t"] for t in trainers for e in t)
    first = max(t[0]["t"] for t in trainers)  # every trainer past its first epoch
    later = sum(e["samples"] for t in trainers for e in t[1:])
    cache = next((r["cache"] for rep in reports for r in rep if "cache" in r), None)
    out = {
        "source": source,
        "system": system,
        "samples": samples,
        "wall_s": end - t0,
        "samples_per_s": samples / (end - t0),
        "later_samples_per_s": later / (end - first) if later and end > first else None,
        "first_epoch_s": first - t0,
        "cpu_s": cpu,
        "cpu_ms_per_sample": 1e3 * cpu / samples,
        "run_s": time.monotonic() - started,  # with the processes' start-up
    }
    if cache:
        # The shared pipeline computes each sample once an epoch, and every
        # miss is an insert or a bypass (counted under the store's exclusive
        # lock); the segment's hit counter is advisory (bumped under the
        # shared lock, updates can be lost) and it counts no misses.
        accesses = a.epochs * a.images
        out["hit_rate"] = 1 - (cache["inserts"] + cache["bypasses"]) / accesses
        if parse_system(system)[0] == "auto":
            # A worker that turned the cache off computes its samples without
            # a miss, insert or bypass: only the hit counter tells (it may
            # have lost a few updates, so it can read a little low).
            out["hit_rate"] = cache["hits"] / accesses
        out["cache"] = {k: cache[k] for k in ("hits", "misses", "inserts", "evictions", "bypasses", "cached")}
    return out


# ---- hit rates by simulation ----


def hit_rates(a: Namespace, fractions) -> dict:
    """Hit rate against cache size (fractions of the dataset) for the sweep's
    trace (one shared pipeline: its order, epoch after epoch) and for K
    pipelines of their own (seeds seed..seed+K-1, one sample of each in
    turn) sharing one cache: Belady as the store runs it (its next uses from
    the consumers' known orders), LRU, fill-once, and the offline optimum
    (MIN on the whole trace: optimal for samples of one size)."""
    import tsock
    from tsock._cache_policy import LRU, Belady, FillOnce, KnownFuture, OnlineBelady, simulate

    n = a.images

    def order(seed: int):
        p = tsock.Pipeline(list(range(n)), batch_size=BATCH, seed=seed)
        return [int(i) for e in range(a.epochs) for i in p.indices(e)], p

    shared, _ = order(a.seed)
    own = [order(a.seed + r) for r in range(a.k)]
    mixed, who = [], []
    for t in range(n * a.epochs):
        for r in range(a.k):
            mixed.append(own[r][0][t])
            who.append((r, t // n))
    sizes = dict.fromkeys(range(n), 1)
    out = {"fractions": list(fractions), "n": n, "epochs": a.epochs, "k": a.k}
    for name, trace, consumers, w in (("shared", shared, own[:1], [(0, t // n) for t in range(len(shared))]),
                                      ("own", mixed, own, who)):  # fmt: skip
        rows: dict[str, list] = {"belady": [], "lru": [], "fill-once": [], "optimum": []}
        for f in fractions:
            cap = max(1, round(n * f))
            rows["lru"].append(simulate(trace, sizes, cap, LRU()).hit_rate)
            rows["fill-once"].append(simulate(trace, sizes, cap, FillOnce()).hit_rate)
            rows["optimum"].append(simulate(trace, sizes, cap, Belady()).hit_rate)
            fut = KnownFuture(n)
            for r, (_, p) in enumerate(consumers):
                fut.set_consumer(r, p.indices)
            rows["belady"].append(simulate(trace, sizes, cap, OnlineBelady(fut), who=w).hit_rate)
        out[name] = rows
    return out


# ---- the section ----


def measure(a: Namespace, log=print) -> dict:
    make_images(Path(a.data_dir), a.images, a.side)  # before anything is timed
    names = systems(a.sizes)
    res = {
        "k": a.k,
        "epochs": a.epochs,
        "images": a.images,
        "side": a.side,
        "batch": BATCH,
        "workers": a.workers,
        "sizes": a.sizes,
        "systems": names,
        "io_model": {"latency_ms": 1e3 * LATENCY_S, "bandwidth_mb_s": BANDWIDTH / 1e6},
        "runs": [],
        "failures": {},
    }
    read, decode = STAGES["decode"]
    sample = decode(read(make_images(Path(a.data_dir), a.images, a.side)[0]))
    res["decoded_bytes"] = int(sample.nbytes) * a.images
    res["file_bytes"] = sum(os.path.getsize(p) for p in make_images(Path(a.data_dir), a.images, a.side))
    cache_root = Path(tempfile.mkdtemp(prefix="tsock-cachebench-", dir="/dev/shm"))
    a.cache_dir = str(cache_root)  # a directory of our own: no other run's segment is found warm
    try:
        with tempfile.TemporaryDirectory(prefix="tsock-cachebench-") as tmp:
            for source in a.sources:
                for system in names:
                    try:
                        r = run_config(a, source, system, Path(tmp))
                    except Exception as e:  # noqa: BLE001 - reported in the document
                        res["failures"][f"{source}/{system}"] = f"{type(e).__name__}: {e}"
                        log(f"  {source:>6} {system:>18}: FAILED: {e}")
                        continue
                    res["runs"].append(r)
                    hit = f", hit rate {r['hit_rate']:.3f}" if "hit_rate" in r else ""
                    log(
                        f"  {source:>6} {system:>18}: {r['samples_per_s']:7.0f} samples/s, "
                        f"{r['cpu_ms_per_sample']:.3f} CPU ms/sample{hit} "
                        f"({r['wall_s']:.1f} s, {r['run_s']:.1f} s with start-up)"
                    )
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)
    for source in a.sources:
        base = run_of(res, source, "dataloader")
        for r in res["runs"]:
            if r["source"] == source and base:
                r["speedup"] = r["samples_per_s"] / base["samples_per_s"]
                r["cpu_ratio"] = r["cpu_ms_per_sample"] / base["cpu_ms_per_sample"]
    t = time.monotonic()
    res["hit_rates"] = hit_rates(a, a.fractions)
    log(f"  hit rates simulated at {len(a.fractions)} sizes ({time.monotonic() - t:.1f} s)")
    return res


def run_of(res: dict, source: str, system: str) -> dict | None:
    return next((r for r in res["runs"] if (r["source"], r["system"]) == (source, system)), None)


def parse(argv=None) -> Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 small images, K=2, 2 epochs, a 50%% cache")
    ap.add_argument("--k", type=int, default=None, help="trainers (default 4; --quick 2)")
    ap.add_argument("--epochs", type=int, default=None, help="default 5; --quick 2")
    ap.add_argument("--images", type=int, default=None, help="default 512; --quick 64")
    ap.add_argument("--side", type=int, default=None, help="image side in pixels (default 160; --quick 64)")
    ap.add_argument("--sizes", default=None, help="cache sizes, %% of the decoded dataset (default 25,50,100)")
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--workers", type=int, default=None, help="worker processes in all (default K)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--json", type=Path)
    # process roles (internal)
    ap.add_argument("--role", choices=["host"], help=argparse.SUPPRESS)
    ap.add_argument("--go", help=argparse.SUPPRESS)
    ap.add_argument("--stop", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--source", choices=SOURCES, help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default="/dev/shm", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.k = a.k or (2 if a.quick else 4)
    a.epochs = a.epochs or (2 if a.quick else 5)
    a.images = a.images or (64 if a.quick else 512)
    a.side = a.side or (64 if a.quick else 160)
    a.workers = a.workers or a.k
    if a.workers % a.k:
        ap.error("--workers must be a multiple of --k (the DataLoaders split them evenly)")
    a.sizes = [int(x) for x in (a.sizes or ("50" if a.quick else "25,50,100")).split(",") if x]
    a.sources = [s for s in a.sources.split(",") if s]
    if set(a.sources) - set(SOURCES):
        ap.error(f"unknown sources {sorted(set(a.sources) - set(SOURCES))}")
    a.fractions = [0.25, 0.5, 1.0] if a.quick else [0.1, 0.25, 0.4, 0.5, 0.75, 1.0]
    a.data_dir = a.data_dir or str(ROOT / "build" / f"cache-bench-data-{a.images}-{a.side}")
    return a


def main() -> None:
    a = parse()
    if a.role == "host":
        return host(a)
    res = measure(a)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
