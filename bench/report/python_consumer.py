"""The Python consumer section (bench/python_consumer.py)."""

from __future__ import annotations

from .common import num, ratio, table


def python_md(p: dict) -> list[str]:
    L = ["## Python consumer overhead", ""]
    L += [
        f"`bench/python_consumer.py`: a producer process fills a ring of {p['slots']} slots with batches of "
        f"{p['tensors']} float32 tensors of {p['elems']} elements; each round drains {p['per_round']} batches through "
        "`tsock.Consumer` (acquire, descriptors, zero-copy arrays or DLPack, release). Baseline: iterating an "
        "in-process list of the same arrays, unpacking each batch the same way. Median of "
        f"{p['rounds']} rounds.",
        "",
    ]
    rows = [
        [
            r["output"],
            num(r["tsock_s"] * 1e6),
            num(1 / r["tsock_s"]),
            num(r["list_s"] * 1e6, 3),
            num(1 / r["list_s"]),
            ratio(r["tsock_s"], r["list_s"]),
        ]
        for r in p["rows"]
    ]
    L.append(
        table(["output", "tsock µs/batch", "tsock batches/s", "list µs/batch", "list batches/s", "tsock / list"], rows)
    )
    L += [""]
    if p["rows"] and "step_s" in p["rows"][0]:
        L += [
            "Batch lifetimes: the same ring read side by side by a consumer with the default lifetime (a batch "
            'stays valid while referenced; the figures above) and one with `lifetime="step"` (valid until the '
            "next batch, no bookkeeping: the old contract), rounds alternating; CPU time of the consumer's thread "
            "(the ring is full, it never waits), median of the per-round ratios.",
            "",
            table(
                ["output", "default CPU µs/batch", "step CPU µs/batch", "default / step", "elapsed default / step"],
                [
                    [
                        r["output"],
                        num(r["tsock_cpu_s"] * 1e6),
                        num(r["step_cpu_s"] * 1e6),
                        f"{r['lifetime_ratio']:.3f}x",
                        f"{r['lifetime_ratio_elapsed']:.3f}x",
                    ]
                    for r in p["rows"]
                ],
            ),
            "",
        ]
    if p.get("keep"):
        L += [
            "The cost of keeping a batch (copying out a referenced batch the ring needs back): rounds that keep "
            "every batch in a list against rounds that keep none, CPU time, (kept - plain) / batches copied out.",
            "",
            table(
                ["batch", "bytes", "µs per batch kept", "GB/s"],
                [
                    [
                        f"{k['tensors']} x float32[{k['elems']}]",
                        num(k["batch_bytes"]),
                        num(k["per_keep_s"] * 1e6),
                        num(k["batch_bytes"] / k["per_keep_s"] / 1e9),
                    ]
                    for k in p["keep"].values()
                ],
            ),
            "",
        ]
    if p.get("dataloader_s"):
        L += [
            f"For scale, same run: a torch `DataLoader` over the same list (no workers, no collate) costs "
            f"{num(p['dataloader_s'] * 1e6)} µs per batch; producer and consumer streaming together move "
            f"{num(p['streaming_per_s'])} batches/s. A list iteration is a pointer bump, so the ratio is large by "
            "construction: the absolute cost, a few µs per batch, is what compares with a training step.",
            "",
        ]
    return L
