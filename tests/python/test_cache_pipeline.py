"""Pipeline(cache_bytes=...): the decoded-sample cache inside a pipeline.
Batches are byte-identical with and without it, whatever the workers;
pipelines and processes that decode the same data share it by sample
index; a bad segment or an uncacheable sample costs the cache, never the
batches."""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import warnings

import numpy as np
import pytest
import tsock
from pipeline_helpers import Counting, Numbers, batch_hash, noisy
from tsock import _cache_store

FORK = mp.get_context("fork")
N = 40


def hashes(pipe, epochs=3) -> list:
    return [batch_hash(b) for e in range(epochs) for b in pipe.batches(e)]


def cached(shm, source=None, **kw) -> tsock.Pipeline:
    kw.setdefault("augment", noisy)
    kw.setdefault("seed", 11)
    kw.setdefault("cache_bytes", 1 << 20)
    return tsock.Pipeline(source if source is not None else Numbers(N), batch_size=4, cache_dir=shm, **kw)


def reference(epochs=3, **kw) -> list:
    kw.setdefault("augment", noisy)
    kw.setdefault("seed", 11)
    return hashes(tsock.Pipeline(Numbers(N), batch_size=4, **kw), epochs)


# ---- determinism ----


def test_with_the_cache_the_batches_are_the_same_bytes_and_loaded_once(shm):
    src = Counting(N)
    pipe = cached(shm, src)
    assert hashes(pipe) == reference()
    assert len(src.loaded) == N  # epoch 0 loaded each sample once; epochs 1 and 2 came from the cache
    stats = pipe.cache_stats()
    assert stats["hits"] == 2 * N and stats["inserts"] == N
    pipe.close()


@pytest.mark.parametrize("policy", _cache_store.POLICIES)
def test_a_cache_smaller_than_the_dataset_changes_no_byte(shm, policy):
    src = Counting(N)
    # Room for about a quarter of the samples (one 4 KiB block each).
    budget = _cache_store.geometry(N, 4096, N // 4)["file_bytes"]
    pipe = cached(shm, src, cache_bytes=budget, cache_policy=policy)
    assert hashes(pipe, 4) == reference(4)
    stats = pipe.cache_stats()
    assert 0 < stats["hits"] and len(src.loaded) == 4 * N - stats["hits"]
    assert os.path.getsize(pipe._stages.cache.store.path) <= budget
    pipe.close()


def test_with_workers_the_batches_are_the_same_bytes(shm):
    pipe = cached(shm, workers=2)
    assert hashes(pipe) == reference()
    pipe.close()
    seg = _reader(shm, pipe)
    assert seg["hits"] >= 2 * N - 8 and seg["inserts"] == N  # two workers may both miss a sample at once


def test_with_spawned_workers_the_cache_travels_with_the_stages(shm):
    pipe = cached(shm, workers=2, start_method="spawn")
    assert hashes(pipe, 2) == reference(2)
    pipe.close()
    assert _reader(shm, pipe)["hits"] > 0


def _reader(shm, pipe) -> dict:
    """The segment's totals, read by a store of this process."""
    s = _cache_store.CacheStore(pipe.cache_key(), N, directory=shm)
    s.get(0)
    totals = s.stats()["segment"]
    s.close()
    return totals


# ---- sharing ----


def test_pipelines_differing_in_seed_augment_or_batching_share_the_cache(shm):
    a = cached(shm, Counting(N))
    b = cached(shm, Counting(N), seed=99, augment=None, drop_last=True)
    assert a.cache_key() == b.cache_key() and a.fingerprint != b.fingerprint
    hashes(a, 1)
    hashes(b, 1)
    assert b._stages.source.loaded == []  # every sample decoded by a
    assert b.cache_stats()["hits"] == N
    assert hashes(b, 2) == reference(2, seed=99, augment=None, drop_last=True)


def decode_twice(sample):
    x, y = sample
    return x * 2, y


def test_another_decode_or_version_is_another_cache(shm):
    base = cached(shm).cache_key()
    assert cached(shm, decode=decode_twice).cache_key() != base
    assert cached(shm, version="v2").cache_key() != base
    assert cached(shm, Numbers(N + 1)).cache_key() != base


def _own_pipeline(shm: str, seed: int, q) -> None:
    src = Counting(N)
    pipe = cached(shm, src, seed=seed)
    q.put((hashes(pipe, 1), len(src.loaded), pipe.cache_stats()["hits"]))


def test_trainers_running_their_own_pipelines_share_the_cache_by_index(shm):
    q = FORK.Queue()
    got = []
    for seed in (1, 2):  # one after the other: the second finds every sample
        p = FORK.Process(target=_own_pipeline, args=(shm, seed, q))
        p.start()
        got.append(q.get(timeout=120))
        p.join(30)
        assert p.exitcode == 0
    (h1, loaded1, hits1), (h2, loaded2, hits2) = got
    assert (loaded1, hits1) == (N, 0) and (loaded2, hits2) == (0, N)
    assert h1 == reference(1, seed=1) and h2 == reference(1, seed=2)


# ---- failures cost the cache, not the batches ----


def _hold(path: str, ready, stop) -> None:
    fd = os.open(path, os.O_RDWR)
    _cache_store._lock(fd, _cache_store.fcntl.F_RDLCK, _cache_store.USERS_BYTE, wait=True)
    ready.set()
    stop.wait(120)


def test_a_foreign_segment_in_use_is_a_warning_and_the_batches_are_computed(shm):
    pipe = cached(shm)
    path = _cache_store.segment_path(pipe.cache_key(), shm)
    with open(path, "wb") as f:
        f.write(b"not a cache" * 1000)
    ready, stop = FORK.Event(), FORK.Event()
    p = FORK.Process(target=_hold, args=(path, ready, stop))
    p.start()
    try:
        assert ready.wait(60)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert hashes(pipe, 2) == reference(2)
        messages = [str(w.message) for w in caught]
        assert (
            len(messages) == 1 and "cache is off in this process" in messages[0] and "not a tsock cache" in messages[0]
        )
    finally:
        stop.set()
        p.join(30)


def test_a_sample_whose_bytes_were_damaged_is_computed_again(shm):
    pipe = cached(shm)
    hashes(pipe, 1)
    seg = pipe._stages.cache.store._segment()
    _, _, first, _ = seg.entry(7)
    seg.arena[first, :8] = np.frombuffer(b"garbage!", np.uint8)  # the codec's magic
    assert hashes(pipe, 3) == reference(3)
    stats = pipe.cache_stats()
    # Epochs 0-2 again: every lookup a hit but the damaged one, which was
    # computed and cached again.
    assert (stats["corrupt"], stats["hits"], stats["misses"], stats["inserts"]) == (1, 3 * N - 1, N + 1, N + 1)


Pair = collections.namedtuple("Pair", "x y")


class Named(Numbers):
    """Samples the cache does not store (a namedtuple)."""

    def __getitem__(self, i):
        return Pair(*super().__getitem__(i))


def keep(sample, rng):
    return sample


def test_uncacheable_samples_are_computed_every_time(shm):
    pipe = cached(shm, Named(N), augment=keep)
    plain = tsock.Pipeline(Named(N), batch_size=4, augment=keep, seed=11)
    assert hashes(pipe, 2) == hashes(plain, 2)
    assert pipe.cache_stats()["uncacheable"] == 2 * N
    assert os.listdir(shm) == []  # nothing was ever stored: no segment


def test_cache_arguments_are_checked(shm):
    with pytest.raises(ValueError, match="cache_bytes must be in 1.."):
        cached(shm, cache_bytes=0)
    with pytest.raises(TypeError, match="cache_bytes must be an int"):
        cached(shm, cache_bytes="lots")
    with pytest.raises(ValueError, match="cache_policy must be one of"):
        cached(shm, cache_policy="random")
    assert cached(shm, cache_bytes=None)._stages.cache is None
