"""What Belady's decision costs per miss once the cache is full, this tree
against another revision's (docs/CACHE.md, "Costs").

One process (a CacheStore in a directory of /dev/shm) replays K consumers
of their own shuffled orders (K = 1: one order; drop_last, so that it
ranks), one sample of each in
turn, for E epochs of n samples with room for C of them (one 4 KiB block
a sample): at each access the consumer's position is published (`at`),
the sample looked up, and on a miss inserted (`put`). Measured per miss
with the cache full: the `put` call (ranking, the exclusive section,
eviction, insert) and, inside it, `_plan` (the consumer table and the
cached entries read under the shared lock, and the ranking).

Each (revision, K) runs in a fresh child process with that revision's
python/tsock on its path (extracted with `git archive`; the C library is
this tree's build), the two revisions alternating, ROUNDS times each (a
large cache's random draws seeded alike): the figures are the medians
over the rounds' medians, and the ratio is the old over the new. The
decisions of both (which misses inserted, which samples each evicted)
must be the same: the script fails if they differ.

    python bench/belady_cost.py [--rev REV] [--n 512] [--cached 256] [--epochs 5] [--k 1,4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(a) -> None:
    """One replay with the tsock on sys.path: one JSON line on stdout."""
    import numpy as np
    from tsock import _cache_segment, _sampler
    from tsock._cache_store import CacheStore

    plans: list = []
    real_plan = CacheStore._plan

    def timed_plan(self, *args, **kw):
        t0 = time.perf_counter()
        try:
            return real_plan(self, *args, **kw)
        finally:
            plans.append(time.perf_counter() - t0)

    CacheStore._plan = timed_plan
    n, k = a.n, a.k_one
    assert n % 30, "--n must leave a short last batch of 30 (drop_last): one whole order would not rank"
    folder = tempfile.mkdtemp(prefix="tsock-belady-cost-", dir="/dev/shm")
    try:
        budget = _cache_segment.geometry(n, 4096, a.cached)["file_bytes"]
        s = CacheStore(bytes([k]) * 16, n, budget=budget, directory=folder)
        s._rng = np.random.default_rng(0)  # which samples a large cache ranks: the same draws in both revisions
        s.put(0, bytes(4000))
        # drop_last with n % 30 != 0 leaves samples out of each epoch: one
        # consumer's misses are ranked too (one order of every sample keeps
        # what is cached without ranking, since no eviction could gain).
        p = dict(n=n, shuffle=True, batch_size=30, drop_last=True, world_size=0, ranks=[0], sampler_drop_last=False)
        slots = [s.register(dict(p, seed=c)) for c in range(k)]
        puts, plan_times, decisions = [], [], hashlib.sha256()
        for e in range(a.epochs):
            orders = [_sampler.sample_sequence(dict(p, seed=c), e).tolist() for c in range(k)]
            for i in range(len(orders[0])):
                for c in range(k):
                    index = orders[c][i]
                    s.at(slots[c], e, index)
                    if s.get(index) is not None:
                        continue
                    full = int(s._seg.mut[_cache_segment.FREE_COUNT]) == 0
                    before = dict(s.counts)
                    del plans[:]
                    t0 = time.perf_counter()
                    s.put(index, bytes(4000))
                    took = time.perf_counter() - t0
                    if full:
                        puts.append(took)
                        plan_times.append(sum(plans))
                    change = {key: s.counts[key] - before[key] for key in ("inserts", "evictions", "bypasses")}
                    cached = np.flatnonzero(s._seg.state == _cache_segment.FULL).tolist()
                    decisions.update(json.dumps([index, change, cached]).encode())
        s.close()
        counts = {key: s.counts[key] for key in ("hits", "misses", "inserts", "evictions", "bypasses")}
        print(json.dumps(dict(put=float(np.median(puts)), plan=float(np.median(plan_times)), misses=len(puts),
                              counts=counts, decisions=decisions.hexdigest())))  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_child(a, tree: Path, k: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.setdefault("TSOCK_LIBRARY_DIR", str(ROOT / "build"))
    args = [sys.executable, __file__, "--child", "--k-one", str(k), "--n", str(a.n), "--cached", str(a.cached),
            "--epochs", str(a.epochs)]  # fmt: skip
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"child failed ({tree}, K={k}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="b7f7ff3", help="the revision to compare with (default: before the change)")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--cached", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--k", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--k-one", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    import numpy as np
    from revision import python_tree

    with python_tree(a.rev) as old:
        trees = {a.rev: old, "this tree": ROOT / "python"}
        print(
            f"n = {a.n}, {a.cached} cached, {a.epochs} epochs, K consumers of their own orders; per miss with"
            f" the cache full, medians of {a.rounds} rounds (each a fresh process, the revisions alternating)"
        )
        for k in (int(x) for x in a.k.split(",")):
            got: dict = {name: [] for name in trees}
            for _ in range(a.rounds):
                for name, tree in trees.items():
                    got[name].append(run_child(a, tree, k))
            digests = {r["decisions"] for runs in got.values() for r in runs}
            if len(digests) != 1:
                raise SystemExit(f"K={k}: the decisions differ between the revisions (or between rounds): {got}")
            counts = got["this tree"][0]["counts"]
            print(f"K = {k}: {got['this tree'][0]['misses']} misses with the cache full, {counts}; same decisions")
            fig = {name: {m: float(np.median([r[m] for r in runs])) * 1e3 for m in ("put", "plan")}
                   for name, runs in got.items()}  # fmt: skip
            for m, what in (("put", "put call"), ("plan", "_plan (read + rank)")):
                before, after = fig[a.rev][m], fig["this tree"][m]
                print(f"  {what:20} {a.rev}: {before:.3f} ms  this tree: {after:.3f} ms  ratio {before / after:.2f}x")


if __name__ == "__main__":
    main()
