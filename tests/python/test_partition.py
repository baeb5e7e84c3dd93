"""Consumer(rank=, world_size=) on a partitioned channel (a tsock.Pipeline
with world_size=): each rank gets exactly the samples
torch.utils.data.DistributedSampler gives it, epoch after epoch, from one
producer; a consumer that does not fit the channel's partitioning gets a
PartitionMismatch that says how, instead of wrong data or a wait for ever."""

from __future__ import annotations

import threading

import numpy as np
import pipeline_helpers as h
import pytest
import tsock
from torch.utils.data import DistributedSampler


def _each_rank(world: int, read) -> dict:
    """{rank: read(rank)} for every rank, each in its own thread (the
    consumers of one step must all be reading); the first error re-raised."""
    got, errors = {}, []

    def run(rank):
        try:
            got[rank] = read(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return got


def _read_ranks(channel, world, epochs, **kw) -> tuple[dict, dict]:
    """{rank: [[labels of epoch e] for e]} read by one consumer per rank,
    and {rank: [len() at each epoch's start]}."""

    def read(rank):
        with tsock.Consumer(channel, rank=rank, world_size=world, timeout=30, **kw) as c:
            lens, labels = [], []
            for _ in range(epochs):
                lens.append(len(c))
                labels.append([int(v) for _, y in c for v in y])
            return labels, lens

    got = _each_rank(world, read)
    return {r: v[0] for r, v in got.items()}, {r: v[1] for r, v in got.items()}


def _sampler(n, world, rank, seed, drop_last, epoch) -> list[int]:
    ds = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
    ds.set_epoch(epoch)
    return list(ds)


@pytest.mark.parametrize("n, world, drop_last", [(23, 2, False), (23, 3, True), (10, 4, False), (7, 8, False)])
def test_each_rank_gets_what_distributed_sampler_gives_it(channel, run_producer, n, world, drop_last):
    pipe = h.make_pipeline(n=n, batch_size=3, world_size=world, sampler_drop_last=drop_last, seed=5)
    try:
        t = run_producer(tsock.Producer(pipe, channel, wait_readers=world), epochs=2)
        got, lens = _read_ranks(channel, world, 2)
        t.join()
    finally:
        pipe.close()
    for rank in range(world):
        assert lens[rank] == [pipe.steps] * 2
        for epoch in range(2):
            assert got[rank][epoch] == _sampler(n, world, rank, 5, drop_last, epoch), (rank, epoch)


def test_a_re_batching_rank_gets_the_same_samples(channel, run_producer):
    pipe = h.make_pipeline(n=23, batch_size=3, world_size=2, seed=9)
    try:
        t = run_producer(tsock.Producer(pipe, channel, wait_readers=2), epochs=2)
        got, lens = _read_ranks(channel, 2, 2, batch_size=5)
        t.join()
    finally:
        pipe.close()
    for rank in range(2):
        assert lens[rank] == [3, 3]  # 12 samples of each rank (23 padded to 24): 5, 5, 2
        for epoch in range(2):
            assert got[rank][epoch] == _sampler(23, 2, rank, 9, False, epoch)


def _first_batch(channel, **kw):
    with tsock.Consumer(channel, timeout=30, **kw) as c:
        return next(iter(c))


@pytest.mark.parametrize(
    "pipeline_kw, consumer_kw, says",
    [
        ({"world_size": 2}, {}, "open it with Consumer("),
        ({}, {"rank": 0, "world_size": 2}, "is not partitioned"),
        ({"world_size": 2}, {"rank": 0, "world_size": 4}, "not world_size=4"),
        ({"world_size": 3, "ranks": (0, 1)}, {"rank": 2, "world_size": 3}, "not those of rank 2"),
    ],
    ids=["no-rank", "not-partitioned", "other-world-size", "rank-not-made"],
)
def test_a_consumer_that_does_not_fit_the_partitioning_is_told(channel, run_producer, pipeline_kw, consumer_kw, says):
    pipe = h.make_pipeline(n=23, batch_size=3, **pipeline_kw)
    try:
        run_producer(tsock.Producer(pipe, channel, wait_readers=1, timeout=30))
        with pytest.raises(tsock.PartitionMismatch, match="channel") as e:
            _first_batch(channel, **consumer_kw)
        assert says in str(e.value)
        assert isinstance(e.value, ValueError)
    finally:
        pipe.close()


def test_len_checks_the_partitioning_too(channel, run_producer):
    pipe = h.make_pipeline(n=23, batch_size=3, world_size=2)
    try:
        run_producer(tsock.Producer(pipe, channel, wait_readers=1, timeout=30))
        with tsock.Consumer(channel, timeout=30) as c, pytest.raises(tsock.PartitionMismatch):
            len(c)
    finally:
        pipe.close()


@pytest.mark.parametrize(
    "kw, error",
    [
        ({"rank": 0}, ValueError),
        ({"world_size": 2}, ValueError),
        ({"rank": 2, "world_size": 2}, ValueError),
        ({"rank": -1, "world_size": 2}, ValueError),
        ({"rank": 0, "world_size": 70000}, ValueError),
        ({"rank": True, "world_size": 2}, TypeError),
        ({"rank": 0, "world_size": 2.0}, TypeError),
    ],
)
def test_rank_arguments(kw, error):
    with pytest.raises(error):
        tsock.Consumer("no-such-channel", timeout=0, **kw)


def test_eight_ranks_read_in_place_with_the_default_lifetime(channel, run_producer):
    # A rank's batch still referenced by the loop variables holds the other
    # ranks' batches after it (the ring is released in order): the hold
    # limit counts this rank's batches only, and a partitioned producer's
    # ring has room for it, so nothing is copied (every batch was copied at
    # eight ranks before, review 23).
    world = 8
    pipe = h.make_pipeline(n=8 * 24, batch_size=4, world_size=world, seed=2)
    try:
        p = tsock.Producer(pipe, channel, wait_readers=world)
        assert p.slots == 32  # 4 per rank
        t = run_producer(p, epochs=1)

        def read(rank):
            with tsock.Consumer(channel, rank=rank, world_size=world, timeout=30) as c:
                return [int(v) for x, y in c for v in y], c._life.kept

        got = _each_rank(world, read)
        t.join()
    finally:
        pipe.close()
    for rank in range(world):
        assert got[rank] == (_sampler(8 * 24, world, rank, 2, False, 0), 0)  # 0: nothing kept


@pytest.mark.parametrize("lifetime", ["referenced", "step"])
def test_a_corrupt_tag_is_refused_and_reading_goes_on(channel, lifetime):
    # A producer whose batch 3 carries an impossible partition (rank 5 of
    # 2): CorruptSegment for that batch, then the rest. Before, the default
    # lifetime never let that batch go, and reading stopped at the hold
    # limit (review 23).
    from tsock import _structure

    good = _structure.encode("(..)", None, None)
    tag = _structure._TAG.pack(b"\0" * 16, 0, 3, 3, 1, 5, 2, 1, 0)
    bad = _structure._HEAD.pack(_structure.MAGIC_TAGGED, 20, 20) + tag + b"(..)"
    p = tsock.Producer(None, channel, wait_readers=1, slots=16, timeout=30)

    def produce():
        for i in range(20):
            p._plain_meta = lambda spec, m=(bad if i == 3 else good): m
            p.publish((np.zeros(4, np.float32), np.array([i])))
        p.end_epoch()

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    got, errors = [], 0
    try:
        with tsock.Consumer(channel, timeout=30, lifetime=lifetime) as c:
            it = iter(c)
            while True:
                try:
                    got.append(int(next(it)[1][0]))
                except StopIteration:
                    break
                except tsock.CorruptSegment:
                    errors += 1
        t.join(30)
    finally:
        p.close()
    assert errors == 1
    assert got == [i for i in range(20) if i != 3]


@pytest.mark.parametrize("start", [12, 13, 14])
def test_a_producer_resumed_mid_epoch_keeps_the_ranks_epochs_in_step(channel, run_producer, start):
    # Resumed at batch `start` of epoch 1 (3 ranks, 14 batches each... 42 in
    # all: 13 and 14 leave rank 0 no batch of epoch 1): every rank's first
    # epoch is its rest of epoch 1, empty or not, then epoch 2 whole. An
    # empty one used to merge into the next, one epoch behind the other
    # ranks (review 23).
    n, world = 40, 3
    pipe = tsock.Pipeline(h.Numbers(n), batch_size=3, world_size=world, seed=3)
    try:
        p = tsock.Producer(pipe, channel, wait_readers=world, timeout=60)
        t = threading.Thread(target=lambda: (p.run(epochs=3, start=(1, start)), p.close()), daemon=True)
        t.start()

        def read(rank):
            with tsock.Consumer(channel, rank=rank, world_size=world, timeout=30) as c:
                return [[int(v) for x, y in c for v in y] for _ in range(2)]

        got = _each_rank(world, read)
        t.join(60)
    finally:
        pipe.close()
    for rank in range(world):
        first_step = start // world + (start % world > rank)  # its first batch at or after `start`
        rest = _sampler(n, world, rank, 3, False, 1)[first_step * 3 :]
        assert got[rank] == [rest, _sampler(n, world, rank, 3, False, 2)], rank


def test_len_for_a_rank_not_made_raises(channel, run_producer):
    pipe = h.make_pipeline(n=23, batch_size=3, world_size=3, ranks=(0, 1))
    try:
        run_producer(tsock.Producer(pipe, channel, wait_readers=1, timeout=30))
        with tsock.Consumer(channel, rank=2, world_size=3, timeout=30) as c:
            with pytest.raises(tsock.PartitionMismatch, match="not those of rank 2"):
                len(c)
    finally:
        pipe.close()
