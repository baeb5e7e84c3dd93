"""The resume section: tsock's state against torchdata's StatefulDataLoader (bench/resume.py)."""

from __future__ import annotations


def resume_md(r: dict) -> list[str]:
    import resume

    version = r.get("torchdata_version", "?")
    L = ["## Resume against StatefulDataLoader", ""]
    L += [
        f"`bench/resume.py`: a consumer's state against torchdata {version}'s `StatefulDataLoader`, same run, "
        f"{r['samples']} samples, batches of {r['batch']}, {r['workers']} workers. {r['notes']} Per step: steps/s "
        "with resume against the same loader without it (tsock: the Consumer's position tracking A/B against a "
        "no-op in one process; StatefulDataLoader: against a plain DataLoader), ratio 1.00 = free; the two "
        "alternate and the machine is shared, so read ratios within 10-20% of 1 as equal. First batch after "
        "resume: from a new loader given the state to its first batch, checked against the uninterrupted run's.",
        "",
    ]
    L += resume.table(r)
    L += [""]
    return L
