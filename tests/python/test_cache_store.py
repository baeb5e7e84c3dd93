"""The cache's shared-memory segment (tsock._cache_store) with real
processes: concurrent inserts and lookups, a process killed inside an
insert and while holding the lock, truncated and foreign files, the
budget against /dev/shm's free space, and the store's Belady against the
simulator's on the same trace.

Every segment lives in a directory of /dev/shm made for the test and
removed after it."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import time

import numpy as np
import pytest
from cache_helpers import collect, run_and_collect
from tsock import _cache_segment, _cache_store, _sampler
from tsock._cache_policy import KnownFuture, OnlineBelady, simulate
from tsock._cache_segment import segment_path
from tsock._cache_store import CacheStore
from tsock.errors import CacheError

FORK = mp.get_context("fork")
N = 64


def payload(index: int, size: int = 5000) -> bytes:
    """Sample `index`'s bytes: its index repeated (any mix-up shows)."""
    return (index.to_bytes(4, "little") * (size // 4 + 1))[:size]


def store(shm, key=b"k" * 16, budget=1 << 20, **kw) -> CacheStore:
    return CacheStore(key, N, budget=budget, directory=shm, **kw)


def consistent(s: CacheStore) -> dict:
    """The segment's index checked from outside: every FULL entry's chain
    holds its own blocks, no block is both owned and free."""
    seg = s._segment()
    with seg.locked(exclusive=True):
        seg.repair(set())
        free = set(seg.free[: int(seg.mut[_cache_segment.FREE_COUNT])].tolist())
        owned = set(np.flatnonzero(seg.owner != 0).tolist())
        assert not free & owned
        owners = seg.owner[sorted(owned)].astype(np.int64) - 1
        assert np.all(seg.state[owners] == _cache_segment.FULL), "a block owned by an entry not cached"
        assert len(free) + len(owned) == seg.h.n_blocks
        full = np.flatnonzero(seg.state == _cache_segment.FULL)
        for i in full:
            assert seg.read(int(i)) is not _cache_segment._CORRUPT
        count = int(seg.mut[_cache_segment.MEMBERS])
        assert sorted(seg.members[:count].tolist()) == full.tolist()
        assert all(int(seg.member[i]) == k for k, i in enumerate(seg.members[:count].tolist()))
        return seg.totals()


# ---- one process ----


def test_a_sample_put_is_got_back_and_others_miss(shm):
    s = store(shm)
    assert s.get(3) is None  # no segment yet: nothing created by a lookup
    assert os.listdir(shm) == []
    assert s.put(3, payload(3))
    assert bytes(s.get(3)) == payload(3)
    assert s.get(4) is None
    assert not s.put(3, payload(3))  # cached already
    assert s.counts["hits"] == 1 and s.counts["misses"] == 2 and s.counts["inserts"] == 1
    assert os.listdir(shm) == [os.path.basename(segment_path(b"k" * 16, shm))]


def test_two_keys_are_two_segments(shm):
    a, b = store(shm, key=b"a" * 16), store(shm, key=b"b" * 16)
    a.put(1, payload(1))
    b.put(1, payload(2))
    assert bytes(a.get(1)) == payload(1) and bytes(b.get(1)) == payload(2)
    assert len(os.listdir(shm)) == 2


@pytest.mark.parametrize("ranked", [_cache_store.RANKED, 3], ids=["all ranked", "3 ranked"])
@pytest.mark.parametrize("policy", _cache_store.POLICIES)
def test_every_policy_keeps_the_segment_within_its_budget(shm, policy, ranked, monkeypatch):
    monkeypatch.setattr(_cache_store, "RANKED", ranked)  # 3: victims chosen among 3 drawn at random
    budget = 200_000
    s = store(shm, budget=budget, policy=policy)
    s.put(0, payload(0, 100))  # makes the segment, which the consumer table is part of
    if policy == "belady":
        # An order that leaves samples out (64 % 5): it ranks and evicts (one
        # order of every sample keeps what is cached: test_cache_rank.py).
        assert s.register(order_params(seed=1, batch_size=5, drop_last=True)) == 0
    rng = np.random.default_rng(0)
    for _ in range(300):
        i = int(rng.integers(N))
        if s.get(i) is None:
            s.put(i, payload(i, int(rng.integers(100, 30_000))))
    assert os.path.getsize(s.path) <= budget
    totals = consistent(s)
    assert totals["inserts"] > totals["blocks"] // 8  # it did fill and evict (or refuse) along the way
    for i in range(N):
        got = s.get(i)
        assert got is None or bytes(got[:4]) == i.to_bytes(4, "little")


def order_params(seed: int, n: int = N, **kw) -> dict:
    p = dict(n=n, seed=seed, shuffle=True, batch_size=4, drop_last=False, world_size=0, ranks=[0])
    p["sampler_drop_last"] = False
    p.update(kw)
    return p


def test_the_stores_belady_makes_the_simulators_choices(shm):
    """One consumer, 3 shuffled epochs, equal sizes: the store (its consumer
    table, positions and eviction) hits exactly where the simulator's
    online Belady does, which is the offline optimum for one consumer."""
    # drop_last: 64 % 5 samples are left out of each epoch, so evictions
    # gain (one order of every sample keeps what is cached: test_cache_rank.py).
    order = order_params(seed=3, batch_size=5, drop_last=True)
    s = store(shm, budget=_cache_segment.geometry(N, 4096, 20)["file_bytes"])
    assert s.register(order) is None  # no segment yet
    s.put(N - 1, payload(N - 1, 4000))
    slot = s.register(order)
    trace, who = [N - 1], [(0, 0)]
    for e in range(3):
        for i in _sampler.sample_sequence(order, e):
            trace.append(int(i))
            who.append((0, e))
            s.at(slot, e, int(i))
            if s.get(int(i)) is None:
                s.put(int(i), payload(int(i), 4000))
    future = KnownFuture(N)
    future.set_consumer(0, lambda e: _sampler.sample_sequence(order, e))
    want = simulate(trace, dict.fromkeys(range(N), 1), 20, OnlineBelady(future), who=who)
    assert s.counts["hits"] == want.hits > 0 and s.counts["evictions"] > 0


def test_lru_and_fill_once_in_the_store(shm):
    """Cyclic access to 30 samples with room for 20: LRU never hits,
    fill-once hits the 20 it kept each round."""
    budget = _cache_segment.geometry(N, 4096, 20)["file_bytes"]
    for policy, hits in (("lru", 0), ("fill-once", 40)):
        s = store(shm, key=policy.encode().ljust(16, b"."), budget=budget, policy=policy)
        for _ in range(3):
            for i in range(30):
                if s.get(i) is None:
                    s.put(i, payload(i, 4000))
        assert s.counts["hits"] == hits, policy


def test_a_sample_larger_than_the_cache_is_refused(shm):
    s = store(shm, budget=_cache_segment.geometry(N, 4096, 4)["file_bytes"])
    assert s.put(0, payload(0, 100)) and not s.put(1, payload(1, 5 * 4096))
    assert s.counts["refused"] == 1


# ---- processes ----


def _hammer(shm: str, worker: int, rounds: int, q) -> None:
    s = store(shm, budget=300_000)
    rng = np.random.default_rng(worker)
    hits = wrong = 0
    for _ in range(rounds):
        i = int(rng.integers(N))
        got = s.get(i)
        if got is None:
            s.put(i, payload(i, 3000 + 100 * i))
        elif bytes(got) != payload(i, 3000 + 100 * i):
            wrong += 1
        else:
            hits += 1
    q.put((hits, wrong, s.counts["corrupt"]))


def test_two_processes_insert_and_read_concurrently(shm):
    q = FORK.Queue()
    results = run_and_collect(q, [FORK.Process(target=_hammer, args=(shm, w, 1500, q)) for w in range(2)])
    assert all(wrong == 0 and corrupt == 0 for _, wrong, corrupt in results), results
    assert sum(h for h, _, _ in results) > 500
    consistent(store(shm, budget=300_000))


def _die_inside_insert(shm: str) -> None:
    """Inserts sample 5 and is killed after its blocks were taken and
    written, before its entry is FULL."""
    s = store(shm)
    s.put(1, payload(1))
    real = _cache_segment._Segment.insert

    def insert(self, index, data, need):
        self.state = _KillOnWrite(self.state)
        real(self, index, data, need)

    _cache_segment._Segment.insert = insert
    s.put(5, payload(5, 20_000))


class _KillOnWrite:
    """An entry state array whose first write (state = FULL) kills the process."""

    def __init__(self, arr):
        self.arr = arr

    def __setitem__(self, k, v):
        os.kill(os.getpid(), signal.SIGKILL)

    def __getitem__(self, k):
        return self.arr[k]


def test_a_process_killed_inside_an_insert_leaves_nothing_that_blocks(shm):
    p = FORK.Process(target=_die_inside_insert, args=(shm,))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    s = store(shm)
    seg = s._segment()
    assert int(seg.mut[_cache_segment.DIRTY]) == 1  # cut short, as intended
    assert s.get(5) is None and bytes(s.get(1)) == payload(1)
    assert s.put(6, payload(6))  # the next change rebuilds first
    totals = consistent(s)
    assert totals["rebuilds"] == 1 and totals["dirty"] == 0
    assert totals["free_blocks"] == totals["blocks"] - 4  # samples 1 and 6: 2 blocks each; 5's 5 blocks freed
    assert s.put(5, payload(5, 20_000)) and bytes(s.get(5)) == payload(5, 20_000)


def _hold_the_lock(shm: str, ready) -> None:
    s = store(shm)
    s.put(1, payload(1))
    seg = s._segment()
    with seg.locked(exclusive=True):
        ready.set()
        time.sleep(600)


def test_a_process_killed_while_holding_the_lock_does_not_block(shm):
    ready = FORK.Event()
    p = FORK.Process(target=_hold_the_lock, args=(shm, ready))
    p.start()
    assert ready.wait(60)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    s = store(shm)
    assert bytes(s.get(1)) == payload(1)
    assert s.put(2, payload(2))


def _insert_forever(shm: str) -> None:
    s = store(shm, budget=150_000)
    i = 0
    while True:
        s.put(i % N, payload(i % N, 2000 + 300 * (i % N)))
        i += 1
        if i % N == 0:
            for j in range(0, N, 2):
                s.get(j)


def test_processes_killed_at_random_points_leave_a_consistent_index(shm):
    rng = np.random.default_rng(4)
    for _ in range(5):
        p = FORK.Process(target=_insert_forever, args=(shm,))
        p.start()
        time.sleep(0.2 + float(rng.random()) * 0.5)
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    s = store(shm, budget=150_000)
    s.put(0, payload(0, 2000))  # a change: rebuilds if the last kill cut one short
    consistent(s)
    for i in range(N):
        got = s.get(i)
        assert got is None or bytes(got) == payload(i, 2000 + 300 * i)


def test_a_forked_child_opens_the_segment_again(shm):
    s = store(shm)
    s.put(1, payload(1))
    q = FORK.Queue()

    def child():
        got = s.get(1)
        q.put((bytes(got) == payload(1), s._seg.fd != parent_fd))

    parent_fd = s._seg.fd
    p = FORK.Process(target=child)
    p.start()
    assert collect(q, [p]) == [(True, True)]
    p.join(30)


# ---- bad files ----


def _make(shm, budget=1 << 20) -> str:
    s = store(shm, budget=budget)
    s.put(1, payload(1))
    s.close()
    return s.path


def _hold_users_lock(path: str, ready, stop) -> None:
    fd = os.open(path, os.O_RDWR)
    _cache_segment._lock(fd, _cache_segment.fcntl.F_RDLCK, _cache_segment.USERS_BYTE, wait=True)
    ready.set()
    stop.wait(120)


def in_use(path):
    ready, stop = FORK.Event(), FORK.Event()
    p = FORK.Process(target=_hold_users_lock, args=(path, ready, stop))
    p.start()
    assert ready.wait(60)
    return p, stop


def test_a_truncated_segment_nobody_uses_is_made_again(shm):
    path = _make(shm)
    os.truncate(path, 8192)
    s = store(shm)
    assert s.get(1) is None  # removed, not trusted
    assert not os.path.exists(path)
    assert s.put(1, payload(1)) and os.path.getsize(path) > 8192


def test_a_truncated_segment_in_use_is_a_clear_error(shm):
    path = _make(shm)
    os.truncate(path, 8192)
    p, stop = in_use(path)
    try:
        with pytest.raises(CacheError, match=r"8192 bytes, its header says \d+ \(truncated\?\).*in use"):
            store(shm).get(1)
        assert os.path.getsize(path) == 8192  # left alone
    finally:
        stop.set()
        p.join(30)


@pytest.mark.parametrize(
    "damage,chain",
    [
        (lambda seg, b: seg.next.__setitem__(b, 7_000_000), True),  # a chain leaving the arena
        (lambda seg, b: seg.next.__setitem__(b, b), True),  # a loop
        (lambda seg, b: seg.owner.__setitem__(b, 9), True),  # a block of another sample
        (lambda seg, b: seg.next.__setitem__(b + 2, b + 3), True),  # a run that does not end (into sample 3)
        (lambda seg, b: seg.mut.__setitem__(_cache_segment.FREE_COUNT, 1 << 40), False),  # past the blocks
        (lambda seg, b: seg.mut.__setitem__(_cache_segment.MEMBERS, 1 << 40), False),  # past the blocks
        (lambda seg, b: seg.members.__setitem__(0, 7_000_000), False),  # not a sample
        (lambda seg, b: seg.members.__setitem__(0, 30), False),  # a sample not cached
    ],
    ids=["out of range", "loop", "owner", "no end", "free count", "member count", "member range", "member not cached"],
)
def test_a_damaged_index_is_a_miss_then_repaired(shm, damage, chain):
    s = store(shm, budget=_cache_segment.geometry(N, 4096, 12)["file_bytes"], policy="lru")
    for i in (1, 2, 3):
        s.put(i, payload(i, 9000))  # 3 blocks each
    seg = s._segment()
    _, _, first, _ = seg.entry(2)
    damage(seg, first)
    got = [s.get(i) for i in (1, 2, 3)]
    assert bytes(got[0]) == payload(1, 9000) and bytes(got[2]) == payload(3, 9000)
    assert (got[1] is None and s.counts["corrupt"] == 1) if chain else bytes(got[1]) == payload(2, 9000)
    assert s.put(4, payload(4, 9000))  # the change that repairs
    assert s.put(5, payload(5, 9000))  # evicts (LRU: always): the members list is read
    totals = consistent(s)
    assert s.get(2) is None or bytes(s.get(2)) == payload(2, 9000)
    assert totals["free_blocks"] + 3 * sum(s.get(i) is not None for i in range(1, 6)) == totals["blocks"]


def test_evicting_a_damaged_chain_frees_its_blocks(shm):
    s = store(shm, budget=_cache_segment.geometry(N, 4096, 9)["file_bytes"], policy="lru")
    for i in (1, 2, 3):
        s.put(i, payload(i, 9000))  # 3 blocks each: full
    seg = s._segment()
    _, _, first, _ = seg.entry(1)
    seg.next[first] = 7_000_000  # sample 1, the least recent, is evicted next without being read
    assert s.put(4, payload(4, 9000))
    totals = consistent(s)
    assert totals["free_blocks"] == 0 and totals["rebuilds"] == 1


def test_a_segment_truncated_while_open_is_an_error_not_a_sigbus(shm):
    s = store(shm)
    s.put(1, payload(1))
    os.truncate(s.path, 4096)
    with pytest.raises(CacheError, match="is 4096 bytes now"):
        s.get(1)
    with pytest.raises(CacheError, match="is 4096 bytes now"):
        s.put(2, payload(2))


@pytest.mark.parametrize(
    "content,match",
    [
        (b"\x7fELF" + b"\0" * 8188, "not a tsock cache"),
        (b"TSKCACHE\x09\0\0\0" + b"\0" * 8180, "layout version 9"),
        (b"", "truncated"),
    ],
    ids=["foreign", "another version", "empty"],
)
def test_a_foreign_file_in_use_is_a_clear_error_and_left_alone(shm, content, match):
    path = segment_path(b"k" * 16, shm)
    with open(path, "wb") as f:
        f.write(content)
    os.chmod(path, 0o600)
    p, stop = in_use(path)
    try:
        with pytest.raises(CacheError, match=match):
            store(shm).put(1, payload(1))
        with open(path, "rb") as f:
            assert f.read() == content
    finally:
        stop.set()
        p.join(30)
    s = store(shm)  # once nobody uses it: replaced
    assert s.put(1, payload(1)) and bytes(s.get(1)) == payload(1)


def test_a_segment_of_another_key_or_size_is_refused(shm):
    path = _make(shm)
    other = segment_path(b"x" * 16, shm)
    shutil.copyfile(path, other)
    os.chmod(other, 0o600)
    users = [in_use(path), in_use(other)]
    try:
        with pytest.raises(CacheError, match="64 samples, the pipeline has 65"):
            CacheStore(b"k" * 16, 65, directory=shm).get(1)
        with pytest.raises(CacheError, match=f"key {(b'k' * 16).hex()}, not {(b'x' * 16).hex()}"):
            store(shm, key=b"x" * 16).get(1)
    finally:
        for p, stop in users:
            stop.set()
            p.join(30)


def test_a_file_others_may_write_is_refused(shm):
    path = _make(shm)
    os.chmod(path, 0o622)
    p, stop = in_use(path)
    try:
        with pytest.raises(CacheError, match="lets others write it"):
            store(shm).get(1)
    finally:
        stop.set()
        p.join(30)


# ---- the budget ----


def test_a_budget_larger_than_the_free_space_fails_before_any_write(shm, monkeypatch):
    real = os.statvfs

    class Small:
        def __init__(self, st):
            self.f_frsize, self.f_bavail, self.f_blocks = st.f_frsize, (1 << 20) // st.f_frsize, st.f_blocks

    monkeypatch.setattr(_cache_segment.os, "statvfs", lambda d: Small(real(d)))
    s = store(shm, budget=8 << 20)
    with pytest.raises(CacheError, match=r"needs \d+ bytes and .* has 1048576 free: lower cache_bytes"):
        s.put(1, payload(1))
    assert os.listdir(shm) == []
    assert _cache_segment.default_budget(shm) == 1 << 19  # half the free space, below a quarter of the memory


def test_a_full_shm_at_allocation_is_an_error_and_leaves_nothing(shm, monkeypatch):
    def enospc(fd, off, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_cache_segment.os, "posix_fallocate", enospc)
    with pytest.raises(CacheError, match="cannot allocate .* No space left on device: lower cache_bytes"):
        store(shm).put(1, payload(1))
    assert os.listdir(shm) == []


def test_a_budget_too_small_for_the_index_says_so(shm):
    with pytest.raises(CacheError, match="cache_bytes=10000 is less than the 45056 bytes 64 samples need"):
        store(shm, budget=10_000).put(1, payload(1))


def test_remove_takes_only_an_unused_segment(shm):
    s = store(shm)
    s.put(1, payload(1))
    assert not _cache_segment.remove(b"k" * 16, shm)  # s uses it
    s.close()
    assert _cache_segment.remove(b"k" * 16, shm)
    assert os.listdir(shm) == []


# ---- the order of a pipeline ----


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"drop_last": True},
        {"world_size": 3},
        {"world_size": 3, "ranks": [2, 0], "drop_last": True},
        {"world_size": 4, "sampler_drop_last": True},
    ],
    ids=["whole", "drop_last", "partition", "ranks", "sampler_drop_last"],
)
def test_sample_sequence_is_the_pipelines_order(kw):
    if "world_size" in kw:
        pytest.importorskip("torch")
    from tsock import Pipeline

    pipe = Pipeline(list(range(23)), batch_size=4, seed=5, **kw)
    p = order_params(seed=5, n=23, **kw)
    p["ranks"] = list(pipe.ranks)
    p["world_size"] = pipe.world_size
    for e in (0, 1):
        want = np.concatenate([pipe.info(e, k).indices for k in range(len(pipe))])
        assert _sampler.sample_sequence(p, e).tolist() == want.tolist()


@pytest.mark.parametrize("n_samples", [1, 64, 5000])
def test_blocks_for_budget_is_the_most_that_fits(n_samples):
    for budget in range(40_000, 2_000_000, 37_717):
        n = _cache_segment.blocks_for_budget(n_samples, 4096, budget)
        if n:
            assert _cache_segment.geometry(n_samples, 4096, n)["file_bytes"] <= budget
        assert _cache_segment.geometry(n_samples, 4096, n + 1)["file_bytes"] > budget


@pytest.mark.parametrize("size", [100, 5000, 70_000])
def test_budget_for_holds_exactly_that_many_samples(shm, size):
    s = store(shm, budget=_cache_segment.budget_for(N, size, 10), policy="fill-once")
    assert [s.put(i, payload(i, size)) for i in range(11)] == [True] * 10 + [False]


# ---- a same-uid peer that truncates or forges the file (review 31, F4) ----


def _look_up_while_truncated(shm, seconds, size, q) -> None:
    s = store(shm, budget=4 << 20)
    outcomes = {"hit": 0, "miss": 0, "error": 0, "wrong": 0}
    # `seconds` of lookups, and on until the peer's truncations have been
    # met (a peer held off its CPU on a loaded machine starts late), 60 s at most.
    start = time.monotonic()
    while time.monotonic() - start < (seconds if outcomes["error"] + outcomes["miss"] else 60):
        for i in range(8):
            try:
                got = s.get(i)
            except CacheError:
                outcomes["error"] += 1
                continue
            if got is None:
                outcomes["miss"] += 1
            elif bytes(got) == payload(i, size):
                outcomes["hit"] += 1
            else:  # zeroed blocks (a torn read, review 33 W1) or another sample's bytes
                outcomes["wrong"] += 1
    q.put(outcomes)


def _truncate_again_and_again(path, size, stop) -> None:
    fd = os.open(path, os.O_RDWR)
    while not stop.is_set():
        os.ftruncate(fd, 4096)
        os.ftruncate(fd, size)
        time.sleep(random.uniform(0, 0.002))  # lookups also run between two truncations


@pytest.mark.parametrize("size", [3000, 48_000], ids=["one-block", "multi-block"])
def test_a_lookup_survives_a_peer_truncating_the_segment_under_it(shm, size):
    s = store(shm, budget=4 << 20)
    for i in range(8):
        s.put(i, payload(i, size))
    assert size < s._segment().h.block_bytes or size > 2 * s._segment().h.block_bytes
    file_bytes = os.path.getsize(s.path)
    q, stop = FORK.Queue(), FORK.Event()
    reader = FORK.Process(target=_look_up_while_truncated, args=(shm, 4, size, q))
    reader.start()
    peer = FORK.Process(target=_truncate_again_and_again, args=(s.path, file_bytes, stop))
    peer.start()
    try:
        reader.join(120)
    finally:
        stop.set()
        peer.join(30)
    assert reader.exitcode == 0, f"the reader died: exit status {reader.exitcode}"  # -7 was SIGBUS
    outcomes = q.get(timeout=10)
    assert outcomes["error"] + outcomes["miss"] > 0, outcomes
    assert outcomes["wrong"] == 0, outcomes


def _fragment(s: CacheStore, index: int, size: int) -> None:
    """Caches `index` (size bytes, 4 blocks or fewer) in a chain of two
    runs: two 2-block samples evicted leave their blocks, not adjacent,
    on top of the free stack."""
    for i in (60, 61, 62):
        s.put(i, payload(i, 2 * 4096))
    seg = s._segment()
    assert seg.h.block_bytes == 4096
    with seg.locked(exclusive=True):
        seg.evict([60, 62])
    s.put(index, payload(index, size))


@pytest.mark.parametrize("change", ["holes", "owner"])
@pytest.mark.parametrize("runs", [1, 2])
def test_a_sample_changed_while_it_is_copied_is_a_miss(shm, monkeypatch, runs, change):
    """A same-uid peer changes the file after the first run of a sample is
    copied (review 33, W1). "holes": it truncates the arena and extends
    the file again (the index words stay, the blocks read as zeros: with
    two runs the copy is torn), which only the check for holes sees;
    "owner": it gives a block of the chain to another sample, which only
    the second read of the chain sees. Either is a miss, never the bytes."""
    s = store(shm, budget=4 << 20)
    data = payload(3, 48_000 if runs == 1 else 4 * 4096 - 100)
    if runs == 1:
        s.put(3, data)
    else:
        _fragment(s, 3, len(data))
    seg = s._segment()
    with seg.locked(exclusive=False):
        chain = seg._checked_chain(3)[1]
    assert len(chain) == runs
    size, arena = os.path.getsize(s.path), seg.h.geometry["arena_offset"]
    assert bytes(s.get(3)) == data
    real, calls = os.preadv, []

    def preadv_then_change(fd, buffers, offset):
        got = real(fd, buffers, offset)
        calls.append(offset)
        if len(calls) == 1:  # after the first run's copy
            if change == "holes":
                os.truncate(s.path, arena)
                os.truncate(s.path, size)
            else:
                os.pwrite(fd, (9).to_bytes(4, "little"), seg.h.geometry["owner_offset"] + 4 * chain[-1][0])
        return got

    monkeypatch.setattr(_cache_segment.os, "preadv", preadv_then_change)
    assert s.get(3) is None
    assert len(calls) == runs and s.counts["corrupt"] == 1


def test_a_hit_on_a_run_reads_its_index_words_in_a_few_calls(shm, monkeypatch):
    s = store(shm, budget=4 << 20)
    s.put(3, payload(3, 12 * 4096))
    real, calls = os.pread, []
    monkeypatch.setattr(_cache_segment.os, "pread", lambda *a: calls.append(a) or real(*a))
    assert bytes(s.get(3)) == payload(3, 12 * 4096)
    assert len(calls) <= 10, f"{len(calls)} preads for a 12-block run"  # not two a block


def test_a_chain_of_consecutive_blocks_in_descending_order_reads_back_and_heals(shm):
    """Blocks popped high to low (the order of segments written by tsock
    before runs) are consecutive but not a run: written and read block by
    block, and once evicted they pop as a run."""
    s = store(shm, budget=4 << 20)
    s.put(1, payload(1, 4096))
    seg = s._segment()
    with seg.locked(exclusive=True):
        n = int(seg.mut[_cache_segment.FREE_COUNT])
        seg.free[n - 4 : n] = seg.free[n - 4 : n][::-1].copy()  # the next pops: 4, 3, 2, 1
    data = payload(2, 4 * 4096 - 100)
    s.put(2, data)
    with seg.locked(exclusive=False):
        assert seg._checked_chain(2)[1] == ((4, 1), (3, 1), (2, 1), (1, 1))
    assert bytes(s.get(2)) == data
    with seg.locked(exclusive=True):
        seg.evict([2])
    s.put(5, payload(5, len(data)))
    with seg.locked(exclusive=False):
        assert seg._checked_chain(5)[1] == ((1, 4),)
    assert bytes(s.get(5)) == payload(5, len(data))
    consistent(s)


def test_a_run_past_one_copy_call_is_copied_in_parts(shm, monkeypatch):
    """One read(2) returns at most 2 GiB - 4 KiB: a longer run is copied in
    calls of at most COPY_MAX bytes (made small here)."""
    monkeypatch.setattr(_cache_segment, "COPY_MAX", 3 * 4096)
    s = store(shm, budget=4 << 20)
    data = payload(3, 10 * 4096 - 7)
    s.put(3, data)
    real, calls = os.preadv, []
    monkeypatch.setattr(_cache_segment.os, "preadv", lambda fd, b, o: calls.append(o) or real(fd, b, o))
    assert bytes(s.get(3)) == data
    assert len(calls) == 4


def test_a_chain_in_two_runs_reads_back_whole(shm):
    s = store(shm, budget=4 << 20)
    data = payload(5, 4 * 4096 - 100)
    _fragment(s, 5, len(data))
    seg = s._segment()
    with seg.locked(exclusive=False):
        length, runs = seg._checked_chain(5)
    assert length == len(data) and len(runs) == 2 and sum(k for _, k in runs) == 4
    assert bytes(s.get(5)) == data and bytes(s.get(61)) == payload(61, 2 * 4096)
    consistent(s)


def test_samples_of_one_size_lie_in_consecutive_blocks_through_evictions(shm):
    """The layout read() copies with one call per sample: inserts pop the
    free stack in order and evictions push a chain back to pop the same
    way, so samples of one size keep runs of consecutive blocks (after a
    rebuild too) however often they are replaced."""
    size = 3 * 4096 - 10
    s = store(shm, budget=_cache_segment.budget_for(N, size, 8), policy="lru")
    rng = random.Random(0)
    for step in range(300):
        i = rng.randrange(N)
        if s.get(i) is None:
            s.put(i, payload(i, size))
        if step == 150:  # a rebuild with room free: the stack is remade
            seg = s._segment()
            with seg.locked(exclusive=True):
                seg.evict(np.flatnonzero(seg.state == _cache_segment.FULL)[:3])
                seg.rebuild()
                assert int(seg.mut[_cache_segment.FREE_COUNT]) == 9
            fresh = next(j for j in range(N) if s.get(j) is None)
            s.put(fresh, payload(fresh, size))
            with seg.locked(exclusive=False):
                assert len(seg._checked_chain(fresh)[1]) == 1  # the rebuilt stack pops a run
    seg = s._segment()
    assert int(seg.mut[_cache_segment.EVICTIONS]) > 50
    with seg.locked(exclusive=False):
        chains = [seg._checked_chain(int(i)) for i in np.flatnonzero(seg.state == _cache_segment.FULL)]
    assert len(chains) == 8 and all(len(runs) == 1 for _, runs in chains), chains
    consistent(s)


def test_a_sparse_segment_is_refused(shm):
    s = store(shm)
    s.put(1, payload(1))
    size = os.path.getsize(s.path)
    s.close()
    with open(s.path, "r+b") as f:  # the same header, but holes where the rest was
        head = f.read(4096)
        f.truncate(0)
        f.seek(0)
        f.write(head)
        f.truncate(size)
    fd = os.open(s.path, os.O_RDONLY)
    try:
        with pytest.raises(CacheError, match="sparse"):
            _cache_segment._check(fd, s.path, b"k" * 16, N)
    finally:
        os.close(fd)
    fresh = store(shm)
    assert fresh.get(1) is None  # refused, and removed as nobody used it
    assert fresh.put(1, payload(1)) and os.stat(fresh.path).st_blocks * 512 >= size


# ---- another uid's file at our name (review 31, F7) ----

NOBODY = 65534


def _as_nobody(shm, q) -> None:
    import mmap  # noqa: F401 - imported before the uid changes: nobody may not read root's Python

    os.setgid(NOBODY)
    os.setuid(NOBODY)
    s = CacheStore(b"k" * 16, N, budget=1 << 20, directory=shm)
    try:
        s.put(3, payload(3))
        q.put(("ok", os.path.basename(s.path), bytes(s.get(3)) == payload(3)))
    except Exception as e:  # noqa: BLE001 - the test wants its kind
        q.put((type(e).__name__, str(e), None))


def _squat(shm, names, mode) -> list:
    base = f"tsock-cache.{NOBODY}.{(b'k' * 16).hex()}"
    planted = []
    for name in names:
        path = os.path.join(shm, base + name)
        with open(path, "wb") as f:
            f.write(b"\0" * 8192)
        os.chmod(path, mode)
        os.chown(path, 4242, 4242)
        planted.append(path)
    return planted


def _run_as_nobody(shm):
    q = FORK.Queue()
    p = FORK.Process(target=_as_nobody, args=(shm, q))
    p.start()
    (got,) = collect(q, [p])
    p.join(30)
    return got


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant another uid's file")
@pytest.mark.parametrize("mode", [0o600, 0o666])
def test_another_uids_file_at_our_name_is_passed_over(shm, mode):
    os.chmod(shm, 0o1777)  # like /dev/shm
    planted = _squat(shm, [""], mode)
    kind, name, right = _run_as_nobody(shm)
    assert (kind, right) == ("ok", True) and name.endswith(".1"), (kind, name)
    assert all(os.stat(p).st_uid == 4242 for p in planted)  # left alone


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant another uid's file")
def test_files_of_another_uid_at_every_name_are_a_clear_cache_error(shm):
    os.chmod(shm, 0o1777)
    _squat(shm, [""] + [f".{i}" for i in range(1, _cache_segment.FALLBACK_NAMES + 1)], 0o666)
    kind, message, _ = _run_as_nobody(shm)
    assert kind == "CacheError" and "other uids take every name" in message, (kind, message)
