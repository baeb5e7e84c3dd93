"""docs/ARCHITECTURE.md's folder table ("Where things live") against the
tree: every path it names exists, and every folder that holds code is
named by a row (a row naming a folder covers the folders below it)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = re.compile(r"\.(go|c|h|py|cpp|hpp|sh)$")


def table_paths() -> list[str]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    paths = []
    for row in section.splitlines():
        if row.startswith("| `"):
            first_cell = row.split("|")[1]
            paths += re.findall(r"`([^`]+)`", first_cell)
    return paths


def code_folders() -> set[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return {str(Path(f).parent) for f in files if CODE.search(f) and "testdata" not in f and "/" in f}


def test_every_path_in_the_table_exists():
    paths = table_paths()
    assert len(paths) >= 10, paths
    missing = [p for p in paths if not list(ROOT.glob(p.rstrip("/")))]
    assert not missing, f"ARCHITECTURE.md names paths the tree does not have: {missing}"


def test_every_code_folder_has_a_row():
    rows = [p.rstrip("/") for p in table_paths()]
    covered = {p if (ROOT / p).is_dir() else str(Path(p).parent) for p in rows}
    homeless = sorted(d for d in code_folders() if not any(d == c or d.startswith(c + "/") for c in covered))
    assert not homeless, f"folders with code that ARCHITECTURE.md's folder table does not name: {homeless}"
