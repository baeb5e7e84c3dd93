"""The end-to-end section: K trainers sharing one pipeline (bench/e2e.py)."""

from __future__ import annotations

from .common import MiB, e2e_run, num, one_line, ratio, table


def e2e_md(e: dict, png: bool) -> list[str]:
    c = e["costs"]
    p, mm = c["pipeline_ms"], c["model_ms"]
    L = ["## End to end: K trainers sharing one pipeline", ""]
    L += [
        f"`bench/e2e.py`: the sweep's dataset and pipeline (`examples/python`: JPEG decode, random resized crop, "
        f"flip, normalise; batches of {e['batch']}; DataLoader with {e['workers']} workers), {e['train']} images per "
        f"epoch, {e['epochs']} epochs, median over the epochs after the first (start-up). Each trainer trains a small "
        "model (4×4 average pool, then a linear classifier) on the CPU: on this GPU-less machine the model's compute "
        "competes with the pipeline for the same 2 CPUs, so it is kept small, as the model of a GPU trainer costs the "
        f"CPU little. Measured in-process, same run: the pipeline costs {p:.3f} ms of CPU per sample, a training step "
        f"{mm:.4f} ms per sample; were those the only costs, sharing would divide the CPU per sample by "
        "K(P+M)/(P+KM) = "
        + ", ".join(f"{(k * (p + mm)) / (p + k * mm):.2f}x at K = {k}" for k in sorted({r["k"] for r in e["runs"]}))
        + ".",
        "",
        "Systems: **own** = each trainer runs its own DataLoader (the baseline); **tsock** = one producer process "
        "runs the DataLoader and publishes each batch once, trainers use `tsock.Consumer(output='torch')`; "
        "**tensorsocket** = `tensorsocket` 0.0.5 from PyPI, its `TensorProducer` wrapping the same DataLoader, "
        "trainers iterate `TensorConsumer` (notes below). CPU: every process, DataLoader workers included "
        "(process plus reaped children, summed over processes, per epoch). Memory: the peak over the run of the "
        "sum over all processes of RSS and of PSS (PSS splits shared pages among their users, so shared memory "
        "counts once).",
        "",
    ]
    rows = []
    for r in sorted(e["runs"], key=lambda r: (r["k"], r["system"])):
        own = e2e_run(e, "own", r["k"])
        rows.append(
            [
                r["system"],
                r["k"],
                num(r["trainer_rate"]),
                num(r["aggregate"]),
                ratio(r["aggregate"], own["aggregate"]) if own else "",
                num(r["cpu_epoch"]),
                num(r["cpu_per_sample_ms"], 3),
                ratio(r["cpu_per_sample_ms"], own["cpu_per_sample_ms"]) if own else "",
                num(r["peak_rss"] / MiB),
                num(r["peak_pss"] / MiB),
            ]
        )
    L.append(
        table(
            [
                "system",
                "K",
                "samples/s per trainer",
                "aggregate samples/s",
                "aggregate / own",
                "CPU s per epoch",
                "CPU ms per sample",
                "CPU per sample / own",
                "peak RSS sum MiB",
                "peak PSS sum MiB",
            ],
            rows,
        )
    )
    L += [""]
    for key, why in e.get("failures", {}).items():
        L += [f"- {key}: FAILED: {one_line(why)}"]
    if png:
        L += ["![e2e](bench/e2e.png)", ""]
    L += [e.get("notes", ""), ""]
    return L
