"""Review 33, H1: the store's Belady hit rate against the offline optimum on
the same trace when the cache holds more than POOL_ALL (256) samples, where
the store ranks a random sample (RANKED = 4096 once per 32 misses, then its
64 kept farthest plus 64 fresh draws) instead of every cached sample. The
hit-rate table of CACHE.md (and its test) only has caches of 30-300
samples, which are ranked whole. Four consumers of their own orders
(seeds 0..3) in lockstep in one process (one store, four consumer entries),
every sample one block; argv: n, fraction cached, epochs."""
import sys, tempfile, time
import numpy as np
from tsock import _cache_segment, _sampler
from tsock._cache_policy import Belady, simulate
from tsock._cache_store import CacheStore

n = int(sys.argv[1]); frac = float(sys.argv[2]); epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 2
policy = sys.argv[4] if len(sys.argv) > 4 else "belady"
K = 4
cap = int(n * frac)
d = tempfile.mkdtemp(dir="/dev/shm", prefix="r33h-")
s = CacheStore(b"h" * 16, n, budget=_cache_segment.geometry(n, 4096, cap)["file_bytes"], policy=policy, directory=d)
s.put(0, bytes(4000)); s.close()  # make the segment
s = CacheStore(b"h" * 16, n, budget=_cache_segment.geometry(n, 4096, cap)["file_bytes"], policy=policy, directory=d)
s.get(0)
params = [dict(n=n, seed=c, shuffle=True, batch_size=32, drop_last=False, world_size=0, ranks=[0], sampler_drop_last=False) for c in range(K)]
slots = [s.register(p) for p in params]
trace, hits = [], 0
t0 = time.time()
for e in range(epochs):
    orders = [_sampler.sample_sequence(p, e) for p in params]
    for j in range(n):
        for c in range(K):
            i = int(orders[c][j])
            s.at(slots[c], e, i)
            got = s.get(i)
            trace.append(i)
            if got is not None:
                hits += 1
            else:
                s.put(i, bytes(4000))
rate = hits / len(trace)
best = simulate(trace, dict.fromkeys(range(n), 1), cap, Belady()).hit_rate
print(f"n={n} cache={cap} samples ({frac:.0%}) consumers={K} epochs={epochs} policy={policy}: store {rate:.4f}  offline optimum {best:.4f}  gap {best - rate:.4f}  ({time.time() - t0:.0f} s)")
s.close()
import shutil; shutil.rmtree(d)
