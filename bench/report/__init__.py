"""Writes docs/BENCHMARKS.md and its plots from the results of bench/run.py: the
document's frame here, one module a section."""

from __future__ import annotations

from .autosize import autosize_md
from .cache import cache_md
from .common import table
from .e2e import e2e_md
from .gpu import gpu_md
from .pipeline import pipeline_md
from .plots import plots
from .python_consumer import python_md
from .resume import resume_md
from .scaling import scaling_md
from .targets import headline, target_notes, targets
from .transport import transport_md

__all__ = ["cache_md", "gpu_md", "markdown", "plots", "targets"]


def markdown(res: dict, images: list[str], command: str) -> str:
    m = res["machine"]
    L = ["# tsock benchmarks", ""]
    L += [
        f"Produced by `{command}` in {res['seconds']:.0f} s on {m['date']}. Every figure is a ratio against a baseline "
        "measured in the same run on the same machine, as a median over repeats (or over samples, for latencies). "
        "Do not edit by hand: rerun the command.",
        "",
        "Machine: " + m["summary"] + ".",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".",
        "",
        f"Load average (1, 5, 15 min) at the start: {m['load_start']}; at the end: {m['load_end']}. "
        "Figures on a shared VM move from run to run; compare ratios.",
        "",
    ]
    earlier: dict = {}
    for section, run in sorted(res.get("earlier", {}).items()):
        how = run.get("how", "kept from an earlier run (`--merge`)")
        earlier.setdefault((run["date"], run["machine"], run["load"], how), []).append(section)
    for (date, machine, load, how), sections in earlier.items():
        L += [
            f"Sections {', '.join(sections)}: {how}, on {date}, {machine}, load "
            f"{load}; every ratio still compares figures of one run.",
            "",
        ]
    hl = headline(res)
    if hl:
        L += ["## Headline", ""]
        L.append(table(["figure", "tsock", "baseline (same run)", "tsock / baseline"], hl, 3))
        L += [""]
    rows = targets(res)
    if rows:
        L += ["## Targets", ""]
        L.append(
            table(
                ["target", "measured", "met", "note"], [[a, b, "yes" if c else "**no**", d] for a, b, c, d in rows], 4
            )
        )
        L += ["", target_notes(res), ""]
    t = res.get("transport")
    if t:
        L += transport_md(t, "latency.png" in images, "throughput.png" in images)
    p = res.get("python")
    if p:
        L += python_md(p)
    e = res.get("e2e")
    if e:
        L += e2e_md(e, "e2e.png" in images)
    if res.get("pipeline"):
        L += pipeline_md(res["pipeline"])
    if res.get("autosize") and not res["autosize"].get("skipped"):
        L += autosize_md(res["autosize"])
    if res.get("resume"):
        L += resume_md(res["resume"])
    if res.get("cache"):
        L += cache_md(res["cache"], "cache.png" in images)
    if t and (t.get("scaling") or t.get("shm") or t.get("flat")):
        L += scaling_md(t, "scaling.png" in images)
    if res.get("gpu"):
        L += gpu_md(res["gpu"])
    if res.get("fixes"):
        L += ["## Slow paths found and fixed", "", res["fixes"], ""]
    return "\n".join(L) + "\n"
