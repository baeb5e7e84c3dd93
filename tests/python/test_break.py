"""A for-loop that breaks off (issue 12, item 2): as with a DataLoader, the
next iter() starts the next epoch and the rest of the broken one is never
delivered; carry_over=True keeps the old behaviour (the next loop goes on where
the last one stopped). Whole and re-batched batches, a kept batch of the
broken epoch, stale and spent iterators."""

import numpy as np
import pytest
import tsock

ROWS = 4


def numbered(n_batches, rows=ROWS):
    """Batch i: one int64 leaf [rows] with the sample ids rows*i .. rows*i+rows-1."""
    return [(np.arange(rows, dtype=np.int64) + rows * i,) for i in range(n_batches)]


def first_ids(batches):
    return [int(b[0][0]) for b in batches]


def take(it, n):
    return [next(it) for _ in range(n)]


def test_a_broken_loop_drops_the_rest_of_its_epoch(channel, run_producer):
    t = run_producer(tsock.Producer(numbered(5), channel, slots=4, wait_readers=1), epochs=3)
    with tsock.Consumer(channel, timeout=10) as c:
        for i, _ in enumerate(c):
            if i == 1:
                break  # a step limit, a debug break
        assert c.epoch == 0 and c.producer_epoch == 0
        assert first_ids(c) == [0, 4, 8, 12, 16]  # epoch 1, from its first batch
        assert c.epoch == 2 and c.producer_epoch == 1
        got = []
        for (y,) in c:
            got.append(int(y[0]))
            if len(got) == 5:
                break  # after the last batch, before StopIteration
        assert got == [0, 4, 8, 12, 16]
        with pytest.raises(tsock.ChannelClosed):  # nothing of epoch 2 is skipped: it was whole
            next(iter(c))
    t.join()


def test_carry_over_keeps_the_rest_for_the_next_loop(channel, run_producer):
    t = run_producer(tsock.Producer(numbered(5), channel, slots=4, wait_readers=1), epochs=2)
    with tsock.Consumer(channel, timeout=10, carry_over=True) as c:
        for i, _ in enumerate(c):
            if i == 1:
                break
        assert first_ids(c) == [8, 12, 16]  # the rest of epoch 0
        assert first_ids(c) == [0, 4, 8, 12, 16]
    t.join()


def test_next_goes_on_with_the_epoch_in_progress(channel, run_producer):
    t = run_producer(tsock.Producer(numbered(5), channel, slots=4, wait_readers=1), epochs=2)
    with tsock.Consumer(channel, timeout=10) as c:
        for i, _ in enumerate(c):
            if i == 1:
                break
        assert int(next(c)[0][0]) == 8  # next(consumer): the epoch in progress
        assert first_ids(c) == [0, 4, 8, 12, 16]  # a loop: the next epoch
    t.join()


def test_an_older_iterator_is_spent(channel, run_producer):
    t = run_producer(tsock.Producer(numbered(5), channel, slots=4, wait_readers=1), epochs=3)
    with tsock.Consumer(channel, timeout=10) as c:
        old = iter(c)
        iter(c)  # made and dropped before any batch: nothing is skipped
        old = iter(c)
        assert first_ids(take(old, 2)) == [0, 4]
        new = iter(c)
        with pytest.raises(StopIteration):  # a newer iter() started the next epoch
            next(old)
        assert first_ids(new) == [0, 4, 8, 12, 16]  # epoch 1
        with pytest.raises(StopIteration):  # spent at its end, as a DataLoader's iterator
            next(new)
        assert first_ids(c) == [0, 4, 8, 12, 16]  # epoch 2
    t.join()


@pytest.mark.parametrize("carry_over", [False, True])
@pytest.mark.parametrize("stop_rows", [3, 6, 20])
def test_rebatched_loops_break_off_too(channel, run_producer, carry_over, stop_rows):
    # 5 producer batches of 4 rows, 20 samples, consumer batches of 3: a loop
    # broken inside a producer batch (after [0:3]), after a batch that
    # straddles two ([3:6]), or after the last, partial one ([18:20]: the
    # epoch's end was read with it).
    t = run_producer(tsock.Producer(numbered(5), channel, slots=2, wait_readers=1), epochs=2)
    with tsock.Consumer(channel, batch_size=3, timeout=10, carry_over=carry_over) as c:
        seen = []
        for (y,) in c:
            seen += y.tolist()
            if len(seen) >= stop_rows:
                break
        assert seen == list(range(stop_rows))
        nxt = [int(v) for (y,) in c for v in y]
        if carry_over:
            assert nxt == list(range(stop_rows, 20))  # the rest of epoch 0
        else:
            assert nxt == list(range(20)), nxt  # epoch 1, whole
    t.join()


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_a_kept_batch_of_a_broken_epoch_stays_whole(channel, run_producer, output):
    data = [(np.full(1024, i, np.float32),) for i in range(6)]
    t = run_producer(tsock.Producer(data, channel, slots=2, wait_readers=1), epochs=2)
    with tsock.Consumer(channel, output=output, timeout=10) as c:
        kept = None
        for i, (x,) in enumerate(c):
            if i == 1:
                kept = x
                break
        rest = [float(x[0]) for (x,) in c]  # the next epoch, over both slots many times
        assert rest == [float(i) for i in range(6)]
        assert float(kept[0]) == 1.0 and float(kept[-1]) == 1.0
    t.join()


@pytest.mark.parametrize("batch_size", [None, 2])
def test_a_consumer_replaced_without_close_does_not_hold_the_producer(channel, batch_size):
    # c = Consumer(...) a second time drops the first without close(): once
    # nothing refers to it, it detaches at once (reference counting), not
    # at the cyclic collector's next full run, which gc.disable() (common in
    # training loops) postpones for good; the producer, gated by its
    # slowest reader, would wait for it.
    import gc

    gc.disable()
    try:
        with tsock.Producer(None, channel, slots=2, timeout=10) as p:
            p.publish(np.zeros((4, 1)))  # creates the channel
            c = tsock.Consumer(channel, start="now", timeout=10, batch_size=batch_size)
            c = tsock.Consumer(channel, start="now", timeout=10, batch_size=batch_size)
            it = iter(c)
            per_batch = 1 if batch_size is None else 4 // batch_size
            for i in range(6):  # more than the ring holds: the first consumer must be gone
                p.publish(np.full((4, 1), i))
                for _ in range(per_batch):
                    assert (next(it) == i).all()
            c.close()
    finally:
        gc.enable()
