"""A hyper-parameter sweep on one node, fed by one tsock producer.

One producer process runs the input pipeline once: a torch DataLoader (with
os.cpu_count() worker processes) decodes JPEG images with PIL, random-crops,
flips and normalises them (shapes_data.py), and publishes every batch into a
tsock channel. Four trainer processes read every batch zero-copy
(tsock.Consumer, output="torch") and train small CNNs with different learning
rates and widths; after each training epoch the producer publishes the
validation split as one more epoch, and each trainer evaluates on it.

At the end it prints, per trainer, the hyper-parameters, the final validation
accuracy and the training throughput, and the input pipeline's CPU time: what
the shared producer spent (process and DataLoader workers, measured) against
what every trainer running its own DataLoader would have spent (one such
loader epoch is measured before the sweep starts, then multiplied out).

    python examples/python/sweep.py            # about 1-2 minutes on 2 cores
    python examples/python/sweep.py --quick    # about 20 s

A trainer that dies does not stop the others (the producer drops it at once);
if the producer dies, every trainer gets tsock.ProducerGone and the sweep
fails with a message instead of hanging; Ctrl-C stops every process.
"""

# ruff: noqa: E402  (the imports wait for the signal handlers below)
from __future__ import annotations

import signal

# Ctrl-C while the imports below run (seconds on a busy machine) would print a
# traceback from inside torch's initialisation: note it, stop once they are done.
_early_stops: list = []
if __name__ == "__main__":
    signal.signal(signal.SIGINT, lambda signum, frame: _early_stops.append(signum))
    signal.signal(signal.SIGTERM, lambda signum, frame: _early_stops.append(signum))

import argparse
import contextlib
import ctypes
import json
import math
import multiprocessing as mp
import os
import queue
import resource
import sys
import tempfile
import time
from pathlib import Path

import shapes_data
import torch
import torch.nn as nn
import torch.nn.functional as F
import tsock
from torch.utils.data import DataLoader
from tqdm import tqdm

HERE = Path(__file__).resolve().parent

# The sweep: one trainer per entry, in this order; --trainers takes a prefix.
CONFIGS = [
    {"lr": 0.2, "width": 8},
    {"lr": 0.02, "width": 8},
    {"lr": 0.1, "width": 16},
    {"lr": 0.01, "width": 16},
    {"lr": 0.05, "width": 8},
    {"lr": 0.05, "width": 16},
    {"lr": 0.4, "width": 8},
    {"lr": 0.005, "width": 8},
]
DEFAULT = {"train": 6000, "val": 1000, "epochs": 5}
QUICK = {"train": 1500, "val": 500, "epochs": 2}
REPORT_EVERY = 0.5  # seconds between progress messages from a child


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"small run (~20 s): {QUICK}")
    ap.add_argument("--epochs", type=int, help=f"training epochs (default {DEFAULT['epochs']})")
    ap.add_argument("--train-size", type=int, help=f"training images (default {DEFAULT['train']})")
    ap.add_argument("--val-size", type=int, help=f"validation images (default {DEFAULT['val']})")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--trainers", type=int, default=4, help=f"trainer processes, 1..{len(CONFIGS)} (default 4)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="DataLoader workers (default: CPUs)")
    ap.add_argument("--data-dir", type=Path, help="dataset cache (default: build/sweep-data in the repository)")
    ap.add_argument("--name", help="tsock channel name (default sweep-<pid>)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-baseline", action="store_true", help="skip measuring one separate loader epoch")
    ap.add_argument(
        "--progress",
        choices=["auto", "tqdm", "log"],
        default="auto",
        help="auto: tqdm bars (one per process) on a terminal, epoch lines otherwise",
    )
    ap.add_argument("--json", type=Path, help="also write the results to this file")
    ap.add_argument(
        "--device",
        help="train on this GPU (e.g. cuda:0): the producer copies each batch there once and every trainer reads "
        "it zero-copy (default: CPU)",
    )
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else DEFAULT
    args.epochs = args.epochs or preset["epochs"]
    args.train_size = args.train_size or preset["train"]
    args.val_size = args.val_size or preset["val"]
    if not 1 <= args.trainers <= len(CONFIGS):
        ap.error(f"--trainers must be in 1..{len(CONFIGS)}")
    if min(args.epochs, args.train_size, args.val_size, args.batch_size) < 1 or args.workers < 0:
        ap.error("sizes and counts must be positive")
    args.name = args.name or f"sweep-{os.getpid()}"
    args.data_dir = args.data_dir or default_data_dir()
    if args.device is not None:
        # Checked here, before any process starts, so a machine without a
        # GPU gets one clear line rather than failing trainers.
        try:
            torch.device(args.device)
        except RuntimeError:
            ap.error(f"--device {args.device!r}: not a device name (cuda, cuda:1, ...)")
        if not args.device.startswith("cuda"):
            ap.error(f"--device {args.device!r}: only CUDA devices (the default is the CPU)")
        if not torch.cuda.is_available():
            ap.error(f"--device {args.device}: PyTorch {torch.__version__} sees no CUDA GPU here")
    return args


def default_data_dir() -> Path:
    build = HERE.parents[1] / "build"
    if (HERE.parents[1] / "Makefile").exists():
        return build / "sweep-data"
    return Path(tempfile.gettempdir()) / "tsock-sweep-data"


def cpu_split() -> tuple[float, float]:
    """CPU seconds of this process, and of its children that have exited and
    been waited for (DataLoader workers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


def cpu_seconds() -> float:
    return sum(cpu_split())


def make_loaders(args, folder: Path):
    """The pipeline every trainer would otherwise run: training split with
    augmentation (shuffled), validation split without."""
    train = shapes_data.ShapesDataset(folder, "train", args.train_size, train=True)
    val = shapes_data.ShapesDataset(folder, "val", args.val_size, train=False)
    gen = torch.Generator()
    gen.manual_seed(args.seed)
    kw = {"batch_size": args.batch_size, "num_workers": args.workers}
    if args.workers:
        _loader_owner["pid"] = os.getpid()
        kw["worker_init_fn"] = _worker_init
        # Fork (Linux's default) even inside the producer, a spawned process
        # whose own default would be spawn: workers then start in
        # milliseconds instead of importing torch again every epoch.
        kw["multiprocessing_context"] = "fork"
    return DataLoader(train, shuffle=True, generator=gen, **kw), DataLoader(val, shuffle=False, **kw)


_deferred = {"depth": 0, "pending": None}  # see signals_deferred
_loader_owner = {"pid": None}  # the process whose DataLoaders fork the workers


@contextlib.contextmanager
def signals_deferred():
    """Holds Ctrl-C and SIGTERM back (in the handlers of
    install_stop_handlers) while a DataLoader starts its workers: torch 1.13 prints an
    AttributeError from the iterator's __del__ when interrupted half-way."""
    _deferred["depth"] += 1
    try:
        yield
    finally:
        _deferred["depth"] -= 1
    if _deferred["depth"] == 0 and _deferred["pending"] is not None:
        why, _deferred["pending"] = _deferred["pending"], None
        _ignore_stops()
        raise Interrupted(why)


def _worker_init(worker_id: int) -> None:
    # Forked inside signals_deferred: a worker takes signals at once again.
    _deferred.update(depth=0, pending=None)
    _die_with_parent(_loader_owner["pid"])


def _die_with_parent(parent: int | None) -> None:
    """Has the kernel kill this DataLoader worker the moment the process
    that forked it dies. PyTorch's own check runs every 5 s, so a killed
    producer's workers lived on for seconds (more on a loaded machine),
    holding the sweep's output open after the sweep itself had ended."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: PyTorch's own check remains
        return
    if parent is not None and os.getppid() != parent:  # it died before the prctl
        os._exit(1)


def epoch_batches(loader):
    """iter(loader), its workers started with signals deferred."""
    with signals_deferred():
        it = iter(loader)
    return it


def steps_per_epoch(args) -> int:
    return math.ceil(args.train_size / args.batch_size)


# ---- child processes ---------------------------------------------------------------------------------------


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, or the parent stopping the sweep (SIGTERM) or gone. A
    KeyboardInterrupt, so DataLoader workers (which inherit the handler) take
    it quietly as they take Ctrl-C."""


def install_stop_handlers() -> None:
    """Ctrl-C (SIGINT from the terminal) and SIGTERM (the parent stopping the
    sweep) both interrupt; once interrupted, further signals are ignored so
    that cleanup (closing the channel) finishes. The parent starts children
    with SIGINT ignored, so no Ctrl-C lands before this handler is in place."""

    def stop(signum, frame):
        if _deferred["depth"]:
            _deferred["pending"] = signal.Signals(signum).name
            return
        _ignore_stops()
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def _ignore_stops() -> None:
    # A Python no-op rather than SIG_IGN: a signal already on its way when
    # the disposition changes to SIG_IGN makes Python raise "Signal N ignored
    # due to race condition".
    signal.signal(signal.SIGINT, _no_op)
    signal.signal(signal.SIGTERM, _no_op)


def _no_op(signum, frame) -> None:
    pass


def _check_parent(ppid: int) -> None:
    """Stop when the sweep's main process is gone (killed, say)."""
    if os.getppid() != ppid:
        raise Interrupted("parent gone")


def producer_main(args, folder: Path, q, ppid: int) -> None:
    install_stop_handlers()
    try:
        torch.set_num_threads(1)
        train_loader, val_loader = make_loaders(args, folder)
        n_train, n_val = len(train_loader), len(val_loader)
        last = 0.0
        # Created before the loaders fork their workers; the channel itself
        # appears with the first batch and waits there for every trainer.
        with tsock.Producer(
            None, name=args.name, slots=16, wait_readers=args.trainers, timeout=300, device=args.device
        ) as p:
            (self0, kids0), t0 = cpu_split(), time.monotonic()
            samples = 0
            for epoch in range(args.epochs):
                for phase, loader, total in (("train", train_loader, n_train), ("val", val_loader, n_val)):
                    for i, (x, y) in enumerate(epoch_batches(loader)):
                        p.publish((x, y))
                        samples += len(y)
                        now = time.monotonic()
                        if now - last >= REPORT_EVERY or i + 1 == total:
                            last = now
                            _check_parent(ppid)
                            st = p.stats()
                            q.put(
                                (
                                    "producer",
                                    {
                                        "epoch": epoch,
                                        "phase": phase,
                                        "done": i + 1,
                                        "total": total,
                                        "samples": samples,
                                        "rate": samples / max(1e-9, now - t0),
                                        "readers": st["readers"],
                                        "waited": st["backpressure_s"],
                                    },
                                )
                            )
                    p.end_epoch()
            # Every DataLoader worker has exited and been waited for by now,
            # so their CPU time is in RUSAGE_CHILDREN.
            self1, kids1 = cpu_split()
            st = p.stats()
        cpu = {"cpu": self1 - self0 + kids1 - kids0, "cpu_self": self1 - self0, "cpu_workers": kids1 - kids0}
        q.put(("producer_done", {**cpu, "wall": time.monotonic() - t0, "samples": samples, **st}))
    except KeyboardInterrupt:  # Interrupted: Ctrl-C, SIGTERM, parent gone
        q.put(("stopped", "producer"))
        sys.exit(130)
    except Exception as e:
        q.put(("failed", "producer", f"{type(e).__name__}: {e}"))
        sys.exit(1)


def make_model(width: int):
    layers, c = [], 3
    for i, k in enumerate((width, 2 * width, 4 * width)):
        layers += [nn.Conv2d(c, k, 3, padding=1, bias=False), nn.BatchNorm2d(k), nn.ReLU(inplace=True)]
        if i < 2:
            layers.append(nn.MaxPool2d(2))
        c = k
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, len(shapes_data.CLASSES)))


def trainer_main(idx: int, hp: dict, args, q, ppid: int) -> None:
    install_stop_handlers()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(args.seed * 1000 + idx)
        model = make_model(hp["width"]).to(args.device or "cpu")
        opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=0.9, weight_decay=5e-4, nesterov=True)
        total_steps = args.epochs * steps_per_epoch(args)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, hp["lr"], total_steps=total_steps)
        steps = 0
        train_samples, train_time, wait_time = 0, 0.0, 0.0
        accs = []
        last = 0.0
        with tsock.Consumer(args.name, output="torch", timeout=300, device=args.device) as c:
            cpu0 = cpu_seconds()
            for epoch in range(args.epochs):
                # Training epoch: the producer's augmented batches.
                model.train()
                t0 = time.monotonic()
                loss_sum, n = 0.0, 0
                while True:
                    tw = time.monotonic()
                    try:
                        x, y = next(c)
                    except StopIteration:
                        break
                    wait_time += time.monotonic() - tw
                    opt.zero_grad(set_to_none=True)
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    opt.step()
                    if steps < total_steps:
                        sched.step()
                    steps += 1
                    loss_sum += loss.item() * len(y)
                    n += len(y)
                    now = time.monotonic()
                    if now - last >= REPORT_EVERY:
                        last = now
                        _check_parent(ppid)
                        rate = (train_samples + n) / max(1e-9, train_time + now - t0)
                        q.put(("progress", idx, {"epoch": epoch, "phase": "train", "samples": n, "rate": rate}))
                train_time += time.monotonic() - t0
                train_samples += n
                # Validation epoch: the producer publishes the held-out split.
                model.eval()
                correct, seen = 0, 0
                with torch.no_grad():
                    for x, y in c:
                        correct += int((model(x).argmax(1) == y).sum())
                        seen += len(y)
                        now = time.monotonic()
                        if now - last >= REPORT_EVERY:
                            last = now
                            q.put(("progress", idx, {"epoch": epoch, "phase": "val", "samples": seen}))
                accs.append(correct / max(1, seen))
                q.put(
                    (
                        "epoch",
                        idx,
                        {
                            "epoch": epoch,
                            "loss": loss_sum / max(1, n),
                            "acc": accs[-1],
                            "rate": train_samples / max(1e-9, train_time),
                            "val_samples": seen,
                        },
                    )
                )
            result = {
                "acc": accs[-1],
                "best": max(accs),
                "rate": train_samples / max(1e-9, train_time),
                "wait": wait_time / max(1e-9, train_time),
                "cpu": cpu_seconds() - cpu0,
                "params": sum(p.numel() for p in model.parameters()),
                "placement": c.placement,  # host; with --device: device (zero-copy) or pinned
            }
        q.put(("done", idx, result))
    except KeyboardInterrupt:  # Interrupted: Ctrl-C, SIGTERM, parent gone
        q.put(("stopped", idx))
        sys.exit(130)
    except Exception as e:  # tsock.ProducerGone among others: report, never hang
        q.put(("failed", idx, f"{type(e).__name__}: {e}"))
        sys.exit(1)


# ---- progress display ----------------------------------------------------------------------------------------


class Display:
    """Progress of the producer and of each trainer: one tqdm bar per
    process on a terminal ('tqdm'), only finished epochs and events
    otherwise ('log': pipes, CI)."""

    def __init__(self, args, mode: str):
        if mode == "auto":
            mode = "tqdm" if sys.stdout.isatty() else "log"
        self.mode = mode
        self.last_draw = 0.0
        self.bars = None
        self.closed = False
        self.acc = {}  # last validation accuracy per trainer
        if mode == "tqdm":
            fmt = "{desc} {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt}{postfix}"
            total = args.epochs * (args.train_size + args.val_size)
            self.bars = [tqdm(total=total, position=0, desc="producer ", bar_format=fmt, unit="img", leave=True)]
            for i in range(args.trainers):
                hp = CONFIGS[i]
                self.bars.append(
                    tqdm(
                        total=args.epochs * args.train_size,
                        position=i + 1,
                        desc=f"trainer {i} lr {hp['lr']:<5g} w {hp['width']:<2}",
                        bar_format=fmt,
                        unit="img",
                        leave=True,
                    )
                )

    def log(self, line: str) -> None:
        if self.bars is not None:
            self.bars[0].write(line)
        else:
            print(line, flush=True)

    def set(self, row: int, done: int, postfix: str = "") -> None:
        """Row 0 is the producer, row i+1 trainer i: `done` images so far."""
        if self.bars is None:
            return
        bar = self.bars[row]
        bar.n = min(done, bar.total)
        bar.set_postfix_str(postfix, refresh=False)
        now = time.monotonic()
        if now - self.last_draw >= 0.2:
            self.last_draw = now
            for b in self.bars:
                b.refresh()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.bars is not None:
            for b in self.bars:
                b.refresh()
                b.close()
            self.bars = None
            print()


# ---- the sweep -------------------------------------------------------------------------------------------------


def measure_separate_loader(args, folder: Path) -> float:
    """CPU seconds (this process and the DataLoader workers) that one trainer
    running its own loader spends on one epoch of training and validation
    batches: measured here, before the sweep, on an idle machine."""
    torch.set_num_threads(1)
    train_loader, val_loader = make_loaders(args, folder)
    cpu0 = cpu_seconds()
    for loader in (train_loader, val_loader):
        for _ in epoch_batches(loader):
            pass
    return cpu_seconds() - cpu0  # the workers exited at the end of each epoch and were waited for


def run(args) -> int:
    t_start = time.monotonic()
    k = args.trainers
    print(
        f"tsock sweep: 1 producer ({args.workers} DataLoader workers) -> {k} trainers, {args.epochs} epochs of "
        f"{args.train_size} training + {args.val_size} validation images (40x40 crops of 128x128 JPEGs), "
        f"channel '{args.name}'",
        flush=True,
    )
    t0 = time.monotonic()
    folder = shapes_data.ensure_dataset(args.data_dir, args.train_size, args.val_size, seed=0)
    print(f"dataset: {folder} ({time.monotonic() - t0:.1f} s)", flush=True)

    baseline = None
    if not args.no_baseline:
        t0 = time.monotonic()
        baseline = measure_separate_loader(args, folder)
        print(
            f"one trainer's own DataLoader: {baseline:.2f} s CPU per epoch (measured in {time.monotonic() - t0:.1f} s)",
            flush=True,
        )

    ctx = mp.get_context("spawn")  # fresh interpreters: no inherited threads, locks or Go runtime
    # One queue per child: a multiprocessing.Queue's writers share a lock,
    # and a child killed while holding it would silence every other child.
    q = Inbox({key: ctx.Queue() for key in ["producer", *range(k)]})
    me = os.getpid()
    procs = {
        "producer": ctx.Process(
            target=producer_main, args=(args, folder, q.queues["producer"], me), name="sweep-producer"
        )
    }
    for i in range(k):
        procs[i] = ctx.Process(
            target=trainer_main, args=(i, CONFIGS[i], args, q.queues[i], me), name=f"sweep-trainer-{i}"
        )
    display = Display(args, args.progress)
    results, failures, producer_result = {}, {}, None
    reported = set()
    t_sweep = time.monotonic()
    try:
        # Children start with Ctrl-C ignored until their own handler is set
        # (an interrupt while they import would print tracebacks); this
        # process still gets it and stops them.
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for p in procs.values():
                p.start()
        finally:
            signal.signal(signal.SIGINT, handler)
        pids = ", ".join(f"{'producer' if key == 'producer' else f'trainer {key}'} {p.pid}" for key, p in procs.items())
        display.log(f"processes: {pids}")
        deadline = None
        producer_progress = None
        while True:
            try:
                msg = q.get(timeout=0.2)
            except queue.Empty:
                msg = None
            if msg is not None:
                producer_result = handle(msg, args, display, results, failures) or producer_result
                if msg[0] == "producer":
                    producer_progress = msg[1]
                if msg[0] in ("done", "failed", "stopped", "producer_done"):
                    reported.add(msg[1] if msg[0] != "producer_done" else "producer")
            for key, p in procs.items():
                if p.exitcode is not None and key not in reported and key not in failures:
                    # Died without a word (killed, crashed): say so; the
                    # queue may still hold its last message, so look once more.
                    drain(q, args, display, results, failures, reported)
                    if key not in reported:
                        who = "producer" if key == "producer" else f"trainer {key}"
                        failures[key] = f"process exited with status {p.exitcode}"
                        display.log(f"{who}: died ({failures[key]})")
                        reported.add(key)
            if failures.keys() - {"producer"} and producer_progress is None and deadline is None:
                # A trainer failed before the first batch: the producer would
                # wait for it in vain.
                display.log("a trainer failed before the sweep started: stopping")
                stop_all(procs)
            if "producer" in failures and deadline is None:
                deadline = time.monotonic() + 60  # trainers see ProducerGone within ~50 ms
            if deadline is not None and time.monotonic() > deadline:
                for key, p in procs.items():
                    if p.is_alive():
                        failures.setdefault(key, "still running long after the producer died; terminated")
                        p.terminate()
            if all(p.exitcode is not None for p in procs.values()):
                break
        drain(q, args, display, results, failures, reported)
        for p in procs.values():
            p.join()
    except KeyboardInterrupt:
        _ignore_stops()
        display.close()
        print("\ninterrupted: stopping the producer and the trainers ...", flush=True)
        stop_all(procs)
        cleanup_channel(args.name)
        print("stopped.", flush=True)
        return 130
    finally:
        display.close()
    wall = time.monotonic() - t_sweep
    cleanup_channel(args.name)
    total_wall = time.monotonic() - t_start
    print_report(args, results, failures, producer_result, baseline, wall, total_wall)
    if args.json:
        report = {
            "trainers": [
                {**CONFIGS[i], **results[i]} if i in results else {**CONFIGS[i], "failed": failures.get(i)}
                for i in range(k)
            ],
            "producer": producer_result,
            "separate_loader_epoch_cpu": baseline,
            "separate_loaders_cpu": None if baseline is None else k * args.epochs * baseline,
            "failures": {str(key): why for key, why in failures.items()},
            "sweep_s": wall,
            "total_s": total_wall,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if not failures and len(results) == k else 1


class Inbox:
    """The children's queues, read as one: get() returns the first message
    waiting in any of them, or raises queue.Empty after `timeout`."""

    def __init__(self, queues: dict):
        self.queues = queues

    def get(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            for q in self.queues.values():
                try:
                    return q.get_nowait()
                except queue.Empty:
                    pass
            if time.monotonic() >= deadline:
                raise queue.Empty
            time.sleep(0.005)


def drain(q, args, display, results, failures, reported) -> None:
    while True:
        try:
            msg = q.get(timeout=0.05)
        except queue.Empty:
            return
        handle(msg, args, display, results, failures)
        if msg[0] in ("done", "failed", "stopped", "producer_done"):
            reported.add(msg[1] if msg[0] != "producer_done" else "producer")


def handle(msg, args, display, results, failures):
    """Applies one message from a child; returns the producer's result when it is one."""
    kind = msg[0]
    if kind == "producer":
        s = msg[1]
        display.set(
            0,
            s["samples"],
            f"epoch {s['epoch'] + 1}/{args.epochs} {s['phase']}, {s['rate']:.0f} img/s, "
            f"{s['readers']} readers, waited {s['waited']:.1f} s",
        )
    elif kind == "progress":
        i, s = msg[1], msg[2]
        done = s["epoch"] * args.train_size + (s["samples"] if s["phase"] == "train" else args.train_size)
        rate = f", {s['rate']:.0f} img/s" if "rate" in s else ""
        acc = display.acc.get(i)
        acc = f", val acc {100 * acc:.1f}%" if acc is not None else ""
        display.set(i + 1, done, f"epoch {s['epoch'] + 1}/{args.epochs} {s['phase']}{rate}{acc}")
    elif kind == "epoch":
        i, s = msg[1], msg[2]
        hp = CONFIGS[i]
        text = (
            f"trainer {i}  lr {hp['lr']:<5g} width {hp['width']:<2} | epoch {s['epoch'] + 1}/{args.epochs} done | "
            f"loss {s['loss']:.3f} | val acc {100 * s['acc']:5.1f}% | {s['rate']:4.0f} img/s"
        )
        display.acc[i] = s["acc"]
        display.log(text)
        display.set(i + 1, (s["epoch"] + 1) * args.train_size, f"val acc {100 * s['acc']:.1f}%")
    elif kind == "done":
        results[msg[1]] = msg[2]
    elif kind == "failed":
        failures[msg[1]] = msg[2]
        who = "producer" if msg[1] == "producer" else f"trainer {msg[1]}"
        display.log(f"{who}: failed: {msg[2]}")
    elif kind == "stopped":
        failures.setdefault(msg[1], "stopped")
    elif kind == "producer_done":
        display.set(
            0,
            args.epochs * (args.train_size + args.val_size),
            f"done: {msg[1]['published']} batches published in {msg[1]['wall']:.1f} s",
        )
        return msg[1]
    return None


def stop_all(procs: dict) -> None:
    """Asks every child to stop (SIGTERM; they already got Ctrl-C if it came
    from the terminal), waits a little, then kills what is left."""
    for p in procs.values():
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGTERM)
            except (ProcessLookupError, TypeError):
                pass
    deadline = time.monotonic() + 10
    for p in procs.values():
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join()


def cleanup_channel(name: str) -> None:
    """A producer that was killed leaves its segment behind; this sweep's
    channel name is its own, and every process using it has exited."""
    try:
        os.unlink(f"/dev/shm/tsock.{name}")
    except FileNotFoundError:
        pass


def print_report(args, results, failures, prod, baseline, wall, total_wall) -> None:
    k = args.trainers
    print()
    head = f"{'trainer':<8} {'lr':>6} {'width':>5} {'params':>7} {'val acc':>8} {'best':>6} {'img/s':>6} "
    head += f"{'data wait':>9} {'CPU s':>6}"
    print(head)
    print("-" * len(head))
    for i in range(k):
        hp = CONFIGS[i]
        r = results.get(i)
        if r is None:
            print(f"{i:<8} {hp['lr']:>6g} {hp['width']:>5}   FAILED: {failures.get(i, 'no result')}")
            continue
        print(
            f"{i:<8} {hp['lr']:>6g} {hp['width']:>5} {r['params']:>7} {100 * r['acc']:>7.1f}% {100 * r['best']:>5.1f}% "
            f"{r['rate']:>6.0f} {100 * r['wait']:>8.0f}% {r['cpu']:>6.1f}"
        )
    if results:
        best = max(results, key=lambda i: results[i]["acc"])
        print(
            f"best: trainer {best} (lr {CONFIGS[best]['lr']:g}, width {CONFIGS[best]['width']}), "
            f"{100 * results[best]['acc']:.1f}% on {args.val_size} held-out images (chance: 10%)"
        )
    print()
    print(f"input pipeline CPU (JPEG decode, random resized crop, flip, normalise; {args.workers} DataLoader workers):")
    if prod is None:
        print(f"  producer: no result ({failures.get('producer', 'did not finish')})")
    else:
        print(
            f"  shared tsock producer:  {prod['cpu']:7.1f} s  (measured: producer process {prod['cpu_self']:.1f} s + "
            f"its workers {prod['cpu_workers']:.1f} s, "
            f"{args.epochs} epochs, {prod['published']} batches published, "
            f"waited on trainers {prod['backpressure_s']:.1f} s)"
        )
        if baseline is not None:
            separate = k * args.epochs * baseline
            saved = separate - prod["cpu"]
            print(
                f"  {k} separate loaders:     {separate:7.1f} s  ({k} trainers x {args.epochs} epochs x "
                f"{baseline:.2f} s, one loader epoch measured before the sweep)"
            )
            print(f"  CPU time saved:         {saved:7.1f} s  ({100 * saved / separate:.0f}% of the input pipeline)")
            if results:
                train_cpu = sum(r["cpu"] for r in results.values())
                print(
                    f"  whole sweep:            {train_cpu + prod['cpu']:7.1f} s CPU with tsock vs "
                    f"{train_cpu + separate:.1f} s with a loader per trainer "
                    f"(trainers: {train_cpu:.1f} s incl. reading batches)"
                )
    print(
        f"\nsweep: {wall:.1f} s; total with dataset and measurement: {total_wall:.1f} s; "
        f"{len(results)}/{k} trainers completed"
    )
    if "producer" in failures:
        print(f"producer: {failures['producer']}")


def main(argv=None) -> int:
    install_stop_handlers()  # SIGTERM too: stop the children, as for Ctrl-C
    if _early_stops:
        print("interrupted.", flush=True)
        return 130
    args = parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\ninterrupted.", flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
