"""Process trees from /proc, for the benchmarks that count the CPU and
memory of a system's every process (its workers, trainers, producer)."""

from __future__ import annotations

import os


def children() -> dict[int, list[int]]:
    """Every process's children, by parent pid (one pass over /proc)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(root: int) -> list[int]:
    """The live processes below `root`."""
    kids, out, todo = children(), [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out
