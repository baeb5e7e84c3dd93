"""Under PyTorch's profiler, a Consumer's batches show as DataLoader time:
the call is a range named "enumerate(DataLoader)#...", as a DataLoader
iterator's is, so stock profiles and TensorBoard count it as the input
step; with no profiler running nothing is recorded."""

from __future__ import annotations

import numpy as np
import pytest
import tsock
from tsock.consumer import PROFILE_NAME

torch = pytest.importorskip("torch")


def publish_numbered(p, n):
    for i in range(n):
        p.publish((np.full(4, i, np.int64),))


def test_batches_show_as_dataloader_time_under_the_profiler(channel):
    with tsock.Producer(None, channel, slots=8) as p:
        publish_numbered(p, 1)
        with tsock.Consumer(channel, start="now", output="torch", timeout=30) as c:
            publish_numbered(p, 3)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                got = [int(next(c)[0][0]) for _ in range(3)]
            assert got == [0, 1, 2]
            names = [e.name for e in prof.events()]
            assert names.count(PROFILE_NAME) == 3, sorted(set(names))
            assert PROFILE_NAME.startswith("enumerate(DataLoader)#")


def test_no_range_without_a_profiler(channel, monkeypatch):
    entered = []
    real = torch.autograd.profiler.record_function
    monkeypatch.setattr(torch.autograd.profiler, "record_function", lambda *a: entered.append(a) or real(*a))
    with tsock.Producer(None, channel, slots=8) as p:
        publish_numbered(p, 1)
        with tsock.Consumer(channel, start="now", timeout=30) as c:
            publish_numbered(p, 2)
            assert [int(next(c)[0][0]) for _ in range(2)] == [0, 1]
    assert entered == [], "no profiler range is entered when no profiler runs"
