"""The GPU section (bench/gpu.py)."""

from __future__ import annotations

import statistics

from .common import one_line, table


def _rate(run: dict) -> float:
    """Batches per second of the run's median trainer."""
    return statistics.median(t["batches_per_s"] or 0.0 for t in run["per_trainer"])


def gpu_md(g: dict) -> list[str]:
    L = ["## GPU: one host-to-device copy per GPU", ""]
    L.append(
        "`bench/gpu.py`: K trainers on one GPU, one producer; a batch is a float32 tensor and a timestamp; latency is "
        "publish -> usable on the trainer's GPU (its stream has the data; the first 8 batches, stamped while the "
        "trainers attach, are left out); host-to-device bytes are what each system copies. Systems: tsock-device "
        "(one copy into the producer's device pool, trainers read it zero-copy through CUDA IPC), tsock-copy (every "
        "trainer copies every batch from pinned shared memory, the per-trainer copy), tensorsocket (its CUDA mode: "
        "one copy by its producer, CUDA IPC handles to the trainers)."
    )
    L.append("")
    if "skipped" in g:
        L += [f"**Not run: {g['skipped']}.** Run `python bench/gpu.py` (or `make bench`) on a machine with a GPU.", ""]
        return L
    L += [f"GPU: {g['gpu']}, torch {g['torch']}, {g['batch_mb']} MiB batches, {g['step_ms']} ms step.", ""]
    baseline = {r["k"]: _rate(r) for r in g["runs"] if r["system"] == "tensorsocket"}
    rows = []
    for r in g["runs"]:
        p99 = max(t["p99_ms"] for t in r["per_trainer"])
        placement = ",".join(sorted({t["placement"] for t in r["per_trainer"]}))
        base = baseline.get(r["k"])
        ratio = f"{_rate(r) / base:.2f}x" if base else ""
        rows.append(
            [
                r["system"],
                r["k"],
                f"{_rate(r):.0f}",
                ratio,
                f"{r['p50_ms']:.3f}",
                f"{p99:.3f}",
                f"{r['h2d_bytes'] / 2**30:.2f}",
                placement,
            ]
        )
    head = ["system", "K", "batches/s per trainer", "vs tensorsocket", "latency p50 ms", "p99 ms", "H2D GiB"]
    L.append(table(head + ["placement"], rows, 1))
    L.append("")
    L.append(
        "Every trainer's step runs on the one GPU, so where the transport keeps up, the GPU bounds the rate "
        "(about 1000 / step ms / K batches/s per trainer, less the reads) and batches wait in the ring: latency "
        "is then the ring's depth times the step, not the transport's cost. A system whose trainers get fewer "
        "batches than the GPU allows shows a shorter latency for that reason."
    )
    L.append("")
    for name, why in g.get("failures", {}).items():
        L.append(f"- {name} failed: {one_line(why)}")
    return L
