"""Belady's ranking in the store (CacheStore._rank, `distances`,
`_farthest`) makes the decisions of a plain reference: each consumer's
next use by the formula of `next_use`, one consumer at a time, a full
sort of the cached samples by (farthest, least recent, place), and the
plan walked as the store's `_victims` walks it. On random runs of a store
with several consumers (their own orders and shared ones, shuffled or
not, sequences that leave samples out), epoch boundaries, samples of 1 to
3 blocks, and the sampled ranking of a large cache (its kept
candidates), every miss's decision (the victims, or a bypass) and the
kept candidates are the reference's. Also: the number of Python-level
calls of one ranking (a count, not a time: the same on a loaded machine)."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
from tsock import _cache_segment, _cache_store, _sampler
from tsock._cache_orders import inverse_of
from tsock._cache_policy import INF, _farthest, distances, next_use
from tsock._cache_store import CacheStore


def reference_plan(futures, cached, blocks, last, index, room, large, pool_size, spare):
    """The pre-change ranking, written plainly: (candidates, their
    distances, the new sample's, the kept candidates or None)."""
    m = len(cached)
    dist = np.full(m, INF)
    for pos, inv, length, nxt in futures:
        np.minimum(dist, next_use(cached, pos, inv, length, nxt), out=dist)
    d_new = min([INF] + [float(next_use(np.array([index]), *f)[0]) for f in futures])
    full = sorted(range(m), key=lambda i: (-dist[i], last[i], i))
    kept = [int(cached[i]) for i in full[:pool_size]] if large else None
    total, order = 0, None
    for j, i in enumerate(full):
        total += int(blocks[i])
        if total >= room:
            order = full[: j + 1 + spare]
            break
    if order is None:
        order = sorted(range(m), key=lambda i: -dist[i])  # stable: by place among equals
    return [int(cached[i]) for i in order], [float(dist[i]) for i in order], d_new, kept


def walk(candidates, dist, d_new, free: int, need: int, blocks_of: dict):
    """What `_victims` decides from a plan when every candidate is still
    cached (one process): the victims, None (bypass), or "short"."""
    victims = []
    for v, d in zip(candidates, dist):
        if free >= need:
            break
        if d <= d_new:
            return None
        victims.append(v)
        free += blocks_of[v]
    return victims if free >= need else "short"


def params(n: int, seed: int, **kw) -> dict:
    p = dict(n=n, seed=seed, shuffle=True, batch_size=7, drop_last=False, world_size=0, ranks=[0])
    p["sampler_drop_last"] = False
    p.update(kw)
    return p


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("large", [False, True], ids=["whole", "sampled"])
def test_the_stores_ranking_decides_as_the_reference(shm, monkeypatch, seed, large):
    rng = random.Random(seed)
    n = rng.choice((40, 61, 90))
    if large:  # a large cache: RANKED drawn at random, POOL kept, FRESH more between
        monkeypatch.setattr(_cache_store, "POOL_ALL", 8)
        monkeypatch.setattr(_cache_store, "RANKED", 24)
        monkeypatch.setattr(_cache_store, "POOL", 6)
        monkeypatch.setattr(_cache_store, "FRESH", 5)
        monkeypatch.setattr(_cache_store, "REFRESH", 4)
    assert n % 7
    cached_max = rng.choice((12, 20, 30))
    s = CacheStore(b"r" * 16, n, budget=_cache_segment.geometry(n, 4096, cached_max)["file_bytes"], directory=shm)
    size_of = {i: rng.choice((4000, 4000, 8000, 12000)) for i in range(n)}
    s.put(0, bytes(size_of[0]))
    # n % 7 != 0: a drop_last order leaves samples out of each epoch (INF
    # distances), so even one consumer of it gives evictions something to
    # gain and the store ranks (one order of every sample does not:
    # test_one_order_of_every_sample_keeps_what_is_cached_without_ranking).
    orders = [
        params(n, 2, drop_last=True),
        params(n, 1),
        params(n, 3, shuffle=False),
        params(n, 2, drop_last=True),  # another consumer of the first order (a pipeline's second worker)
    ]
    k = rng.choice((1, 2, 3, 4))
    consumers = [(s.register(orders[c]), orders[c]) for c in range(k)]
    seen = {"evict": 0, "bypass": 0, "quick bypass": 0}
    real_rank = CacheStore._rank

    def checked_rank(self, futures, cached, blocks, last, index, room, large_, pooled):
        free = self._seg.free_count()
        need = free + room  # room: need - free, at least 1
        want = reference_plan(futures, cached, blocks, last, index, room, large_, _cache_store.POOL,
                              _cache_store.SPARE)  # fmt: skip
        got = real_rank(self, futures, cached, blocks, last, index, room, large_, pooled)
        blocks_of = dict(zip(cached.tolist(), blocks.tolist()))
        decided = walk(got[0].tolist(), got[1].tolist(), got[2], free, need, blocks_of)
        assert decided == walk(*want[:3], free, need, blocks_of), (index, got, want)
        assert got[2] == want[2]
        kept = None if self._pool is None else self._pool[0].tolist()
        assert kept == want[3]
        if decided is None:
            seen["bypass"] += 1
            seen["quick bypass"] += len(got[0]) == 1 and len(cached) > 1
        elif decided != "short":
            seen["evict"] += 1
        return got

    monkeypatch.setattr(CacheStore, "_rank", checked_rank)
    for epoch in range(4):
        seqs = [_sampler.sample_sequence(p, epoch).tolist() for _, p in consumers]
        starts = [rng.randrange(0, 5) for _ in consumers]  # consumers a little apart
        for step in range(max(len(q) for q in seqs) + 5):
            for (slot, _), seq, start in zip(consumers, seqs, starts):
                at = step - start
                if not 0 <= at < len(seq):
                    continue
                i = seq[at]
                s.at(slot, epoch, i)
                if s.get(i) is None:
                    s.put(i, bytes(size_of[i]))
    s.close()
    assert seen["evict"] > 10 and seen["quick bypass"] > 0, seen


def test_distances_are_the_minimum_of_next_use():
    rng = np.random.default_rng(3)
    for _ in range(500):
        n = int(rng.integers(1, 50))
        futures = []
        for _ in range(int(rng.integers(0, 5))):
            inv, length = inverse_of(rng.integers(0, n, int(rng.integers(1, n + 4))), n)  # repeats, absences
            nxt, _ = inverse_of(rng.integers(0, n, int(rng.integers(0, n + 4))), n)
            futures.append((int(rng.integers(0, length)), inv, length, nxt))
        idx = rng.integers(0, n, int(rng.integers(0, 30)))
        want = np.full(len(idx), INF)
        for f in futures:
            np.minimum(want, next_use(idx, *f), out=want)
        got = distances(idx, futures)
        assert got.dtype == np.float64 and got.tolist() == want.tolist()


def test_farthest_is_a_prefix_of_the_full_order():
    """Whether it sorts all entries, selects the farthest first (beyond
    SORT_WHOLE) or is given the order: the prefix of the full sort by
    (farthest, least recent, place) that makes room, plus `extra`."""
    rng = np.random.default_rng(4)
    for _ in range(400):
        m = int(rng.choice((0, 1, 5, 100, 300, 700)))
        dist = rng.integers(1, 6, m).astype(float)  # many ties
        dist[rng.random(m) < 0.2] = INF
        last = rng.integers(0, 4, m).astype(float)
        sizes = rng.integers(0, 3, m)  # a damaged entry may count 0 blocks
        room, extra = int(rng.integers(1, 12)), int(rng.choice((0, 16)))
        full = sorted(range(m), key=lambda i: (-dist[i], last[i], i))
        cum = np.cumsum(sizes[full]) if m else np.zeros(0)
        reach = int(np.searchsorted(cum, room)) + 1
        want = full[: reach + extra] if reach <= m else None
        for order in (None, np.lexsort((last, -dist))):
            got = _farthest(dist, last, sizes, room, extra, order=order)
            assert (None if got is None else got.tolist()) == want


def test_one_ranking_makes_few_python_calls(shm):
    """The calls (Python and C functions, as sys.setprofile sees them) of
    one _plan with 256 samples cached: about 260 with 1 consumer and 440
    with 4 here, 500 and 710 before the consumer table was read in one
    look and the distances of every consumer computed at once."""

    def calls(k: int) -> int:
        n = 512
        s = CacheStore(bytes([k]) * 16, n, budget=_cache_segment.geometry(n, 4096, 256)["file_bytes"], directory=shm)
        for i in range(256):
            s.put(i, bytes(4000))
        for c in range(k):
            # drop_last leaves 2 samples out of each epoch: one order ranks too
            order = params(n, c, batch_size=30, drop_last=True)
            s.at(s.register(order), 1, int(_sampler.sample_sequence(order, 1)[100]))
        assert s._plan(s._seg, 400, 1, True) is not _cache_store._KEEP_ALL  # it ranks (and computes the orders)
        count = [0]

        def profile(frame, event, arg):
            count[0] += 1

        sys.setprofile(profile)
        try:
            s._plan(s._seg, 400, 1, True)
        finally:
            sys.setprofile(None)
        s.close()
        return count[0]

    one, four = calls(1), calls(4)
    assert one < 380 and four < 620, (one, four)


def replay(s, runs, epochs: int, size_of=lambda i: 4000) -> list:
    """Each (slot, order, lag) of `runs` reads its order's epochs, one
    sample per step, `lag` steps behind the first; a miss is inserted.
    The trace of accesses."""
    trace = []
    seqs = {id(o): [_sampler.sample_sequence(o, e).tolist() for e in range(epochs)] for _, o, _ in runs}
    flat = {key: [(e, i) for e, seq in enumerate(q) for i in seq] for key, q in seqs.items()}
    steps = max(len(flat[id(o)]) + lag for _, o, lag in runs)
    for step in range(steps):
        for slot, order, lag in runs:
            at = step - lag
            if not 0 <= at < len(flat[id(order)]):
                continue
            epoch, i = flat[id(order)][at]
            s.at(slot, epoch, i)
            trace.append(i)
            if s.get(i) is None:
                s.put(i, bytes(size_of(i)))
    return trace


@pytest.fixture
def ranked(monkeypatch):
    """The rankings CacheStore._rank made."""
    made = []
    real_rank = CacheStore._rank
    monkeypatch.setattr(CacheStore, "_rank", lambda self, *a: made.append(a) or real_rank(self, *a))
    return made


@pytest.mark.parametrize("workers", [1, 3])
def test_one_pipeline_of_every_sample_keeps_what_is_cached_without_ranking(shm, ranked, workers):
    """One pipeline's order (every sample once an epoch), its consumer
    entries one or several (its workers, taking samples in turn, under
    one pipeline token): a full cache keeps what it holds, nothing is
    ranked and nothing evicted, and it hits as often as Belady's offline
    MIN on the same trace (the most any policy can)."""
    from tsock._cache_policy import Belady, simulate

    n, cached_max = 61, 20
    s = CacheStore(b"w" * 16, n, budget=_cache_segment.geometry(n, 4096, cached_max)["file_bytes"], directory=shm)
    s.put(0, bytes(4000))
    order = params(n, 5, pipeline="p1")
    slots = [s.register(order) for _ in range(workers)]
    trace = [0]
    for epoch in range(4):
        seq = _sampler.sample_sequence(order, epoch).tolist()
        for at in range(0, len(seq), workers):
            for slot, i in zip(slots, seq[at : at + workers]):
                s.at(slot, epoch, i)
                trace.append(i)
                if s.get(i) is None:
                    s.put(i, bytes(4000))
    want = simulate(trace, dict.fromkeys(range(n), 1), cached_max, Belady())
    assert (ranked, s.counts["evictions"]) == ([], 0)
    # Epoch 0 hits only sample 0 (cached before it), each later epoch every sample cached: the most possible.
    assert s.counts["hits"] == want.hits == 1 + 3 * cached_max
    s.close()


N_GAIN = 61


def gain_params(**kw) -> dict:
    return params(N_GAIN, 5, **{"pipeline": "p1", **kw})


@pytest.mark.parametrize(
    "case",
    ["another order", "the same order, another pipeline", "entries without a pipeline", "drop_last",
     "sizes differ", "an entry it cannot read", "a full table"],
)  # fmt: skip
def test_where_evictions_gain_the_store_ranks(shm, ranked, case):
    """Where keeping what is cached would lose hits, Belady ranks and
    evicts as before: another order beside the pipeline's, a second
    pipeline of the same order a few samples behind (it hits what the
    first inserts), entries that do not say which pipeline they are of,
    an order that leaves samples out, samples of different sizes, an
    entry this process cannot read, a table too full to show everyone."""
    n, blocks = N_GAIN, 40 if case == "sizes differ" else 20
    s = CacheStore(b"g" * 16, n, budget=_cache_segment.geometry(n, 4096, blocks)["file_bytes"], directory=shm)
    s.put(0, bytes(4000))
    size_of = lambda i: 4000  # noqa: E731
    order = params(n, 5) if case == "entries without a pipeline" else gain_params(drop_last=case == "drop_last")
    runs = [(s.register(order), order, 0)]  # drop_last: 61 % 7, 5 samples left out of each epoch
    if case == "another order":
        other = params(n, 6, pipeline="p2")
        runs.append((s.register(other), other, 3))
    elif case == "the same order, another pipeline":
        other = gain_params(pipeline="p2")
        runs.append((s.register(other), other, 5))
    elif case == "entries without a pipeline":
        runs.append((s.register(order), order, 5))
    elif case == "sizes differ":
        size_of = lambda i: 4000 if i % 3 else 12000  # noqa: E731 - 1 block or 3
    elif case == "an entry it cannot read":
        s.register(params(n + 1, 5))  # another dataset's length: refused
    elif case == "a full table":  # every slot taken (by entries of the same pipeline): one not registered is unseen
        for _ in range(_cache_segment.CONSUMER_SLOTS - 1):
            assert s.register(order) is not None
        assert s.register(order) is None
    replay(s, runs, 3, size_of)
    assert ranked and s.counts["evictions"] > 0, s.counts
    s.close()


def test_a_second_pipeline_makes_the_store_rank_again(shm, ranked):
    n, cached_max = N_GAIN, 20
    s = CacheStore(b"a" * 16, n, budget=_cache_segment.geometry(n, 4096, cached_max)["file_bytes"], directory=shm)
    s.put(0, bytes(4000))
    order = gain_params()
    replay(s, [(s.register(order), order, 0)], 2)
    assert (ranked, s.counts["evictions"]) == ([], 0)
    other = gain_params(pipeline="p2")
    replay(s, [(s.register(other), other, 0)], 1)
    assert ranked and s.counts["evictions"] > 0, s.counts
    s.close()
