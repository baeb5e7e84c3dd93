"""Helpers of the cache tests (a module of its own so that both test
files and the processes they fork can use them)."""

from __future__ import annotations

import queue
import time


def collect(q, procs, timeout: float = 120) -> list:
    """One result from each process, failing at once if one dies first."""
    out, deadline = [], time.monotonic() + timeout
    while len(out) < len(procs):
        try:
            out.append(q.get(timeout=0.5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead and time.monotonic() < deadline, f"a process failed: exit codes {dead}"
    return out


def run_and_collect(q, procs, timeout: float = 120) -> list:
    """Starts `procs`, takes one result from each (collect), and waits for
    each to exit cleanly."""
    for p in procs:
        p.start()
    out = collect(q, procs, timeout)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0, f"a process exited with {p.exitcode}"
    return out
