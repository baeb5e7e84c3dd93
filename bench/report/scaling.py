"""The scaling section: producer cost with readers, reading cost, shared-memory size."""

from __future__ import annotations

from .common import num, ratio, size_label, table


def scaling_md(t: dict, png: bool) -> list[str]:
    L = ["## Scaling", ""]
    sc = [r for r in t.get("scaling", []) if not r.get("error")]
    if sc:
        floor = next((r for r in sc if r["readers"] == 0), None)
        one = next((r for r in sc if r["readers"] == 1), None)
        L += [
            "Producer cost per publish against readers: paced 4 KiB batches to C readers that sleep on the futex "
            "between batches, so every publish wakes all of them; the producer thread's CPU clock "
            "(`CLOCK_THREAD_CPUTIME_ID`) around reserve + publish, median over the publishes. 0 readers is the floor: "
            "the same calls with nobody to wake.",
            "",
            table(
                ["readers", "CPU µs per publish", "/ 0 readers", "/ 1 reader", "per reader woken µs", "wall µs"],
                [
                    [
                        r["readers"],
                        num(r["cpu_us_median"]),
                        ratio(r["cpu_us_median"], floor["cpu_us_median"]) if floor else "",
                        ratio(r["cpu_us_median"], one["cpu_us_median"]) if one else "",
                        num((r["cpu_us_median"] - floor["cpu_us_median"]) / r["readers"])
                        if floor and r["readers"]
                        else "",
                        num(r["wall_us_median"]),
                    ]
                    for r in sc
                ],
            ),
            "",
        ]
        if png:
            L += ["![scaling](bench/scaling.png)", ""]
    flat = [r for r in t.get("flat", []) if not r.get("error")]
    if flat:
        one = flat[0]
        L += [
            "Flat out: the producer publishes 4 KiB batches as fast as it can to N readers (tsock's default wait), "
            "16 slots: on 2 CPUs the ring is full most of the time, so this is what back-pressure costs the "
            "producer per publish (waiting, being woken by releases, checking the readers' liveness).",
            "",
            table(
                ["readers", "publishes/s", "producer CPU µs per publish", f"/ {one['readers']} reader", "waiting µs"],
                [
                    [
                        r["readers"],
                        num(r["publishes_per_s"]),
                        num(r["cpu_us_per_publish"]),
                        ratio(r["cpu_us_per_publish"], one["cpu_us_per_publish"]),
                        num(r["backpressure_us_per_publish"]),
                    ]
                    for r in flat
                ],
            ),
            "",
        ]
    shm = [r for r in t.get("shm", []) if not r.get("error")]
    if shm:
        L += [
            "Shared memory against ring depth and batch size (64 reader records): computed by `layout.h`'s geometry, "
            "the file's size, and what tmpfs holds after every slot was written once (`st_blocks`).",
            "",
            table(
                ["slots", "slot bytes", "computed", "file size", "allocated", "file / payload", "overhead bytes"],
                [
                    [
                        r["slots"],
                        size_label(r["slot_bytes"]),
                        f"{r['computed_bytes']:,}",
                        f"{r['file_bytes']:,}",
                        f"{r['allocated_bytes']:,}",
                        f"{r['file_bytes'] / r['payload_bytes']:.4f}",
                        f"{r['file_bytes'] - r['payload_bytes']:,}",
                    ]
                    for r in shm
                ],
            ),
            "",
            "Size = 4 KiB header + roster (64 × 128 B, page-rounded) + slots × 2,752 B of descriptors "
            "(page-rounded) + slots × slot bytes: the overhead is fixed per slot and per reader, independent of the "
            "batch size.",
            "",
        ]
    return L
