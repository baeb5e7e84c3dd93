"""The cache section: K trainers' sweep with the decoded-sample cache (bench/cache_sweep.py)."""

from __future__ import annotations

from .common import num, one_line, table

SOURCE_TITLES = {
    "decode": "decode-bound (JPEG decoded with PIL)",
    "io": "I/O-bound (reads through a modelled network file system, light decode)",
}


def cache_run(c: dict, source: str, system: str) -> dict | None:
    """The run of system on source, if it did not fail."""
    return next((r for r in c["runs"] if (r["source"], r["system"]) == (source, system)), None)


def goal(c: dict, source: str = "decode") -> tuple[dict, dict] | None:
    """(tsock+belady@50, dataloader) on `source`, if both ran."""
    b, d = cache_run(c, source, "tsock+belady@50"), cache_run(c, source, "dataloader")
    return (b, d) if b and d else None


def cache_md(c: dict, png: bool) -> list[str]:
    m = c["io_model"]
    L = ["## Decoded-sample cache in a sweep of K trainers", ""]
    L += [
        f"`bench/cache_sweep.py` (issue 15, part 4): K = {c['k']} trainers run at once for {c['epochs']} epochs over "
        f"{c['images']} JPEGs of {c['side']}×{c['side']} ({c['file_bytes'] / 2**20:.1f} MiB of files, "
        f"{c['decoded_bytes'] / 2**20:.1f} MiB decoded), batches of {c['batch']}, shuffled. A trainer reads every "
        "batch (sums it) and does nothing else. The worker budget is the same for every system: "
        f"{c['workers']} worker processes in all (a DataLoader of {c['workers'] // c['k']} per trainer; all "
        f"{c['workers']} in the shared pipeline), on a machine of 2 CPUs. Systems: **dataloader** = a torch "
        "`DataLoader(persistent_workers=True)` per trainer, each its own order (the baseline of the ratios); "
        "**tsock** = one `tsock.Pipeline` in a producer process, each batch published once to all K trainers "
        "(`tsock.Producer`, `tsock.Consumer`), no cache; **tsock+belady@X** and **tsock+lru@X** = the same pipeline "
        "with `cache_bytes=` holding X% of the decoded samples (`_cache_segment.budget_for`) and `cache_policy=` "
        "`belady` or `lru`. Each run in fresh processes (forked by one process once the imports are done: start-up "
        "is not measured), one run of each system, a cold cache at the start of each.",
        "",
        "Sources, over the same files: **decode** = `read` the file, `decode` it whole with PIL, a random flip as "
        f"`augment`; **io** = each read waits {m['latency_ms']:g} ms + size / {m['bandwidth_mb_s']:g} MB/s (a "
        "network file system's latency and bandwidth, per reader: no cap shared by concurrent readers, and the wait "
        "is a sleep, so it costs no CPU), then a light decode (PIL's 1/8-scale draft of the JPEG). Figures: "
        "**samples/s** = samples delivered to all trainers over all epochs / wall time from the start to the last "
        "trainer's last batch (the first epoch, which fills the cache, included); **epochs 2+** the same from the "
        "moment every trainer has finished its first epoch; **CPU ms per sample** = CPU time of every process "
        "(producer, its workers, trainers, their DataLoader workers; /proc, over the same interval) / samples "
        "delivered; **hit rate** = 1 - (inserts + bypasses) / samples computed, from the segment's counters.",
        "",
    ]
    for source in [s for s in ("decode", "io") if any(r["source"] == s for r in c["runs"])]:
        L += [f"**{SOURCE_TITLES.get(source, source)}**", ""]
        rows = []
        for system in c["systems"]:
            r = cache_run(c, source, system)
            if r is None:
                continue
            rows.append(
                [
                    system,
                    num(r["samples_per_s"]),
                    f"{r['speedup']:.2f}x" if r.get("speedup") else "",
                    num(r.get("later_samples_per_s")),
                    num(r["cpu_ms_per_sample"], 3),
                    f"{r['cpu_ratio']:.2f}x" if r.get("cpu_ratio") else "",
                    f"{r['hit_rate']:.3f}" if "hit_rate" in r else "",
                    num(r["first_epoch_s"]),
                    num(r["wall_s"]),
                ]
            )
        L.append(
            table(
                [
                    "system",
                    "samples/s",
                    "/ dataloader",
                    "samples/s, epochs 2+",
                    "CPU ms per sample",
                    "CPU per sample / dataloader",
                    "hit rate",
                    "first epoch s",
                    "run s",
                ],
                rows,
            )
        )
        L += [""]
    for key, why in c.get("failures", {}).items():
        L += [f"- {key}: FAILED: {one_line(why)}", ""]
    h = c.get("hit_rates")
    if h:
        L += [
            f"Hit rate against cache size, by simulation (`tsock._cache_policy.simulate`, samples of one size) on two "
            f"traces of {h['epochs']} epochs of {h['n']} samples: **shared** = the order of the shared pipeline above "
            f"(the trace its workers make), and **own** = {h['k']} pipelines of their own (seeds 0..{h['k'] - 1}, one "
            "sample of each in turn) sharing one cache, the trace of K trials that do not share a pipeline. "
            "**belady** = the store's policy (`OnlineBelady`: next uses from the consumers' known orders), **optimum** "
            "= Belady's MIN on the whole trace (optimal for equal sizes)"
            + (", plotted in `docs/bench/cache.png` with the store's measured rates" if png else "")
            + ".",
            "",
        ]
        rows = []
        for trace in ("shared", "own"):
            for policy in ("belady", "lru", "fill-once", "optimum"):
                rows.append([trace, policy] + [f"{x:.3f}" for x in h[trace][policy]])
        L.append(table(["trace", "policy"] + [f"{round(100 * f)}%" for f in h["fractions"]], rows, 2))
        L += [""]
    L += [c.get("notes", ""), ""]
    return L
