"""The resume section: tsock's state against torchdata's StatefulDataLoader (bench/resume.py)."""

from __future__ import annotations


def resume_md(r: dict) -> list[str]:
    import resume

    version = r.get("torchdata_version", "?")
    L = ["## Resume against StatefulDataLoader", ""]
    L += [
        f"`bench/resume.py`: a consumer's state against torchdata {version}'s `StatefulDataLoader`, same run, "
        f"{r['samples']} samples, batches of {r['batch']}, {r['workers']} workers. {r['notes']} Per step, what "
        "having resume costs (1.00 = free): tsock, the Consumer's time per `next()` with the ring full (the "
        "producer ahead, so the consumer's own work is what is timed), its position tracking against a no-op in "
        "its place, alternated round by round in one consumer (the fastest round of each); StatefulDataLoader, "
        "its time per step over a run of steps against a plain DataLoader's, medians of 3 alternated runs (the "
        "loaders are pipeline-bound: what a trainer sees). The machine is shared: read ratios within 10-20% of 1 "
        "as equal. First batch after resume: from a new loader given the state to its first batch, checked "
        "against the uninterrupted run's.",
        "",
    ]
    L += resume.table(r)
    L += [""]
    return L
