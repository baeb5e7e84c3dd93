"""Review 33, L1: what a process keeps after its cached pipelines are closed
and dropped: descriptors, threads, /dev/shm files, and the order memo."""
import gc, os, threading, numpy as np, tsock
from tsock._cache_orders import ORDERS

N = 200_000

class DS:
    def __len__(self): return N
    def __getitem__(self, i): return np.full(64, i, dtype=np.int64)

def fds(): return len(os.listdir("/proc/self/fd"))
def shm(): return sorted(f for f in os.listdir("/dev/shm") if f.startswith("tsock-cache"))

before = (fds(), threading.active_count(), shm())
for k in range(5):
    p = tsock.Pipeline(DS(), batch_size=256, seed=k, cache_bytes=16 << 20, version=str(k))
    it = iter(p)
    for _ in range(40):
        next(it)
    del it
    p.close(); del p
gc.collect()
after = (fds(), threading.active_count(), shm())
memo = ORDERS.cached()
print("fds before/after:", before[0], after[0], " threads:", before[1], after[1], " new shm files:", set(after[2]) - set(before[2]))
print("order memo entries still held after every pipeline is closed and collected:", len(memo),
      "=", sum(ORDERS._memo[k][0].nbytes for k in memo) >> 20, "MiB")
