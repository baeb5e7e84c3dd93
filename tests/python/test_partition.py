"""Consumer(rank=, world_size=) on a partitioned channel (a tsock.Pipeline
with world_size=): each rank gets exactly the samples
torch.utils.data.DistributedSampler gives it, epoch after epoch, from one
producer; a consumer that does not fit the channel's partitioning gets a
PartitionMismatch that says how, instead of wrong data or a wait for ever."""

from __future__ import annotations

import threading

import pipeline_helpers as h
import pytest
import tsock
from torch.utils.data import DistributedSampler


def _read_ranks(channel, world, epochs, **kw) -> dict:
    """{rank: [[labels of epoch e] for e]} read by one consumer per rank,
    each in its own thread, with len() checked every epoch."""
    got, errors, lens = {}, [], {}

    def read(rank):
        try:
            with tsock.Consumer(channel, rank=rank, world_size=world, timeout=30, **kw) as c:
                got[rank] = []
                for _ in range(epochs):
                    lens.setdefault(rank, []).append(len(c))
                    got[rank].append([int(v) for _, y in c for v in y])
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            errors.append(e)

    threads = [threading.Thread(target=read, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return got, lens


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
