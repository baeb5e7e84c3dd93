"""Failures a user can cause get typed exceptions with clear messages."""

import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tsock
from tsock import _capi


def segment(name):
    return Path("/dev/shm") / f"tsock.{name}"


def test_missing_channel_fails_at_once_with_timeout_zero(channel):
    t0 = time.monotonic()
    with pytest.raises(tsock.ChannelNotFound, match=channel) as err:
        tsock.Consumer(channel, timeout=0)
    # At once, not after a wait: the bound only tells the two apart
    # (loading the library on a loaded machine can take a while).
    assert time.monotonic() - t0 < 5
    assert err.value.status == _capi.ENOENT
    assert "producer running" in str(err.value)


def test_missing_channel_fails_after_the_timeout(channel):
    t0 = time.monotonic()
    with pytest.raises(tsock.ChannelNotFound, match="after waiting 0.3 s"):
        tsock.Consumer(channel, timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 10  # the 0.3 s, not the default wait


WAITING_TRAINER = """
import sys, tsock
try:  # report the wait sooner than the default 5 s, to keep the test short
    import tsock._waiting as waiting
    waiting.FIRST_S = waiting.EVERY_S = 0.5
except ImportError:
    pass
with tsock.Consumer(sys.argv[1]) as c:  # the default timeout
    print(sum(int(x[0]) for (x,) in c), flush=True)
"""


def test_consumer_waits_for_a_late_producer_by_default_and_says_so(channel, spawn):
    # A trainer started before its producer (a sweep; a dataset whose set-up
    # takes minutes) waits, printing its progress, instead of failing.
    trainer = spawn(WAITING_TRAINER, channel)
    line = trainer.stderr.readline()  # blocks until the trainer reports, or dies
    assert f"waiting for the producer of channel '{channel}' to start" in line, line + trainer.stderr.read()
    assert "no time limit" in line
    assert trainer.poll() is None
    with tsock.Producer([(np.full(2, i),) for i in range(4)], channel, wait_readers=1) as p:
        p.run()
    out, err = trainer.communicate(timeout=60)
    assert trainer.returncode == 0, err
    assert out.strip() == "6"
    assert f"channel '{channel}' found after" in err


def test_consumer_waits_for_a_channel_that_appears(channel):
    p = tsock.Producer(None, channel)
    timer = threading.Timer(0.3, lambda: p.publish((np.zeros(2),)))
    timer.start()
    try:
        with tsock.Consumer(channel, start="now", timeout=10) as c:
            assert c._reader.handle is not None
    finally:
        timer.join()
        p.close()


@pytest.mark.parametrize("name", ["", "a/b", "../x", ".", "..", "x" * 65, "spa ce", "é"])
def test_bad_names(name):
    with pytest.raises(tsock.TsockError) as err:
        tsock.Producer(None, name)
    assert err.value.status == _capi.ENAME
    with pytest.raises(tsock.TsockError) as err:
        tsock.Consumer(name, timeout=0)
    assert err.value.status == _capi.ENAME


@pytest.mark.parametrize(
    "kwargs",
    [
        {"slots": 3},
        {"slots": 1},
        {"slots": "16"},
        {"headroom": 0.5},
        {"slot_bytes": 0},
        {"join_window": -1},
        {"max_readers": 0},
        {"wait_readers": -2},
        {"timeout": -1},
        {"evict_after": 0},
    ],
)
def test_bad_producer_options(channel, kwargs):
    with pytest.raises(ValueError):
        tsock.Producer(None, channel, **kwargs)


@pytest.mark.parametrize("kwargs", [{"output": "pandas"}, {"start": "later"}, {"timeout": -1}])
def test_bad_consumer_options(channel, kwargs):
    with pytest.raises(ValueError):
        tsock.Consumer(channel, **{"timeout": 0, **kwargs})


def test_wrong_types():
    with pytest.raises(TypeError):
        tsock.Producer(None, 42)
    with pytest.raises(TypeError):
        tsock.Consumer(b"bytes-name", timeout=0)


def test_second_live_producer_on_a_name(channel):
    with tsock.Producer(None, channel) as a, tsock.Producer(None, channel) as b:
        a.publish((np.zeros(1),))
        with pytest.raises(tsock.TsockError) as err:
            b.publish((np.zeros(1),))
        assert err.value.status == _capi.EEXIST


def test_oversize_batch_names_sizes_and_the_fix(channel):
    with tsock.Producer(None, channel, headroom=1.0) as p:
        p.publish((np.zeros(1000, np.float32),))  # slots sized 4096 bytes
        with pytest.raises(tsock.BatchTooLarge) as err:
            p.publish((np.zeros(2000, np.float32),))
        msg = str(err.value)
        assert "8000 bytes" in msg and "4096 bytes" in msg and "slot_bytes" in msg
        assert isinstance(err.value, ValueError) and err.value.status == _capi.ETOOBIG
        p.publish((np.zeros(1000, np.float32),))  # the channel goes on
    with tsock.Producer(None, channel + "b", slot_bytes=1 << 16) as p:
        p.publish((np.zeros(10),))
        p.publish((np.zeros(8000),))  # sized by hand: fits


def test_too_many_tensors(channel):
    with tsock.Producer(None, channel) as p, pytest.raises(tsock.BatchTooLarge, match="at most 16"):
        p.publish(tuple(np.zeros(1) for _ in range(17)))


def test_too_many_dimensions(channel):
    with tsock.Producer(None, channel) as p, pytest.raises(tsock.UnsupportedDtype, match="9 dimensions"):
        p.publish((np.zeros((1,) * 9),))


def _copy_segment(channel, dst, patch):
    """A copy of a live channel's segment under another name, patched."""
    with tsock.Producer(None, channel) as p:
        p.publish((np.zeros(4),))
        shutil.copyfile(segment(channel), segment(dst))
    data = bytearray(segment(dst).read_bytes())
    data = patch(data)
    segment(dst).write_bytes(bytes(data))


def test_layout_version_mismatch(channel):
    dst = channel + "-v"

    def bump_version(data):
        data[8:12] = (99).to_bytes(4, "little")  # tsock_header.layout_version
        return data

    try:
        _copy_segment(channel, dst, bump_version)
        with pytest.raises(tsock.LayoutMismatch, match="version 99") as err:
            tsock.Consumer(dst, timeout=0)
        assert err.value.status == _capi.EVERSION
    finally:
        segment(dst).unlink(missing_ok=True)


@pytest.mark.parametrize("how", ["magic", "truncated"])
def test_corrupt_segment(channel, how):
    dst = channel + "-c"

    def damage(data):
        if how == "magic":
            data[0:8] = b"NOTTSOCK"
            return data
        return data[: len(data) // 2]

    try:
        _copy_segment(channel, dst, damage)
        with pytest.raises(tsock.CorruptSegment, match="magic" if how == "magic" else "truncated"):
            tsock.Consumer(dst, timeout=0)
    finally:
        segment(dst).unlink(missing_ok=True)


def test_slow_reader_evicted_by_opt_in_policy(channel):
    p = tsock.Producer(None, channel, slots=2, evict_after=0.05)
    p.publish((np.zeros(2),))
    c = tsock.Consumer(channel, start="now", timeout=30)
    try:
        for _ in range(4):  # the ring fills; the idle consumer is evicted
            p.publish((np.zeros(2),))
        assert p.stats()["readers_evicted"] == 1
        with pytest.raises(tsock.Evicted, match="evicted"):
            next(c)
    finally:
        c.close()
        p.close()


def test_producer_timeout_when_a_reader_holds_the_ring(channel):
    p = tsock.Producer(None, channel, slots=2, timeout=0.2)
    p.publish((np.zeros(2),))
    c = tsock.Consumer(channel, start="now", timeout=30)
    try:
        p.publish((np.zeros(2),))
        p.publish((np.zeros(2),))
        t0 = time.monotonic()
        with pytest.raises(tsock.TsockError, match="timed out") as err:
            p.publish((np.zeros(2),))
        assert err.value.status == _capi.ETIMEDOUT
        assert 0.2 <= time.monotonic() - t0 < 10  # the 0.2 s, not the default: for ever
        next(c)
        next(c)  # reading frees the ring
        p.publish((np.zeros(2),))
    finally:
        c.close()
        p.close()


def test_closed_consumer(channel):
    with tsock.Producer(None, channel) as p:
        p.publish((np.zeros(1),))
        c = tsock.Consumer(channel, start="now", timeout=30)
        c.close()
        c.close()
        assert c.closed
        with pytest.raises(tsock.TsockError, match="closed"):
            next(c)
