"""The autosize section: Pipeline(workers="auto") against hand-set worker counts (bench/autosize.py)."""

from __future__ import annotations


def autosize_md(r: dict) -> list[str]:
    import autosize

    L = ['## Pipeline workers="auto" against hand-set counts', ""]
    L += [
        f"`bench/autosize.py`: batches of {r['batch']}; the I/O-bound source sleeps {r['read_ms']:g} ms per "
        f"sample in `read`, the decode-bound one spends {r['decode_ms']:g} ms of CPU per sample in `decode`; "
        f"cpu_budget {r['budget']}. Hand-set: {r['seconds']:g} s each after a 1 s warm-up, median of "
        f"{r['repeats']}; auto from a cold start, its rate over its last {r['tail']:g} s against the best "
        f"hand-set one of the same run. {autosize.NOTES}",
        "",
    ]
    L += autosize.table(r)
    L += [""]
    return L
