"""Late joiners: inside the producer's join_window a trainer gets the whole
current epoch; later it starts with the next epoch; start="now" starts with
the next batch."""

import numpy as np
import pytest
import tsock


def batch(epoch, i):
    return (np.array([epoch * 100 + i], dtype=np.int64),)


def ids(consumer):
    return [int(y[0]) for (y,) in consumer]


@pytest.mark.parametrize("window", [3, 0])
def test_join_inside_and_outside_the_window(channel, window):
    with tsock.Producer(None, channel, slots=16, join_window=window) as p:
        for i in range(3):
            p.publish(batch(0, i))
        early = tsock.Consumer(channel, timeout=30)  # 3 batches out: inside a window of 3
        p.publish(batch(0, 3))
        late = tsock.Consumer(channel, timeout=30)  # 4 out: outside
        now = tsock.Consumer(channel, start="now", timeout=30)
        for i in range(4, 6):
            p.publish(batch(0, i))
        p.end_epoch()
        for i in range(2):
            p.publish(batch(1, i))
        p.end_epoch()
    with early, late, now:
        if window:
            assert ids(early) == [0, 1, 2, 3, 4, 5]  # the whole epoch
            assert ids(early) == [100, 101]
        else:
            assert ids(early) == [100, 101]  # no window: the next epoch
        assert ids(late) == [100, 101]
        assert late.producer_epoch == 1
        assert ids(now) == [4, 5]  # the rest of the current epoch
        assert ids(now) == [100, 101]


def test_join_window_must_be_smaller_than_the_ring(channel):
    with pytest.raises(ValueError, match="join_window"):
        tsock.Producer(None, channel, slots=4, join_window=4)
