"""The input pipeline section: tsock.Pipeline against a DataLoader (bench/pipeline.py)."""

from __future__ import annotations

from .common import num, one_line, pipeline_row, ratio, table


def pipeline_md(p: dict) -> list[str]:
    c = p["costs"]
    L = ["## Pipeline against a DataLoader", ""]
    L += [
        f"`bench/pipeline.py`: `tsock.Pipeline` and a torch `DataLoader` over the same dataset and transforms (the "
        f"sweep's: JPEG decode, random resized crop, flip, normalise), {p['train']} images, batches of {p['batch']}, "
        f"shuffled, {p['workers']} worker processes each, {p['epochs']} epochs per run, each run in a fresh process; "
        f"{p['repeats']} run(s) of each system, alternating. The batches are read (summed) and nothing else: this "
        "is the loaders' own throughput. Figures: the median over the epochs after the first (the first includes "
        "starting the workers, shown apart) and over the runs. CPU: the process and its workers (live ones from "
        "/proc, exited ones from `RUSAGE_CHILDREN`).",
        "",
        f"Measured in-process, same run: the dataset costs {c['sample_ms']:.3f} ms of CPU per sample; making it "
        f"deterministic costs the Pipeline {c['seed_us']:.1f} µs per sample (seeding Python's, numpy's and torch's "
        f"global generators from (seed, epoch, index) before the sample is loaded), plus {c['rng_us']:.1f} µs and "
        "another seeding for a pipeline with an `augment` stage (its numpy Generator), which this dataset has not "
        "(its transforms are inside `__getitem__`).",
        "",
    ]
    base = pipeline_row(p, "dataloader")
    rows = []
    for r in p["systems"]:
        rows.append(
            [
                r["system"],
                num(r["batches_per_s"]),
                num(r["samples_per_s"]),
                num(r["cpu_ms_per_sample"], 3),
                ratio(r["batches_per_s"], base["batches_per_s"]) if base else "",
                ratio(r["cpu_ms_per_sample"], base["cpu_ms_per_sample"]) if base else "",
                num(r["first_epoch_s"]),
            ]
        )
    L.append(
        table(
            [
                "system",
                "batches/s",
                "samples/s",
                "CPU ms per sample",
                "batches/s / dataloader",
                "CPU per sample / dataloader",
                "first epoch s",
            ],
            rows,
        )
    )
    L += [""]
    for key, why in p.get("failures", {}).items():
        L += [f"- {key}: FAILED: {one_line(why)}"]
    L += [p.get("notes", ""), ""]
    return L
