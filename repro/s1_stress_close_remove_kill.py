"""Review 33, S1: review 31's r6 stress, with what changed since: Belady
with consumer entries (every worker registers an order and publishes its
position, so the ranking outside the lock runs), every worker closes its
store and calls remove(key) every ~200 operations (removal at last close,
racing with the others' opens and inserts), and a fourth process SIGKILLed
every 10-80 ms. Every hit is checked against the index asked for."""
import os, sys, time, signal, random, multiprocessing as mp
import numpy as np
from tsock._cache_store import CacheStore
from tsock._cache_segment import remove
N = 200
DIR = "/dev/shm"
def sample(i): return np.full(5000 + 37 * i, i % 256, np.uint8).tobytes() + i.to_bytes(4, "little")
def params(seed): return dict(n=N, seed=seed, shuffle=True, batch_size=8, drop_last=False, world_size=0, ranks=[0], sampler_drop_last=False)
def worker(key, policy, secs, q, seed):
    rng = random.Random(seed)
    bad = hits = ops = removed = errors = 0; t0 = time.time()
    from tsock._sampler import sample_sequence
    epoch, j, order = 0, 0, sample_sequence(params(seed), 0)
    s = CacheStore(key, N, budget=400_000, policy=policy); slot = None
    while time.time() - t0 < secs:
        try:
            i = int(order[j]); j += 1
            if j == len(order):
                epoch, j = epoch + 1, 0; order = sample_sequence(params(seed), epoch)
            got = s.get(i)
            if s.opened and slot is None:
                slot = s.register(params(seed))
            if slot is not None:
                s.at(slot, epoch, i)
            if got is None: s.put(i, sample(i))
            else:
                hits += 1
                if bytes(got) != sample(i): bad += 1
            ops += 1
            if rng.random() < 1 / 200:
                s.close(); removed += remove(key); slot = None
                s = CacheStore(key, N, budget=400_000, policy=policy)
        except Exception as e:  # noqa
            errors += 1
            if errors < 3: print("worker", seed, type(e).__name__, e, flush=True)
            s = CacheStore(key, N, budget=400_000, policy=policy); slot = None
    s.close()
    q.put((hits, bad, ops, removed, errors))
def main():
    ctx = mp.get_context("fork")
    for policy in ("belady", "lru"):
        key = os.urandom(16); q = ctx.Queue()
        ps = [ctx.Process(target=worker, args=(key, policy, 15, q, k)) for k in range(3)]
        for p in ps: p.start()
        t0 = time.time(); kills = 0
        while time.time() - t0 < 14:
            k = ctx.Process(target=worker, args=(key, policy, 100, ctx.Queue(), 99 + kills)); k.start()
            time.sleep(random.uniform(0.01, 0.08)); os.kill(k.pid, signal.SIGKILL); k.join(); kills += 1
        res = [q.get(timeout=60) for _ in ps]
        for p in ps: p.join()
        print(policy, "(hits, bad, ops, removals, errors) per worker:", res, "kills:", kills, "exit codes:", [p.exitcode for p in ps])
        remove(key)
if __name__ == "__main__": main()
