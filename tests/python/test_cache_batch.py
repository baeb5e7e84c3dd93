"""The cache a batch at a time: a batch's lookups in one look at the
segment (CacheStore.get_many, SampleCache.lookup_many), and the keep-all
run, in which the misses after a bypass of a full cache that keeps what it
holds bypass without a ranking or a lock, counted in the segment at the
batch's end (CacheStore.put, flush). What it must not change: the hits,
the counts, and every place where keeping may not be right (another
consumer, another size, a forked child)."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest
from tsock import _cache_segment, _sampler
from tsock._cache import MISS, SampleCache
from tsock._cache_store import KEEP_ALL_RUN, CacheStore

N, CACHED = 61, 20


def order_params(seed: int = 5, **kw) -> dict:
    p = dict(n=N, seed=seed, shuffle=True, batch_size=7, drop_last=False, world_size=0, ranks=[0],
             sampler_drop_last=False, pipeline="p1")  # fmt: skip
    p.update(kw)
    return p


@pytest.fixture
def locks(monkeypatch):
    """The store locks taken ("shared" or "exclusive"), in order."""
    taken = []
    real = _cache_segment._lock

    def spy(fd, kind, byte, wait):
        if byte == _cache_segment.STORE_BYTE and kind != fcntl.F_UNLCK:
            taken.append("exclusive" if kind == fcntl.F_WRLCK else "shared")
        return real(fd, kind, byte, wait)

    monkeypatch.setattr(_cache_segment, "_lock", spy)
    return taken


@pytest.fixture
def plans(monkeypatch):
    """The indices CacheStore._plan was asked to plan for."""
    asked = []
    real = CacheStore._plan

    def spy(self, seg, index, *a, **k):
        asked.append(index)
        return real(self, seg, index, *a, **k)

    monkeypatch.setattr(CacheStore, "_plan", spy)
    return asked


def full_store(shm, key: bytes = b"k" * 16) -> tuple:
    """A store of one pipeline whose cache is full (epoch 0 inserted what
    fits): (store, its consumer slot, the order)."""
    s = CacheStore(key, N, budget=_cache_segment.geometry(N, 4096, CACHED)["file_bytes"], directory=shm)
    order = order_params()
    s.put(0, bytes(4000))
    slot = s.register(order)
    for i in _sampler.sample_sequence(order, 0).tolist():
        s.at(slot, 0, i)
        if s.get(i) is None:
            s.put(i, bytes(4000))
    assert s.counts["inserts"] == CACHED
    s.close()  # opened again below: no keep-all run left from the fill
    return s, s.register(order), order


def misses_of(s, order, epoch: int) -> list:
    """The samples of `epoch` not cached now."""
    seg = s._segment()
    return [i for i in _sampler.sample_sequence(order, epoch).tolist() if seg.entry(i)[0] != _cache_segment.FULL]


def test_a_keep_all_run_bypasses_without_a_plan_or_a_lock(shm, locks, plans):
    s, slot, order = full_store(shm)
    s.flush()
    before = s.stats()["segment"]["bypasses"]
    missed = misses_of(s, order, 1)
    assert len(missed) > 2 * CACHED > 0
    locks.clear()
    plans.clear()
    for i in missed:
        assert s.put(i, bytes(4000)) is False
    # One plan and one exclusive lock at the first miss; then the run: neither.
    assert plans == missed[:1] and locks == ["shared", "exclusive"], (plans, locks)
    assert s.counts["bypasses"] - before == len(missed)
    # The run's bypasses are written at the flush (one exclusive lock), exactly.
    assert s._segment().totals()["bypasses"] == before + 1
    s.flush()
    assert locks[-1] == "exclusive" and s._segment().totals()["bypasses"] == before + len(missed)
    locks.clear()
    s.flush()  # nothing left to write: no lock
    assert locks == []
    s.close()


@pytest.mark.parametrize("change", ["another consumer", "another size", "the run's end", "close"])
def test_a_keep_all_run_ends_where_keeping_may_not_hold(shm, plans, change):
    s, slot, order = full_store(shm)
    missed = [i for e in (1, 2, 3) for i in misses_of(s, order, e)]  # a full cache keeps them out
    assert len(missed) > KEEP_ALL_RUN + 2
    s.put(missed[0], bytes(4000))  # the first bypass: the run starts
    plans.clear()
    size = 4000
    if change == "another consumer":
        s.register(order_params(seed=6, pipeline="p2"))  # the table changed: the verdict may not hold
    elif change == "another size":
        size = 9000
    elif change == "the run's end":
        for i in missed[1 : 1 + KEEP_ALL_RUN]:
            s.put(i, bytes(4000))
        assert plans == []
        missed = missed[KEEP_ALL_RUN:]
    else:
        s.close()
        s.register(order)
    s.put(missed[1], bytes(size))
    assert plans == [missed[1]], change
    s.close()


def test_a_forked_child_starts_without_the_parents_run_or_counts(shm):
    s, slot, order = full_store(shm)
    missed = misses_of(s, order, 1)
    for i in missed[:5]:
        s.put(i, bytes(4000))
    s.flush()
    for i in missed[5:8]:
        s.put(i, bytes(4000))  # three bypasses counted here, not yet in the segment
    assert s._bypassed == 3
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's unwritten bypasses are not its own to write
        code = 1
        try:
            os.close(r)
            got = (s._keeping, s._bypassed)
            s.flush()
            os.write(w, repr(got).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        seen = f.read()
    assert os.waitpid(pid, 0)[1] == 0
    assert seen == repr(((0, 0, 0), 0))
    before = s._segment().totals()["bypasses"]
    s.flush()
    assert s._segment().totals()["bypasses"] == before + 3  # written once, by the parent
    s.close()


def test_a_batch_of_lookups_is_one_look(shm, locks):
    s, slot, order = full_store(shm)
    batch = _sampler.sample_sequence(order, 1).tolist()[:16]
    want = [s._segment().entry(i)[0] == _cache_segment.FULL for i in batch]
    assert 0 < sum(want) < len(batch)
    totals = s._segment().totals()
    locks.clear()
    got = s.get_many(batch)
    assert locks == ["shared"]
    assert [g is not None for g in got] == want
    assert all(bytes(g) == bytes(4000) for g in got if g is not None)
    after = s._segment().totals()
    assert after["hits"] - totals["hits"] == sum(want)
    assert after["misses"] - totals["misses"] == len(batch) - sum(want)
    # the hits' last uses, in the batch's order
    last = [s._segment().entry(i)[3] for i, hit in zip(batch, want) if hit]
    assert last == sorted(last) and len(set(last)) == len(last) and last[-1] == after["clock"]
    s.close()


def test_lookup_many_answers_as_lookups_one_at_a_time(shm):
    params = dict(order_params(), pipeline=None)
    del params["pipeline"]
    x = np.arange(300, dtype=np.int32)
    budget = _cache_segment.geometry(N, 4096, CACHED)["file_bytes"]
    one = SampleCache(b"o" * 16, params, budget, "belady", shm, auto_off=False)
    many = SampleCache(b"m" * 16, params, budget, "belady", shm, auto_off=False)
    for epoch in range(3):
        seq = _sampler.sample_sequence(params, epoch).tolist()
        for b in range(0, N, 7):
            batch = seq[b : b + 7]
            a = [one.lookup(epoch, i) for i in batch]
            m = many.lookup_many(epoch, batch)
            assert [v is MISS for v in a] == [v is MISS for v in m]
            for i, v in zip(batch, a):
                if v is MISS:
                    one.insert(i, x + i)
            for i, v in zip(batch, m):
                if v is MISS:
                    many.insert(i, x + i)
                else:
                    np.testing.assert_array_equal(v, x + i)
            many.batch_done()
    one.store.flush()
    counts = ("hits", "misses", "inserts", "evictions", "bypasses")
    assert {k: one.store.counts[k] for k in counts} == {k: many.store.counts[k] for k in counts}
    a, m = one.stats()["segment"], many.stats()["segment"]
    assert {k: a[k] for k in counts} == {k: m[k] for k in counts}
    one.close()
    many.close()


def test_a_batch_that_fails_still_writes_its_counts(shm):
    """Stages.batch calls batch_done whatever the stages do: a bypass of a
    batch whose augment raises is in the segment all the same."""
    from tsock._stages import StageError, Stages

    params = order_params()
    cache = SampleCache(b"f" * 16, params, _cache_segment.geometry(N, 4096, 2)["file_bytes"], "belady", shm,
                        auto_off=False)  # fmt: skip

    def augment(x, rng):
        if int(x[0]) == 9:
            raise ValueError("augment fails on sample 9")
        return x

    stages = Stages(list(range(N)), None, lambda i: np.full(1000, i, np.uint8), augment, None, 0, cache=cache)
    stages.batch(0, [1, 2, 3, 4, 5])  # two fill the cache; then bypasses
    with pytest.raises(StageError):
        stages.batch(0, [6, 7, 8, 9])
    assert cache.store._bypassed == 0
    seg = cache.store._segment().totals()  # as another process reads them: no flush of this one's
    assert seg["inserts"] + seg["bypasses"] == 9, seg  # 9 too: offered before its augment ran
    cache.close()


def _replay(shm, pipes: list, batched: bool, n: int = 512, batch: int = 32, epochs: int = 4) -> tuple:
    """Pipelines of their own (one SampleCache each, one segment) taking
    their orders a batch in turn: (hits, evictions) over all of them."""
    budget = _cache_segment.geometry(n, 4096, int(n * 0.4))["file_bytes"]
    caches = [SampleCache(b"r" * 16, p, budget, "belady", shm, auto_off=False, pipeline=f"p{k}")
              for k, p in enumerate(pipes)]  # fmt: skip
    x = np.zeros(500)
    for e in range(epochs):
        seqs = [_sampler.sample_sequence(p, e).tolist() for p in pipes]
        for b in range(0, max(map(len, seqs)), batch):
            for c, seq in zip(caches, seqs):
                indices = seq[b : b + batch]
                got = c.lookup_many(e, indices) if batched else [c.lookup(e, i) for i in indices]
                for i, v in zip(indices, got):
                    if v is MISS:
                        c.insert(i, x)
                c.batch_done()
    out = tuple(sum(c.store.counts[k] for c in caches) for k in ("hits", "evictions"))
    for c in caches:
        c.close()
    return out


@pytest.mark.parametrize("case", ["two pipelines", "drop_last"])
def test_batched_lookups_rank_as_well_as_lookups_one_at_a_time(shm, case):
    """Where Belady ranks, a batch's lookups at once must not cost hits: the
    process's position still moves with each sample it computes (review
    44: with only the batch's first lookup setting it, two pipelines lost
    6% of their hits)."""
    p = dict(n=512, seed=5, shuffle=True, batch_size=32, drop_last=False, world_size=0, ranks=[0],
             sampler_drop_last=False)  # fmt: skip
    pipes = [p, dict(p, seed=6)] if case == "two pipelines" else [dict(p, batch_size=48, drop_last=True)]
    os.makedirs(f"{shm}/single")
    os.makedirs(f"{shm}/batched")
    single = _replay(f"{shm}/single", pipes, batched=False)
    batched = _replay(f"{shm}/batched", pipes, batched=True)
    assert single[1] > 0  # it ranks and evicts here
    assert batched[0] >= 0.99 * single[0], (batched, single)


def test_stats_only_read(shm, locks):
    """stats() may come from a metrics thread: it takes no store lock and
    writes nothing (review 44); the counts wait for the batch's flush."""
    s, slot, order = full_store(shm)
    for i in misses_of(s, order, 1)[:5]:
        s.put(i, bytes(4000))
    pending = s._bypassed
    assert pending >= 4
    locks.clear()
    s.stats()
    assert locks == [] and s._bypassed == pending
    s.close()


def test_room_made_during_a_keep_all_run_is_filled(shm):
    """A bad entry dropped (its blocks freed) while a keep-all run lasts:
    the next miss fills the room, as before the run existed (review 44)."""
    s, slot, order = full_store(shm)
    seg = s._segment()
    cached = [i for i in range(N) if seg.entry(i)[0] == _cache_segment.FULL]
    missed = misses_of(s, order, 1)
    assert s.put(missed[0], bytes(4000)) is False  # the run starts
    seg.owner[seg.entry(cached[0])[2]] = 0  # a damaged chain: the lookup finds it corrupt
    assert s.get(cached[0]) is None
    s.flush()  # drops it: one sample's blocks free
    assert s._segment().totals()["free_blocks"] == 1
    assert s.put(missed[1], bytes(4000)) is True
    s.close()


@pytest.mark.parametrize("k", [1, 2, 64, 65, 1000])
def test_run_nexts_are_a_runs_next_words(k):
    from tsock._cache_segment import END, _run_nexts

    want = np.append(np.arange(8, 7 + k, dtype="<u4"), np.uint32(END)).astype("<u4").tobytes()
    assert _run_nexts(7, k) == want
