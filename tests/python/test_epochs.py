"""Epochs and lengths: one for-loop is one epoch, StopIteration at its end,
len() from the producer's loader, ChannelClosed once the producer is done."""

import numpy as np
import pytest
import torch
import tsock
from torch.utils.data import DataLoader, TensorDataset


def numbered(n_batches, rows=4):
    return [(np.arange(rows, dtype=np.int64) + rows * i,) for i in range(n_batches)]


def test_one_for_loop_is_one_epoch(channel, run_producer):
    p = tsock.Producer(numbered(5), channel, slots=4, wait_readers=1)
    t = run_producer(p, epochs=3)
    with tsock.Consumer(channel, timeout=10) as c:
        assert c.epoch == 0 and len(c) == 5
        for epoch in range(3):
            ids = [int(y[0]) for (y,) in c]
            assert ids == [0, 4, 8, 12, 16]
            assert c.epoch == epoch + 1
            assert c.producer_epoch == epoch
        # The producer closed after three epochs: asking for a fourth says so,
        # in words (not a count of batches that includes epoch-end markers).
        with pytest.raises(tsock.ChannelClosed) as closed:
            next(iter(c))
        message = str(closed.value)
        assert f"channel '{channel}': the producer closed it after its last epoch" in message
        assert "read every batch it published (3 epochs here)" in message
        # 15 batches and 3 epoch-end markers; the channel's name holds this
        # process's pid, which may contain "18" (seen in CI: pt-21886-36).
        assert "18" not in message.replace(channel, "")
    t.join()


def test_len_follows_a_torch_dataloader(channel, run_producer):
    ds = TensorDataset(torch.arange(50), torch.arange(50).float())
    for drop_last, want in ((False, 7), (True, 6)):
        loader = DataLoader(ds, batch_size=8, drop_last=drop_last)
        name = f"{channel}-{drop_last}"
        run_producer(tsock.Producer(loader, name, wait_readers=1))
        with tsock.Consumer(name, output="torch", timeout=10) as c:
            assert len(c) == want
            seen = [b[0].tolist() for b in c]
            assert len(seen) == want
            assert sum(seen, []) == list(range(48 if drop_last else 50))


def test_len_needs_a_loader_with_len(channel, run_producer):
    def gen():
        yield from numbered(3)

    run_producer(tsock.Producer(gen(), channel, wait_readers=1))
    with tsock.Consumer(channel, timeout=10) as c:
        with pytest.raises(TypeError, match="no len"):
            len(c)
        assert len(list(c)) == 3  # the peeked batch is not lost


def test_len_without_sample_count_for_rebatching(channel, run_producer):
    class Sized:
        def __iter__(self):
            return iter(numbered(3))

        def __len__(self):
            return 3

    run_producer(tsock.Producer(Sized(), channel, wait_readers=2))
    with tsock.Consumer(channel, timeout=10) as c, tsock.Consumer(channel, batch_size=5, timeout=10) as r:
        assert len(c) == 3
        with pytest.raises(TypeError, match="number of samples"):
            len(r)


def test_close_mid_epoch_ends_that_epoch(channel):
    p = tsock.Producer(None, channel)
    for b in numbered(3):
        p.publish(b)
    c = tsock.Consumer(channel, start="now", timeout=10)
    p.publish(numbered(4)[3])
    p.close()
    with c:
        assert [int(y[0]) for (y,) in c] == [12]
        assert c.epoch == 1
        with pytest.raises(tsock.ChannelClosed):
            next(c)


def test_producer_stats_and_manual_publishing(channel):
    with tsock.Producer(None, channel, slots=8) as p:
        assert p.stats()["published"] == 0
        for b in numbered(3):
            p.publish(b)
        with tsock.Consumer(channel, start="now", timeout=30) as c:
            assert p.stats()["readers"] == 1
            p.end_epoch()
            p.publish(numbered(1)[0])
            p.end_epoch()
            assert [int(y[0]) for (y,) in c] == [0]
        s = p.stats()
        assert (s["published"], s["epoch"], s["slots"]) == (6, 2, 8)
        assert s["slot_bytes"] >= 32
    with pytest.raises(tsock.TsockError, match="closed"):
        p.publish(numbered(1)[0])


def test_run_needs_a_loader(channel):
    with tsock.Producer(None, channel) as p, pytest.raises(ValueError, match="loader"):
        p.run()
