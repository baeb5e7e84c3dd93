"""`tsock ls` and `tsock rm --caches` (cmd/tsock/caches.go) find the
decoded-sample caches by their file name and tell one in use by the lock
byte every process using it holds: both are defined by
python/tsock/_cache_segment.py, and the Go side mirrors them. This checks
the two definitions agree (cmd/tsock's TestCaches checks the commands)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tsock import _cache_segment

GO = Path(__file__).resolve().parents[2] / "cmd" / "tsock" / "caches.go"


def _go_const(name: str) -> str:
    m = re.search(rf"^\s*{name}\s*=\s*(\S+)", GO.read_text(), re.M)
    assert m, f"{name} not found in {GO}"
    return m.group(1)


def test_the_go_tools_find_caches_by_the_name_python_gives_them():
    prefix = _go_const("cachePrefix").strip('"')
    path = _cache_segment.segment_path(bytes(16), "/dev/shm")
    assert os.path.basename(path).startswith(f"{prefix}{os.geteuid()}.")
    for fallback in _cache_segment.candidate_paths(bytes(16), "/dev/shm"):
        assert os.path.basename(fallback).startswith(f"{prefix}{os.geteuid()}.")


def test_the_go_tools_read_the_users_lock_python_takes():
    assert int(_go_const("cacheUsersByte")) == _cache_segment.USERS_BYTE
