"""Helpers shared by the sections: number formats, Markdown tables, row look-ups."""

from __future__ import annotations

MiB = 1 << 20


def num(x: float, nd: int = 2) -> str:
    """A figure: n/a for none, no decimals from 100 up, nd decimals below."""
    if x is None:
        return "n/a"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{nd}f}"


def ratio(a: float, b: float) -> str:
    """a / b as "1.23x" (n/a when either is missing or zero)."""
    return "n/a" if not a or not b else f"{a / b:.2f}x"


def size_label(b: int) -> str:
    """A byte count in KiB or MiB."""
    return f"{b // MiB} MiB" if b >= MiB else f"{b // 1024} KiB"


def table(head: list[str], rows: list[list], left: int = 1) -> str:
    """A Markdown table; the first `left` columns are text, the others numbers."""
    out = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join(" --- " if i < left else " ---: " for i in range(len(head))) + "|",
    ]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def one_line(value) -> str:
    """value's text on one line: a failure's text may quote a child's
    output, whose newlines would end a table row or a list item."""
    return " ".join(str(value).split())


def cell(value) -> str:
    """value as one Markdown table cell: one line, its backslashes and pipes
    escaped (a backslash before a pipe would otherwise undo its escape)."""
    return one_line(value).replace("\\", "\\\\").replace("|", "\\|")


def latency_row(t: dict, transport: str, mode: str, readers: int) -> dict | None:
    """The latency row of transport, mode and readers that did not fail, if any."""
    for r in t["latency"]:
        if (r["transport"], r["mode"], r["readers"]) == (transport, mode, readers) and not r.get("error"):
            return r
    return None


def throughput_row(t: dict, transport: str, readers: int, size: int, touch: bool) -> dict | None:
    """The throughput row of these settings that did not fail, if any."""
    for r in t["throughput"]:
        if (r["transport"], r["readers"], r["bytes"], r["touch"]) == (transport, readers, size, touch) and not r.get(
            "error"
        ):
            return r
    return None


def e2e_run(e: dict, system: str, k: int) -> dict | None:
    """The end-to-end run of system at K trainers, if any."""
    for r in e["runs"]:
        if (r["system"], r["k"]) == (system, k):
            return r
    return None


def pipeline_row(p: dict, system: str) -> dict | None:
    """The input pipeline's row of system, if any."""
    return next((r for r in p.get("systems", []) if r["system"] == system), None)
