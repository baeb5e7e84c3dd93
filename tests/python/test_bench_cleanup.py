"""The benchmarks' helper processes die with them (review 1, item 7): a
killed bench/python_consumer.py used to leave its producer child publishing
for ever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(w) for w in text.split()]


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_killed_python_consumer_bench_takes_its_producer_along():
    bench = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "python_consumer.py"), "--quick", "--outputs", "numpy"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    channel = Path(f"/dev/shm/tsock.bench-py-{bench.pid}")
    child = None
    try:
        assert _wait(lambda: channel.exists() and _children(bench.pid), 120), "the producer child started"
        child = _children(bench.pid)[0]
        bench.send_signal(signal.SIGKILL)
        bench.wait()
        assert _wait(lambda: not _running(child), 60), "the producer child outlived the killed benchmark"
        # It was told with SIGINT: it closed its channel, which removes it.
        assert _wait(lambda: not channel.exists(), 10), "the channel was removed"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        if child is not None and _running(child):
            os.kill(child, signal.SIGKILL)
        channel.unlink(missing_ok=True)
