"""A cache that costs a process more time than its hits save turns itself
off in that process (Pipeline(cache_auto_off=True), the default): per
epoch from the second on, its lookups and inserts against its hits times
the time a sample takes to compute. The batches never change; a costly
decode keeps the cache on; cache_auto_off=False keeps it on whatever it
costs."""

from __future__ import annotations

import time
import warnings

import pytest
import tsock
from pipeline_helpers import Counting, Numbers, batch_hash, noisy
from tsock import _cache

# Enough samples that each epoch's lookups (in each of two workers) reach
# MIN_LOOKUPS, the fewest an epoch is judged on.
N = 2 * _cache.MIN_LOOKUPS + 88
EPOCHS = 4
# The cache turning itself off is a failure here, except where a test expects it.
pytestmark = pytest.mark.usefixtures("cache_stays_on")


class SlowDecode:
    """A decode that takes 2 ms: far more than a hit's CPU (tens of us)."""

    def __call__(self, sample):
        time.sleep(0.002)
        return sample


def identity(x):
    return x


def spin(us: int) -> None:
    """Burns `us` microseconds of this thread's CPU."""
    end = time.thread_time_ns() + us * 1000
    while time.thread_time_ns() < end:
        pass


@pytest.fixture
def dear_hits(monkeypatch):
    """Each hit costs 1 ms more CPU (the decode of the cached bytes spins):
    a Numbers sample (a few us, and the odd preemption of a loaded machine
    counted in its wall time) is then far cheaper than a hit. Forked
    workers inherit it."""
    decode = _cache.decode

    def dear(raw):
        spin(1000)
        return decode(raw)

    monkeypatch.setattr(_cache, "decode", dear)


@pytest.fixture
def dear_inserts(monkeypatch):
    """Each insert costs 500 us more CPU (the encoding spins), as a large
    image's copy into the segment would: filling the cache is dear, and a
    hit (sparing a 2 ms decode) still pays many times over."""
    prepare = _cache.prepare

    def dear(sample):
        spin(500)
        return prepare(sample)

    monkeypatch.setattr(_cache, "prepare", dear)


def pipeline(shm, source=None, **kw) -> tsock.Pipeline:
    kw.setdefault("cache_bytes", 8 << 20)  # the whole dataset fits
    return tsock.Pipeline(
        source if source is not None else Numbers(N), batch_size=16, seed=3, augment=noisy, cache_dir=shm, **kw
    )


def hashes(pipe, epochs=EPOCHS) -> list:
    return [batch_hash(b) for e in range(epochs) for b in pipe.batches(e)]


def reference(epochs=EPOCHS, **kw) -> list:
    return hashes(tsock.Pipeline(Numbers(N), batch_size=16, seed=3, augment=noisy, **kw), epochs)


# ---- the verdict ----


def ledger(epoch=1, lookups=_cache.MIN_LOOKUPS, hits=0, cache_us=0.0, first=False) -> _cache.Ledger:
    out = _cache.Ledger(epoch, first=first)
    out.lookups, out.hits, out.cache_ns = lookups, hits, int(cache_us * 1e3 * lookups)
    return out


def test_the_verdict_weighs_the_cache_time_against_what_the_hits_saved():
    half = _cache.MIN_LOOKUPS // 2
    # 40 us a lookup; half of them hit, each sparing 100 us: it pays.
    assert ledger(hits=half, cache_us=40).verdict(100e3) is None
    # The same hits sparing 50 us each save 25 us a lookup: it does not.
    why = ledger(hits=half, cache_us=40).verdict(50e3)
    assert why is not None and "took 40.0 us per sample" in why and "saved 25.0 us per sample" in why
    assert "computed in 50.0 us" in why and f"({half} of {_cache.MIN_LOOKUPS})" in why
    # Within MARGIN of what it saves (30 against 25 us) it stays: one epoch is noisy.
    assert ledger(hits=half, cache_us=30).verdict(50e3) is None
    assert ledger(hits=half, cache_us=25 * _cache.MARGIN + 1).verdict(50e3) is not None


def test_the_verdict_waits_for_an_epoch_that_can_tell():
    assert ledger(cache_us=40).verdict(1e3) is not None  # told: no hit, 40 us a lookup
    assert ledger(cache_us=40, first=True).verdict(1e3) is None  # the process's first epoch fills the cache
    filling = ledger(cache_us=40)
    filling.fills = _cache.MIN_LOOKUPS // _cache.FILLING + 1  # still filling the cache: its hits tell nothing yet
    assert filling.verdict(1e3) is None
    filling.fills -= 1  # a few inserts into free space in a full cache (samples of unequal sizes): judged
    assert filling.verdict(1e3) is not None
    assert ledger(lookups=_cache.MIN_LOOKUPS - 1, cache_us=40).verdict(1e3) is None  # too few lookups
    assert ledger(cache_us=40).verdict(None) is None  # nothing computed yet: a hit has no price


# ---- in a pipeline ----


def test_a_cache_dearer_than_computing_turns_off_and_the_batches_stay_the_same(shm, dear_hits):
    src = Counting(N)
    pipe = pipeline(shm, src)
    with pytest.warns(_cache.CacheWarning, match="off in this process.*costs more than it saves: in epoch 1") as w:
        got = hashes(pipe)
    assert got == reference()
    assert w[0].filename == __file__  # the warning names the user's loop, not tsock's insides
    cache = pipe._stages.cache
    assert not cache.store.opened  # off: the segment was let go of
    stats = pipe.cache_stats()
    assert stats["off"].startswith("costs more than it saves: in epoch 1")
    # Reading the figures opens the segment only for the read: an off
    # process holds no mapping (a remove() elsewhere must be able to free it).
    assert stats["segment"]["hits"] == N and not cache.store.opened
    # Epoch 1 came from the cache; from epoch 2 on every sample is computed.
    assert stats["hits"] == N and len(src.loaded) == (EPOCHS - 1) * N
    # Its consumer entry was given back: evictions no longer plan for its order.
    seg = cache.store._segment()
    assert seg.consumers() == []
    cache.store.close()
    # close() gives the cache a new chance, with a first epoch not judged.
    pipe.close()
    assert pipe.cache_stats()["off"] is None
    with pytest.warns(_cache.CacheWarning, match="costs more than it saves: in epoch 1"):
        assert hashes(pipe) == reference()


def test_a_costly_decode_keeps_the_cache_on(shm):
    src = Counting(N)
    pipe = pipeline(shm, src, decode=SlowDecode())
    assert [batch_hash(b) for e in range(3) for b in pipe.batches(e)] == reference(3, decode=SlowDecode())
    stats = pipe.cache_stats()
    assert stats["off"] is None and stats["hits"] == 2 * N and len(src.loaded) == N
    pipe.close()


@pytest.mark.parametrize("how", ["resumed", "closed"])
def test_the_first_epoch_a_process_sees_is_not_judged(shm, how):
    # A resumed run starts at epoch 3 on a cold cache, and a pipeline
    # iterated again after close() starts on a removed one: that epoch fills
    # the cache and has no hits to show, which must not turn it off.
    src = Counting(N)
    pipe = pipeline(shm, src, decode=SlowDecode())
    if how == "closed":
        list(pipe.batches(0))
        pipe.close()
    got = [batch_hash(b) for e in (3, 4, 5) for b in pipe.batches(e)]
    assert got == [batch_hash(b) for e in (3, 4, 5) for b in tsock.Pipeline(
        Numbers(N), batch_size=16, seed=3, augment=noisy, decode=SlowDecode()).batches(e)]  # fmt: skip
    stats = pipe.cache_stats()
    assert stats["off"] is None and len(src.loaded) == (2 if how == "closed" else 1) * N
    pipe.close()


@pytest.mark.parametrize("how", ["break", "resumed late"])
def test_an_epoch_that_fills_the_cache_is_not_judged(shm, dear_inserts, how):
    # The process's first epoch is cut short (a `break` after one batch, or
    # a resume at an epoch's last batch): the next epoch fills the cache,
    # dearly, with few hits. Judged, that would turn off a cache whose hits
    # each spare a 2 ms decode; it must wait for an epoch of a filled cache.
    src = Counting(N)
    pipe = pipeline(shm, src, decode=SlowDecode())
    if how == "break":
        for _ in pipe.batches(0):
            break
    else:
        list(pipe.batches(0, start=len(pipe) - 1))
    got = [batch_hash(b) for e in (1, 2, 3) for b in pipe.batches(e)]
    assert got == [batch_hash(b) for e in (1, 2, 3) for b in tsock.Pipeline(
        Numbers(N), batch_size=16, seed=3, augment=noisy, decode=SlowDecode()).batches(e)]  # fmt: skip
    stats = pipe.cache_stats()
    assert stats["off"] is None and stats["hits"] >= 2 * N
    pipe.close()


def test_turning_off_in_process_under_w_error_does_not_fail_the_pipeline(shm, dear_hits):
    pipe = pipeline(shm)
    with warnings.catch_warnings():
        warnings.simplefilter("error", _cache.CacheWarning)
        assert hashes(pipe) == reference()
    assert pipe.cache_stats()["off"].startswith("costs more than it saves")
    pipe.close()


def _child_lookup(pipe, q):
    cache = pipe._stages.cache
    q.put((cache._is_off(), cache.off, cache.lookup(9, 0) is not _cache.MISS))


def test_a_forked_child_starts_with_the_cache_on(shm, dear_hits):
    # The parent's verdict was on its own work: a child forked after it
    # weighs its own (and, the sample being cached, hits).
    import multiprocessing

    pipe = pipeline(shm)
    with pytest.warns(_cache.CacheWarning):
        hashes(pipe)
    assert pipe.cache_stats()["off"] is not None
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_child_lookup, args=(pipe, q))
    child.start()
    got = q.get(timeout=60)
    child.join(60)
    assert got == (False, None, True) and child.exitcode == 0
    assert pipe.cache_stats()["off"] is not None  # the parent's stays off
    pipe.close()


def test_cache_auto_off_is_a_bool(shm):
    with pytest.raises(TypeError, match="cache_auto_off must be True or False"):
        pipeline(shm, cache_auto_off="no")


def test_cache_auto_off_false_keeps_a_cache_that_does_not_pay(shm):
    src = Counting(N)
    pipe = pipeline(shm, src, cache_auto_off=False)
    assert hashes(pipe) == reference()
    stats = pipe.cache_stats()
    assert stats["off"] is None and stats["hits"] == (EPOCHS - 1) * N and len(src.loaded) == N
    pipe.close()


def segment_after(shm, workers, **kw) -> tuple[int, int]:
    """After EPOCHS epochs of a cheap pipeline with workers, while they
    live: the segment's hits, and how many processes hold a consumer entry
    (each worker registers one, and gives it back when it turns the cache
    off)."""
    pipe = pipeline(shm, workers=workers, **kw)
    assert hashes(pipe) == reference()
    seg = pipe._stages.cache.store._segment()
    hits, holders = seg.totals()["hits"], len(seg.consumers())
    pipe.close()
    return hits, holders


def segment_hits(shm, workers, **kw) -> int:
    return segment_after(shm, workers, **kw)[0]


def test_each_worker_weighs_its_own_share(shm, dear_hits):
    kept_hits, kept_holders = segment_after(shm, 2, cache_auto_off=False)
    with warnings.catch_warnings():
        # -W error, which the forked workers inherit: turning the cache off
        # must not fail them for it.
        warnings.simplefilter("error", _cache.CacheWarning)
        hits, holders = segment_after(shm, 2)
    # Kept on, epochs 1-3 hit and both workers hold an entry to the end;
    # turned off by each worker after epoch 1, only epoch 1 hits (a worker
    # still in epoch 1 may hit a little more) and no worker holds one: a
    # worker that never decided would. The hits alone cannot tell: the two
    # workers' shares differ (112 and 104 samples an epoch), and the
    # smaller one left on stays under 2 * N.
    assert kept_hits >= (EPOCHS - 1) * N * 0.9 and kept_holders == 2
    assert N * 0.9 <= hits < 2 * N
    assert holders == 0


def test_a_cheap_read_on_io_threads_turns_it_off(shm, dear_hits):
    # With io_threads (in a worker) the read runs on threads and is timed there.
    hits = segment_hits(shm, 1, read=identity, io_threads=2)
    assert N * 0.9 <= hits < 2 * N


def test_spawned_workers_keep_cache_auto_off(shm):
    # The setting travels to spawned workers (pickled with the cache).
    assert segment_hits(shm, 2, start_method="spawn", cache_auto_off=False) >= (EPOCHS - 1) * N * 0.9


def test_a_process_whose_first_call_is_an_insert_still_skips_its_first_epoch(shm):
    # A direct user of the cache (not a Pipeline's stages) may insert
    # before it looks anything up: its first epoch is its first lookup's.
    pipe = pipeline(shm)
    cache = pipe._stages.cache
    cache.insert(0, Numbers(N)[0], cost_ns=1000)
    cache.lookup(3, 1)
    assert (cache._ledger.epoch, cache._ledger.first) == (3, True)
    cache.lookup(4, 1)
    assert (cache._ledger.epoch, cache._ledger.first) == (4, False)
    pipe.close()
