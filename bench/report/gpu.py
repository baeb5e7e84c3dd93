"""The GPU section (bench/gpu.py)."""

from __future__ import annotations

from .common import one_line, table


def gpu_md(g: dict) -> list[str]:
    L = ["## GPU: one host-to-device copy per GPU", ""]
    L.append(
        "`bench/gpu.py`: K trainers on one GPU, one producer; a batch is a float32 tensor and a timestamp; latency is "
        "publish -> usable on the trainer's GPU (its stream has the data); host-to-device bytes are what each system "
        "copies. Systems: tsock-device (one copy into the producer's device pool, trainers read it zero-copy through "
        "CUDA IPC), tsock-copy (every trainer copies every batch from pinned shared memory, the per-trainer copy), "
        "tensorsocket (its CUDA mode: one copy by its producer, CUDA IPC handles to the trainers)."
    )
    L.append("")
    if "skipped" in g:
        L += [f"**Not run: {g['skipped']}.** Run `python bench/gpu.py` (or `make bench`) on a machine with a GPU.", ""]
        return L
    L += [f"GPU: {g['gpu']}, torch {g['torch']}, {g['batch_mb']} MiB batches, {g['step_ms']} ms step.", ""]
    rows = []
    for r in g["runs"]:
        p99 = max(t["p99_ms"] for t in r["per_trainer"])
        placement = ",".join(sorted({t["placement"] for t in r["per_trainer"]}))
        rows.append(
            [r["system"], r["k"], f"{r['p50_ms']:.3f}", f"{p99:.3f}", f"{r['h2d_bytes'] / 2**30:.2f}", placement]
        )
    L.append(table(["system", "K", "latency p50 ms", "p99 ms", "H2D GiB", "placement"], rows, 1))
    L.append("")
    for name, why in g.get("failures", {}).items():
        L.append(f"- {name} failed: {one_line(why)}")
    return L
