"""Another revision's python/tsock, for benchmarks that compare this tree
with it in one run (bench/belady_cost.py, bench/cache_access.py)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def python_tree(rev: str):
    """A folder holding `rev`'s python/tsock (git archive), to put on
    PYTHONPATH instead of this tree's; removed on leaving."""
    folder = Path(tempfile.mkdtemp(prefix="tsock-rev-"))
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "python/tsock"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
        yield folder / "python"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
