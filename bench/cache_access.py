"""What the decoded-sample cache costs per access, this tree against
another revision's, against what a decode costs (docs/CACHE.md, "Costs").

One process replays a pipeline's accesses through `SampleCache`, the
pipeline's own entry to the cache: for E epochs of the shared pipeline's
order over n samples (one consumer, `_sampler.sample_sequence`), batch by
batch of 32 as the Pipeline's Stages do, the lookups of a batch (at once,
`lookup_many`, where the revision has it) and, on each miss, an insert of
a decoded 160x160 RGB image (uint8, what bench/cache_sweep.py's JPEGs
decode to), with room for a fraction of them, then the batch's end
(`batch_done`, where the revision has it). Measured with the thread's CPU
clock: the lookups per access, an insert (kept or declined by the policy),
and all of it per access; beside them the CPU of decoding one of
cache_sweep's JPEGs with PIL, which a hit saves.

Each (revision, policy) runs in a fresh child process with that revision's
python/tsock on its path (the C library is not used by the cache), the two
revisions alternating, ROUNDS times: figures are medians over the rounds,
and the ratio is the old over the new. Both revisions must make the same
decisions (hits, inserts, evictions, bypasses): the script fails if not;
with --same-hits only the hits must be equal (a change of what is inserted
and evicted that claims the same hits).

    python bench/cache_access.py [--rev REV] [--n 512] [--fraction 0.5] [--epochs 5] [--rounds 3] [--same-hits]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("belady", "lru", "fill-once")
SIDE = 160
BATCH = 32


def child(a) -> None:
    """One replay with the tsock on sys.path: one JSON line on stdout."""
    import numpy as np
    from tsock import _cache_codec, _cache_segment, _sampler
    from tsock._cache import MISS, SampleCache

    x = np.random.default_rng(0).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    params = dict(n=a.n, seed=1, shuffle=True, batch_size=32, drop_last=False, world_size=0, ranks=[0],
                  sampler_drop_last=False)  # fmt: skip
    size = len(_cache_codec.encode(x))
    budget = _cache_segment.budget_for(a.n, size, int(a.n * a.fraction))
    folder = tempfile.mkdtemp(prefix="tsock-cache-access-", dir="/dev/shm")
    try:
        cache = SampleCache(b"a" * 16, params, budget, a.policy, folder)
        took = {"lookup": [], "insert": [], "batch": []}
        batched = hasattr(cache, "lookup_many")  # a batch's lookups at once, as the Pipeline's Stages do
        for e in range(a.epochs):
            order = _sampler.sample_sequence(params, e).tolist()
            for b in range(0, len(order), BATCH):
                indices = order[b : b + BATCH]
                t0 = time.thread_time()
                if batched:
                    got = cache.lookup_many(e, indices)
                else:
                    got = [cache.lookup(e, i) for i in indices]
                took["lookup"].append(time.thread_time() - t0)
                for i, sample in zip(indices, got):
                    if sample is MISS:
                        t1 = time.thread_time()
                        cache.insert(i, x)
                        took["insert"].append(time.thread_time() - t1)
                if batched:
                    t1 = time.thread_time()
                    cache.batch_done()
                    took["batch"].append(time.thread_time() - t1)
        counts = {k: cache.store.counts[k] for k in ("hits", "misses", "inserts", "evictions", "bypasses")}
        cache.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    accesses = a.n * a.epochs
    out = {"lookup": sum(took["lookup"]) / accesses, "insert": sum(took["insert"]) / max(len(took["insert"]), 1)}
    out["access"] = sum(sum(v) for v in took.values()) / accesses
    print(json.dumps(dict(seconds=out, counts=counts)))


def decode_cost(rounds: int = 3) -> float:
    """CPU seconds to read and decode one of cache_sweep's JPEGs (median)."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    import cache_sweep

    folder = Path(tempfile.mkdtemp(prefix="tsock-cache-access-jpeg-"))
    try:
        paths = cache_sweep.make_images(folder, 64, SIDE)
        per = []
        for _ in range(rounds):
            t0 = time.thread_time()
            for p in paths:
                cache_sweep.decode_full(cache_sweep.read_file(p))
            per.append((time.thread_time() - t0) / len(paths))
        return float(np.median(per))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_child(a, tree: Path, policy: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    args = [sys.executable, __file__, "--child", "--policy", policy, "--n", str(a.n), "--fraction",
            str(a.fraction), "--epochs", str(a.epochs)]  # fmt: skip
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"child failed ({tree}, {policy}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="fe79fc2", help="the revision to compare with (default: before the change)")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--fraction", type=float, default=0.5, help="the share of the samples the cache holds")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--same-hits",
        action="store_true",
        help="require only the same hits of both revisions, not the same inserts and evictions",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policy", default="belady", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    import numpy as np
    from revision import python_tree

    decode_us = decode_cost() * 1e6
    print(
        f"n = {a.n}, {a.fraction:.0%} cached, {a.epochs} epochs of the shared pipeline's order; CPU us per call"
        f" (thread clock), medians of {a.rounds} rounds (fresh processes, the revisions alternating)."
        f" Reading and decoding one {SIDE}x{SIDE} JPEG with PIL: {decode_us:.0f} us"
    )
    with python_tree(a.rev) as old:
        trees = {a.rev: old, "this tree": ROOT / "python"}
        for policy in a.policies.split(","):
            got: dict = {name: [] for name in trees}
            for _ in range(a.rounds):
                for name, tree in trees.items():
                    got[name].append(run_child(a, tree, policy))
            same = ("hits",) if a.same_hits else ("hits", "misses", "inserts", "evictions", "bypasses")
            counts = {json.dumps([r["counts"][k] for k in same]) for runs in got.values() for r in runs}
            if len(counts) != 1:
                raise SystemExit(f"{policy}: the {'/'.join(same)} differ between the revisions (or rounds): {counts}")
            for name in trees:
                print(f"{policy}, {name}: {got[name][0]['counts']}")
            print(f"  same {'hits' if a.same_hits else 'decisions'}")
            for m, what in (("lookup", "lookup"), ("insert", "insert"), ("access", "per access, all")):
                before, after = (float(np.median([r["seconds"][m] for r in got[n]])) * 1e6 for n in trees)
                print(f"  {what:16} {a.rev}: {before:7.1f}  this tree: {after:7.1f}  ratio {before / after:.2f}x")


if __name__ == "__main__":
    main()
