"""One worker of an Optuna study: runs trials until the study has none left,
each training a small CNN on the shapes dataset (data.py) with the
learning rate and width Optuna gives it, and reports its validation
accuracy.

The input pipeline is the only place tsock appears: with --loader tsock
every trial of every worker on the node that asks for the same pipeline
shares one producer process (tsock.shared: the first caller starts it, the
others attach, it exits once no trial is left, and if it dies a trial
starts a successor that resumes exactly where it stopped); with --loader
plain each trial runs its own DataLoader, as without tsock.

    python examples/optuna/train.py --storage sqlite:///study.db --study NAME --loader tsock

study.py starts several of these at once and compares the two loaders.
"""

# ruff: noqa: E402  (STARTED is taken before the imports)
from __future__ import annotations

import time

STARTED = time.time()  # the worker process's start, before its imports

import argparse
import os
import warnings

import data
import optuna
import torch
import torch.nn as nn
import torch.nn.functional as F
import tsock
from optuna.distributions import FloatDistribution, IntDistribution


def make_model(width: int) -> nn.Module:
    layers, c = [], 3
    for i, k in enumerate((width, 2 * width, 4 * width)):
        layers += [nn.Conv2d(c, k, 3, padding=1, bias=False), nn.BatchNorm2d(k), nn.ReLU(inplace=True)]
        if i < 2:
            layers.append(nn.MaxPool2d(2))
        c = k
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


def train_loader(args):
    pipeline = (args.data_dir, args.train_size)
    options = {"batch_size": args.batch_size, "seed": args.seed, "workers": args.pipeline_workers}
    if args.loader == "tsock":
        return tsock.shared(data.make_pipeline, *pipeline, **options, output="torch")
    return data.make_loader(*pipeline, **options)


def objective(trial: optuna.Trial, args, val) -> float:
    lr = trial.suggest_float("lr", 0.001, 1.0, log=True)
    width = trial.suggest_int("width", 4, 64)
    torch.manual_seed(trial.number)
    model = make_model(width)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    begun = time.monotonic()
    loader = train_loader(args)
    samples, busy, longest_wait, first = 0, 0.0, 0.0, None
    try:
        for _ in range(args.epochs):
            model.train()
            t = time.monotonic()
            for x, y in loader:
                now = time.monotonic()
                if first is None:
                    first = now - begun  # start-up: the loader's workers (or the producer) and the first batch
                else:
                    longest_wait = max(longest_wait, now - t)  # the time to get this batch
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()
                samples += len(y)
                t = time.monotonic()
                busy += t - now
    finally:
        if hasattr(loader, "close"):
            loader.close()
    model.eval()
    with torch.no_grad():
        acc = float((model(val[0]).argmax(1) == val[1]).float().mean())
    trial.set_user_attr("samples", samples)
    trial.set_user_attr("train_s", busy)
    trial.set_user_attr("longest_wait_s", longest_wait)
    trial.set_user_attr("first_batch_s", first)
    trial.set_user_attr("worker", os.getpid())
    trial.set_user_attr("worker_started", STARTED)
    return acc


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--storage", required=True, help="Optuna storage URL (sqlite:///FILE)")
    ap.add_argument("--study", required=True, help="study name (study.py creates it)")
    ap.add_argument("--loader", choices=("tsock", "plain"), default="tsock")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--train-size", type=int, default=1500)
    ap.add_argument("--val-size", type=int, default=500)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--pipeline-workers", type=int, default=2, help="worker processes of the input pipeline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", required=True, help="the trials this worker runs: LR:WIDTH,LR:WIDTH,...")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # several workers share the node's cores
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    val = data.validation(args.data_dir, args.val_size)
    study = optuna.load_study(study_name=args.study, storage=args.storage)
    # The driver (study.py) gives each worker its own grid points: a trial
    # asked with its point fixed. (Optuna's queue of enqueued trials is not
    # safe for concurrent workers on SQLite, which has no row locks: two
    # workers could take one trial, and the second failed with "Cannot tell
    # a COMPLETE trial".) objective()'s suggest_*() then return the point;
    # Optuna warns that their ranges differ from the fixed ones.
    warnings.filterwarnings("ignore", message="Inconsistent parameter values")
    for point in args.grid.split(","):
        lr, width = float(point.split(":")[0]), int(point.split(":")[1])
        fixed = {"lr": FloatDistribution(lr, lr, log=True), "width": IntDistribution(width, width)}
        trial = study.ask(fixed)
        try:
            study.tell(trial, objective(trial, args, val))
        except BaseException:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise


if __name__ == "__main__":
    main()
