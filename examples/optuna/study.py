"""A hyper-parameter study run by Optuna on one node, twice: once with the
trials' input pipeline shared through tsock, once with a DataLoader per
trial; the same grid of trials both times.

Several Optuna worker processes share one study through its RDB storage
(a SQLite file), each running train.py, an ordinary training script whose
only tsock line is `tsock.shared(...)`, on the grid points this driver
gives it. With it, every trial
on the node reads the batches of one producer process that the first trial
started; without it, each trial decodes and augments the images itself.

It prints, per trial, the hyper-parameters, the validation accuracy and the
training throughput, then for each loader the wall time, the aggregate
throughput and the CPU time of everything the study ran (workers, trials,
producer, pipeline workers: every process is reaped here and counted). The
training is the same in both runs, so the difference is the input
pipeline's CPU that sharing saved, measured, not multiplied out.

    python examples/optuna/study.py                       # ~2-3 min on 2 cores
    python examples/optuna/study.py --quick               # ~1 min
    python examples/optuna/study.py --kill-producer 10    # SIGKILL the shared producer 10 s after its start

With --kill-producer the trials do not notice beyond a pause: one of them
starts a successor that resumes exactly where the dead producer stopped.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import data  # noqa: E402
import optuna  # noqa: E402

FULL = {"train": 3000, "val": 500, "epochs": 2, "lrs": [0.02, 0.05, 0.1, 0.2], "widths": [8, 16]}
QUICK = {"train": 1000, "val": 300, "epochs": 2, "lrs": [0.05, 0.2], "widths": [8, 16]}
PR_SET_CHILD_SUBREAPER = 36


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"a smaller grid and dataset: {QUICK}")
    ap.add_argument("--workers", type=int, default=4, help="Optuna worker processes (default 4)")
    ap.add_argument("--loaders", default="tsock,plain", help="which runs, in order (default tsock,plain)")
    ap.add_argument("--kill-producer", type=float, metavar="S", help="SIGKILL the shared producer S s after it started")
    ap.add_argument("--data-dir", type=Path, help="dataset cache (default build/sweep-data in the repository)")
    ap.add_argument("--out-dir", type=Path, help="the study's SQLite file (default build/optuna)")
    ap.add_argument("--json", type=Path, help="also write the results to this file")
    ap.add_argument("--train", type=int, help="training images (instead of the size's)")
    ap.add_argument("--val", type=int, help="validation images (instead of the size's)")
    args = ap.parse_args(argv)
    size = dict(QUICK if args.quick else FULL)
    size.update({k: getattr(args, k) for k in ("train", "val") if getattr(args, k)})
    keys = ("train", "val", "epochs", "lrs", "widths")
    args.train, args.val, args.epochs, args.lrs, args.widths = (size[k] for k in keys)
    root = HERE.parents[1] / "build"
    args.data_dir = (args.data_dir or root / "sweep-data").resolve()
    args.out_dir = (args.out_dir or root / "optuna").resolve()
    args.loaders = args.loaders.split(",")
    if not set(args.loaders) <= {"tsock", "plain"}:
        ap.error("--loaders takes tsock and plain")
    return args


def grid(args) -> list[dict]:
    """The trials: every (lr, width) of the grid, the same in both runs."""
    return [{"lr": lr, "width": w} for w in args.widths for lr in args.lrs]


def worker_command(args, study: str, storage: str, loader: str, points: list[dict]) -> list[str]:
    return [
        sys.executable,
        str(HERE / "train.py"),
        *("--storage", storage, "--study", study, "--loader", loader),
        *("--data-dir", str(args.data_dir), "--train-size", str(args.train), "--val-size", str(args.val)),
        *("--epochs", str(args.epochs), "--grid", ",".join(f"{p['lr']}:{p['width']}" for p in points)),
    ]


class Reaper:
    """Waits for every process that ends under this one: the workers, and
    (this process being a child subreaper) every orphan below them, such
    as the shared producer a trial started in a session of its own. So
    RUSAGE_CHILDREN counts the CPU of everything the study ran."""

    def __init__(self):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        self.status: dict[int, int] = {}

    def wait(self, pids: list[int], deadline: float) -> None:
        """Reaps whatever ends until every one of pids has; with no pids,
        until nothing is left below (a lingering producer exits some
        seconds after the last trial)."""
        while not (pids and all(p in self.status for p in pids)):
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return  # nothing left below
            if pid:
                self.status[pid] = os.waitstatus_to_exitcode(status)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError("processes of the study still running after its end")
            time.sleep(0.05)


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def producer_pid(args) -> int | None:
    """The running shared producer of the trials' pipeline, if any: the one
    train.py's tsock.shared(data.make_pipeline, ...) attaches to."""
    import tsock

    options = {"batch_size": 64, "seed": 0, "workers": 2}  # train.py's defaults
    found = tsock.shared_producers(data.make_pipeline, str(args.data_dir), args.train, **options)
    return found[0].pid if found else None


def kill_producer_later(args, t0: float, log: list) -> None:
    """SIGKILLs the shared producer once it has run --kill-producer seconds."""
    deadline = time.monotonic() + 600
    first = None
    while first is None and time.monotonic() < deadline:
        first = producer_pid(args)
        time.sleep(0.05)
    if first is None:
        return
    born = time.monotonic()
    time.sleep(args.kill_producer)
    pid = producer_pid(args)  # the same, unless it already lingered out
    if pid:
        os.kill(pid, signal.SIGKILL)
        log.append({"pid": pid, "at_s": round(time.monotonic() - t0, 1), "lived_s": round(time.monotonic() - born, 1)})
        print(f"  killed the shared producer (pid {pid}) {log[-1]['at_s']} s into the run", flush=True)


def run_study(args, reaper: Reaper, loader: str) -> dict:
    storage = f"sqlite:///{args.out_dir / 'study.db'}"
    name = f"shapes-{loader}-{os.getpid()}-{int(time.time())}"
    optuna.create_study(study_name=name, storage=storage, direction="maximize")
    points = grid(args)
    print(f"{loader}: {len(points)} trials on {args.workers} Optuna workers, study {name!r}", flush=True)
    cpu0, t0 = children_cpu(), time.monotonic()
    shares = [points[i :: args.workers] for i in range(args.workers)]  # each worker's own grid points
    procs = [subprocess.Popen(worker_command(args, name, storage, loader, share)) for share in shares if share]
    kills: list = []
    if loader == "tsock" and args.kill_producer is not None:
        threading.Thread(target=kill_producer_later, args=(args, t0, kills), daemon=True).start()
    pids = [p.pid for p in procs]
    reaper.wait(pids, deadline=time.monotonic() + 3600)
    wall = time.monotonic() - t0
    for p in procs:
        p.returncode = reaper.status[p.pid]  # reaped above, not by Popen
    reaper.wait([], deadline=time.monotonic() + 120)  # a lingering producer
    cpu = children_cpu() - cpu0
    trials = optuna.load_study(study_name=name, storage=storage).trials
    return {
        "loader": loader,
        "wall_s": wall,
        "cpu_s": cpu,
        "worker_status": [p.returncode for p in procs],
        "samples_per_trial": args.epochs * args.train,
        "killed_producer": kills,
        "trials": [
            {
                "number": t.number,
                "state": t.state.name,
                "params": t.params,
                "acc": t.value,
                "samples": t.user_attrs.get("samples", 0),
                "rate": t.user_attrs.get("samples", 0) / max(1e-9, t.user_attrs.get("train_s", 0)),
                "longest_wait_s": t.user_attrs.get("longest_wait_s"),
                "first_batch_s": t.user_attrs.get("first_batch_s"),
                "began": t.datetime_start.timestamp() if t.datetime_start else None,
                "ended": t.datetime_complete.timestamp() if t.datetime_complete else None,
                "worker_started": t.user_attrs.get("worker_started"),
            }
            for t in trials
        ],
    }


def print_report(runs: list[dict]) -> None:
    for run in runs:
        print(f"\n{run['loader']}: trials")
        for t in sorted(run["trials"], key=lambda t: t["number"]):
            if t["state"] != "COMPLETE":
                print(f"  trial {t['number']:2d}  {t['state']}")
                continue
            p = t["params"]
            print(
                f"  trial {t['number']:2d}  lr {p['lr']:<5g} width {p['width']:<3d} accuracy {t['acc']:.3f}"
                f"  {t['rate']:5.0f} samples/s  first batch after {t['first_batch_s']:.1f} s,"
                f" then waits of at most {t['longest_wait_s']:.2f} s"
            )
    print("\nloader  trials  wall      samples/s (all trials)  CPU (every process)  CPU per sample")
    for run in runs:
        done = [t for t in run["trials"] if t["state"] == "COMPLETE"]
        samples = sum(t["samples"] for t in done)
        run["samples"] = samples
        print(
            f"{run['loader']:<7} {len(done):>6}  {run['wall_s']:6.1f} s  {samples / run['wall_s']:>22.0f}"
            f"  {run['cpu_s']:>17.1f} s  {1e3 * run['cpu_s'] / max(1, samples):>11.2f} ms"
        )
    by = {r["loader"]: r for r in runs}
    if {"tsock", "plain"} <= set(by):
        t, p = by["tsock"], by["plain"]
        saved = p["cpu_s"] - t["cpu_s"]
        print(
            f"\nInput pipeline CPU saved by sharing it: {saved:.1f} s of {p['cpu_s']:.1f} s "
            f"({100 * saved / p['cpu_s']:.0f}% of the study's CPU); throughput "
            f"{(t['samples'] / t['wall_s']) / max(1e-9, p['samples'] / p['wall_s']):.2f}x the DataLoader per trial"
        )
    for run in runs:
        for k in run["killed_producer"]:
            done = sum(t["state"] == "COMPLETE" for t in run["trials"])
            print(
                f"The shared producer (pid {k['pid']}) was killed {k['at_s']} s in; {done} of "
                f"{len(run['trials'])} trials completed, the longest wait for a batch was "
                f"{max((t['longest_wait_s'] or 0) for t in run['trials']):.2f} s"
            )


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    reaper = Reaper()
    print(f"dataset: {args.train} training and {args.val} validation images in {args.data_dir}", flush=True)
    data.dataset(str(args.data_dir), "train", args.train)
    data.dataset(str(args.data_dir), "val", args.val)
    runs = [run_study(args, reaper, loader) for loader in args.loaders]
    print_report(runs)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    failed = [s for r in runs for s in r["worker_status"] if s != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
