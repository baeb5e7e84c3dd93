"""tsock.Pipeline against a torch DataLoader over the same dataset and
transforms, with the same number of worker processes.

The dataset is the sweep's (examples/python/shapes_data.py: JPEG decode,
random resized crop, flip, normalise; its random numbers come from Python's
global generator, which the Pipeline seeds per sample), batches of 64,
shuffled. Systems, each in a fresh process, the batches read (summed), no
training:

- dataloader: DataLoader(num_workers=W, persistent_workers=True), its
  workers kept across epochs like the Pipeline's (the fair baseline);
- dataloader-fresh: the same with DataLoader's default, new workers each
  epoch;
- tsock: Pipeline(workers=W).batches(epoch), private batches (a copy out of
  the workers' staging memory, as DataLoader's batches are the caller's).

Per epoch: wall time and CPU time of the process and its workers (live ones
read from /proc, exited ones from RUSAGE_CHILDREN). Reported: the median
over the epochs after the first (start-up), and over the repeats, which
alternate the systems.

    python bench/pipeline.py [--quick] [--workers N] [--epochs E] [--train N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

from e2e import child_env
from proctree import children

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "python"
SYSTEMS = ("dataloader", "dataloader-fresh", "tsock")
BATCH = 64
_TICK = os.sysconf("SC_CLK_TCK")


NOTES = """Systems: **dataloader** = `DataLoader(num_workers=W, persistent_workers=True)`, its workers kept
across epochs as the Pipeline keeps its own (the baseline of the ratios); **dataloader-fresh** = DataLoader's
default, new workers every epoch; **tsock** = `Pipeline(workers=W).batches(epoch)`. Both loaders hand out
private batches: DataLoader's workers collate into a new shared-memory tensor per batch and pass its file
descriptor; the Pipeline's workers collate, copy the batch into a staging buffer they reuse (memfd, mapped by
both sides) and send its layout; `batches()` copies it out (the Producer publishes straight from the staging
buffer instead). What the Pipeline does on top: the order is its own function of (seed, epoch), each sample's
generators are seeded, batches are handed out in order whatever worker finishes first, and `batches(epoch,
start=k)` starts at batch k computing nothing before it. Throughput on this 2-CPU machine, shared with other
jobs (see the load average above), moves by 10-20% between runs of the same system: read ratios near 1 as
equal."""


def tree_cpu() -> float:
    """CPU seconds of this process, its live descendants and its reaped children."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
    kids, todo = children(), [os.getpid()]
    while todo:
        for pid in kids.get(todo.pop(), []):
            todo.append(pid)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
            except (OSError, IndexError, ValueError):
                pass
    return total


def _dataset(a: Namespace):
    sys.path[:0] = [str(EXAMPLES), str(ROOT / "python")]
    import shapes_data

    folder = shapes_data.ensure_dataset(Path(a.data_dir), a.train, 1)
    return shapes_data.ShapesDataset(folder, "train", a.train, train=True)


def run_system(a: Namespace) -> dict:
    """One system in this process: E epochs, per-epoch wall and CPU."""
    import torch

    torch.set_num_threads(1)
    ds = _dataset(a)
    if a.system == "tsock":
        import tsock

        pipe = tsock.Pipeline(ds, batch_size=BATCH, seed=a.seed, workers=a.workers)
        epoch_iter = pipe.batches
    else:
        from torch.utils.data import DataLoader

        g = torch.Generator()
        g.manual_seed(a.seed)
        kw = {"num_workers": a.workers, "multiprocessing_context": "fork"} if a.workers else {}
        loader = DataLoader(
            ds,
            batch_size=BATCH,
            shuffle=True,
            generator=g,
            persistent_workers=a.system == "dataloader" and a.workers > 0,
            **kw,
        )

        def epoch_iter(_epoch):
            return iter(loader)

    out = {"system": a.system, "epoch_s": [], "cpu_s": [], "batches": [], "samples": []}
    for e in range(a.epochs):
        t0, c0, nb, ns = time.monotonic(), tree_cpu(), 0, 0
        for x, _ in epoch_iter(e):
            float(x.sum())  # a trainer reads every byte of its batch
            nb += 1
            ns += len(x)
        out["epoch_s"].append(time.monotonic() - t0)
        out["cpu_s"].append(tree_cpu() - c0)
        out["batches"].append(nb)
        out["samples"].append(ns)
    if a.system == "tsock":
        pipe.close()
    return out


def costs(a: Namespace) -> dict:
    """In-process, per sample: the dataset's own cost (decode and
    transforms) and what the Pipeline adds to make it deterministic (seeding
    the generators before the sample is loaded)."""
    import random

    from tsock import _stages

    ds = _dataset(a)
    n = 100 if a.quick else 600
    t = time.process_time()
    for i in range(n):
        ds[i % len(ds)]
    sample_s = (time.process_time() - t) / n
    stages = _stages.Stages(ds, None, None, None, None, a.seed)
    reps = 2000 if a.quick else 20000
    t = time.process_time()
    for i in range(reps):
        _stages.seed_globals(_stages._seed_words(a.seed, 0, i, _stages.LOAD))
    seed_s = (time.process_time() - t) / reps
    t = time.process_time()
    for i in range(reps):
        stages.rng(_stages._seed_words(a.seed, 0, i, _stages.AUGMENT))
    rng_s = (time.process_time() - t) / reps
    random.seed()
    return {"sample_ms": 1e3 * sample_s, "seed_us": 1e6 * seed_s, "rng_us": 1e6 * rng_s}


def _spawn(a: Namespace, system: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", system, "--workers", str(a.workers)]
    cmd += ["--epochs", str(a.epochs), "--train", str(a.train), "--data-dir", str(a.data_dir), "--seed", str(a.seed)]
    env = child_env()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    if proc.returncode:
        raise RuntimeError(f"{system} exited with status {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(system: str, runs: list[dict]) -> dict:
    skip = 1 if runs[0]["epoch_s"][1:] else 0  # the first epoch includes start-up
    epochs = [
        (r["epoch_s"][e], r["cpu_s"][e], r["batches"][e], r["samples"][e])
        for r in runs
        for e in range(skip, len(r["epoch_s"]))
    ]
    return {
        "system": system,
        "batches_per_s": statistics.median(b / w for w, _, b, _ in epochs),
        "samples_per_s": statistics.median(s / w for w, _, _, s in epochs),
        "cpu_ms_per_sample": statistics.median(1e3 * c / s for _, c, _, s in epochs),
        "first_epoch_s": statistics.median(r["epoch_s"][0] for r in runs),
        "batches": runs[0]["batches"][0],
        "runs": runs,
    }


def measure(a: Namespace, log=print) -> dict:
    _dataset(a)  # generate the images once, before anything is timed
    res = {"workers": a.workers, "batch": BATCH, "train": a.train, "epochs": a.epochs, "repeats": a.repeats}
    res["costs"] = costs(a)
    c = res["costs"]
    log(f"  dataset {c['sample_ms']:.3f} ms/sample; seeding {c['seed_us']:.1f} us + generator {c['rng_us']:.1f} us")
    per: dict[str, list] = {s: [] for s in SYSTEMS}
    failures = {}
    for rep in range(a.repeats):
        order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        for system in order:
            if system in failures:
                continue
            try:
                per[system].append(_spawn(a, system))
            except Exception as e:  # noqa: BLE001 - reported in the document
                failures[system] = f"{type(e).__name__}: {e}"
                log(f"  {system}: FAILED: {e}")
    res["systems"] = [_summary(s, per[s]) for s in SYSTEMS if per[s]]
    res["failures"] = failures
    for r in res["systems"]:
        log(
            f"  {r['system']:>16}: {r['batches_per_s']:6.1f} batches/s, {r['cpu_ms_per_sample']:.3f} CPU ms/sample, "
            f"first epoch {r['first_epoch_s']:.2f} s"
        )
    base = next((r for r in res["systems"] if r["system"] == "dataloader"), None)
    ts = next((r for r in res["systems"] if r["system"] == "tsock"), None)
    if base and ts:
        log(
            f"  tsock / dataloader: {ts['batches_per_s'] / base['batches_per_s']:.2f}x batches/s, "
            f"{ts['cpu_ms_per_sample'] / base['cpu_ms_per_sample']:.2f}x CPU per sample"
        )
    return res


def parse(argv=None) -> Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--epochs", type=int, default=None, help="default 4; --quick 2")
    ap.add_argument("--train", type=int, default=None, help="images (default 3000; --quick 320)")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each system (default 3; --quick 1)")
    ap.add_argument("--data-dir", default=str(ROOT / "build" / "sweep-data"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--role", choices=SYSTEMS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.epochs = a.epochs or (2 if a.quick else 4)
    a.train = a.train or (320 if a.quick else 3000)
    a.repeats = a.repeats or (1 if a.quick else 3)
    return a


def main() -> None:
    a = parse()
    if a.role:
        a.system = a.role
        print(json.dumps(run_system(a)), flush=True)
        return
    res = measure(a)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
