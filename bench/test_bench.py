"""Smoke test of the benchmark driver (bench/run.py --quick, about 30 s):
every section runs, and the document it writes carries the targets, the
baselines and the plots. Run by `make bench-test` (part of `make test`),
which installs the benchmarks' extras (requirements/bench.in) first: a
missing one fails here, it is never skipped."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# About 40 s on a quiet 2-CPU machine (plus importing PyTorch); generous
# bounds for a loaded one: it ran past 900 s at load average 13-18 (a fresh
# clone's `make test` beside three other builds). The subprocess's own
# limit fires first, so a hang reports the driver's output.
@pytest.mark.timeout(2000)
def test_quick_benchmark_writes_the_document(tmp_path):
    for tool in ("go", "cc"):
        assert shutil.which(tool), f"the benchmarks need {tool} on PATH"
    import matplotlib  # noqa: F401 - the extras of requirements/bench.in
    import tensorsocket  # noqa: F401
    import zmq  # noqa: F401

    sys.path.insert(0, str(ROOT / "bench"))
    from e2e import child_env

    env = child_env()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        # Only a guard against a hang: about a minute here when quiet, 16
        # minutes under two CPU hogs and other work (load 24).
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = (tmp_path / "BENCHMARKS.md").read_text()
    for heading in (
        "## Targets",
        "## Transport",
        "## Python consumer",
        "## End to end",
        "## Pipeline against a DataLoader",
        "## Resume against StatefulDataLoader",
        "## Decoded-sample cache in a sweep of K trainers",
        "## Scaling",
    ):
        assert heading in doc
    assert "FAILED" not in doc, doc
    assert "WRONG BATCH" not in doc, doc  # a resume gave another batch than the uninterrupted run's
    for png in ("latency.png", "throughput.png", "e2e.png", "scaling.png", "cache.png"):
        assert (tmp_path / "bench" / png).stat().st_size > 1000
    res = json.loads((tmp_path / "bench" / "results.json").read_text())
    # The ZMQ baseline runs on the libzmq of pyzmq's wheel: no system headers needed.
    assert "pyzmq's" in res["machine"]["versions"]["libzmq"], res["machine"]["versions"]
    t = res["transport"]
    assert t["cache_line"]["n"] > 0 and t["futex"]["n"] > 0
    assert {r["transport"] for r in t["latency"]} == {"tsock", "uds", "zmq"}
    assert all(r["batches_per_s"] > 0 for r in t["throughput"])
    assert t["pairs"] and all(r["median_ns"] > 0 for r in t["read_cost"])
    assert t["scaling"] and t["flat"] and t["shm"]
    assert {(r["system"], r["k"]) for r in res["e2e"]["runs"]} == {
        (s, k) for s in ("own", "tsock", "tensorsocket") for k in (1, 2)
    }
    pl = res["pipeline"]
    assert {r["system"] for r in pl["systems"]} == {"dataloader", "dataloader-fresh", "tsock"}
    assert all(r["batches_per_s"] > 0 and r["cpu_ms_per_sample"] > 0 for r in pl["systems"])
    assert "tsock.Pipeline, batches/s" in doc
    check_cache_section(res["cache"], doc)
    # every figure comes with its baseline from the same run
    assert all(r["list_s"] > 0 for r in res["python"]["rows"])
    assert all(r["step_s"] > 0 and r["lifetime_ratio"] > 0 for r in res["python"]["rows"])
    assert set(res["python"]["keep"]) == {"small", "large"} and "default / step" in doc
    assert all(m["memcpy_gb_per_s"] > 0 for m in t["memcpy"])
    # No GPU here: the GPU section says why instead of figures.
    assert "skipped" in res["gpu"] and "## GPU" in doc and "Not run:" in doc


def check_cache_section(c: dict, doc: str) -> None:
    """The cache section of a quick run: every system ran on both sources,
    every trainer got every sample of every epoch, the figures are sane
    and come with the same run's DataLoader baseline, and the simulated hit
    rates are ordered as the policies guarantee."""
    assert not c["failures"], c["failures"]
    want = {"dataloader", "tsock", "tsock+belady@50", "tsock+lru@50", "tsock+auto@50"}
    assert {(r["source"], r["system"]) for r in c["runs"]} == {(s, x) for s in ("decode", "io") for x in want}
    for r in c["runs"]:
        assert r["samples"] == c["k"] * c["epochs"] * c["images"], r
        assert r["samples_per_s"] > 0 and r["cpu_ms_per_sample"] > 0 and r["speedup"] > 0, r
        if "+" in r["system"]:
            assert 0 <= r["hit_rate"] <= 1 and r["cache"]["inserts"] > 0, r
        else:
            assert "hit_rate" not in r, r
    h = c["hit_rates"]
    for trace in ("shared", "own"):
        rates = h[trace]
        assert all(len(rates[p]) == len(h["fractions"]) for p in ("belady", "lru", "fill-once", "optimum"))
        for i in range(len(h["fractions"])):
            # MIN is optimal for samples of one size; the store's Belady knows the orders
            assert all(rates[p][i] <= rates["optimum"][i] + 1e-9 for p in ("belady", "lru", "fill-once"))
            assert rates["belady"][i] >= rates["fill-once"][i] - 1e-9
    assert "| tsock+belady@50 |" in doc and "| own | optimum |" in doc
    assert "≥ 5.7× the throughput of a DataLoader per trainer" in doc  # the target row


def test_cache_section_renders_a_failure():
    # A system that failed is listed with why, and its row is left out.
    sys.path.insert(0, str(ROOT / "bench"))
    from report.cache import cache_md

    c = {"k": 4, "epochs": 5, "images": 8, "side": 16, "file_bytes": 1 << 20, "decoded_bytes": 1 << 20}
    c |= {"batch": 32, "workers": 4, "io_model": {"latency_ms": 2, "bandwidth_mb_s": 100}}
    c |= {"systems": ["dataloader", "tsock"], "failures": {"decode/tsock": "RuntimeError: boom\nline | two"}}
    run = {"source": "decode", "system": "dataloader", "samples_per_s": 100.0, "speedup": 1.0, "cpu_ratio": 1.0}
    run |= {"later_samples_per_s": 120.0, "cpu_ms_per_sample": 2.0, "first_epoch_s": 1.0, "wall_s": 5.0}
    md = "\n".join(cache_md(c | {"runs": [run]}, False))
    assert "| dataloader | 100 | 1.00x | 120 | 2.000 | 1.00x |  | 1.00 | 5.00 |" in md, md
    assert "| tsock |" not in md
    assert "- decode/tsock: FAILED: RuntimeError: boom line | two" in md


def test_gpu_section_renders_runs():
    # The document's GPU table from a result shaped like bench/gpu.py's.
    sys.path.insert(0, str(ROOT / "bench"))
    import report

    trainer = {"batches": 100, "p50_ms": 1.25, "p99_ms": 3.5, "batches_per_s": 400.0, "placement": "device"}
    g = {"gpu": "NVIDIA H100", "torch": "2.4", "batch_mb": 16, "step_ms": 2.0, "failures": {"tensorsocket/4": "x"}}
    g["runs"] = [
        {
            "system": "tsock-device",
            "k": 2,
            "per_trainer": [trainer, trainer],
            "p50_ms": 1.25,
            "h2d_bytes": 100 * 16 << 20,
        },
        {
            "system": "tsock-copy",
            "k": 2,
            "per_trainer": [dict(trainer, placement="pinned")] * 2,
            "p50_ms": 2.0,
            "h2d_bytes": 2 * 100 * 16 << 20,
        },
    ]
    g["runs"].append(
        {
            "system": "tensorsocket",
            "k": 2,
            "per_trainer": [dict(trainer, batches_per_s=160.0, placement="cuda-ipc")] * 2,
            "p50_ms": 0.5,
            "h2d_bytes": 100 * 16 << 20,
        }
    )
    md = "\n".join(report.gpu_md(g))
    assert "| tsock-device | 2 | 400 | 2.50x | 1.250 | 3.500 | 1.56 | device |" in md, md
    assert "| tsock-copy | 2 | 400 | 2.50x | 2.000 | 3.500 | 3.12 | pinned |" in md, md
    assert "| tensorsocket | 2 | 160 | 1.00x | 0.500 | 3.500 | 1.56 | cuda-ipc |" in md, md
    assert "tensorsocket/4 failed: x" in md


def test_merge_keeps_the_sections_not_measured():
    # bench/run.py --only pipeline --merge: the other sections come from the
    # earlier results, and the document says from which run.
    sys.path.insert(0, str(ROOT / "bench"))
    import report
    import run

    old = {
        "quick": False,
        "machine": {"date": "2026-01-02 03:04", "summary": "old box", "load_start": "1", "load_end": "2"},
        "python": {"rows": []},
        "pipeline": {"old": True},
    }
    res = {"quick": False, "pipeline": {"new": True}}
    run.merge(res, old, ["pipeline"])
    assert res["pipeline"] == {"new": True} and res["python"] == {"rows": []}
    assert res["earlier"] == {"python": {"date": "2026-01-02 03:04", "machine": "old box", "load": "1 to 2"}}
    res["machine"] = {"date": "now", "summary": "new box", "versions": {}, "load_start": "0", "load_end": "0"}
    res["seconds"] = 1.0
    md = report.markdown(res | {"python": None, "pipeline": None}, [], "make bench")  # the header only
    assert "Sections python: kept from an earlier run (`--merge`), on 2026-01-02 03:04, old box" in md


def test_a_failure_text_stays_inside_its_table_cell():
    # A failed child's error quotes its output (childproc: "...; it
    # printed:\n..."): its newlines would end the row and its pipes add
    # columns, which is how one FAILED row broke the read-cost table.
    sys.path.insert(0, str(ROOT / "bench"))
    from report.common import table

    why = 'child 123: exit status 1; it printed:\ntsock: bad | worse\n\n  grep -E "a\\|b"'
    md = table(["size", "result", "µs"], [["8 MiB", "FAILED: " + why, ""], ["4 KiB", "1.0", "2.0"]])
    lines = md.split("\n")
    assert len(lines) == 4, md
    # A pipe is a column break unless an odd number of backslashes precede it.
    breaks = [len(re.findall(r"(?<!\\)(?:\\\\)*\|", line)) for line in lines]
    assert breaks == [4, 4, 4, 4], md
    assert 'it printed: tsock: bad \\| worse grep -E "a\\\\\\|b"' in lines[2], lines[2]


def test_a_gpu_result_from_another_machine_replaces_the_gpu_section(tmp_path):
    # bench/run.py --import-gpu: the gpu section comes from a GPU machine's
    # bench/gpu.py --json; the document says which machine and when.
    sys.path.insert(0, str(ROOT / "bench"))
    import run

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"quick": False, "gpu": {"skipped": "no CUDA GPU visible"}, "seconds": 1.0}))
    machine = {"summary": "16 CPUs, tsock abc1234", "date": "2026-11-28 06:35", "load_start": "0.1 0.2 0.3"}
    g = {"gpu": "NVIDIA H200", "torch": "2.11", "batch_mb": 16, "step_ms": 2.0, "runs": [], "failures": {}}
    (tmp_path / "gpu.json").write_text(json.dumps(g | {"machine": machine}))
    res = run.import_gpu(results, tmp_path / "gpu.json")
    assert res["gpu"]["gpu"] == "NVIDIA H200"
    assert res["earlier"]["gpu"] == {
        "date": "2026-11-28 06:35",
        "machine": "NVIDIA H200, 16 CPUs, tsock abc1234",
        "load": "0.1 0.2 0.3 to ?",
        "how": "measured on a GPU machine (`bench/run.py --import-gpu`)",
    }
    assert json.loads(results.read_text()) == res
    (tmp_path / "bare.json").write_text(json.dumps(g))
    with pytest.raises(SystemExit, match="names no machine"):
        run.import_gpu(results, tmp_path / "bare.json")


def test_cache_targets_per_source():
    # One 5.7x row per source that ran both systems; a note for each miss,
    # which says the I/O-bound source met it only where its row is there.
    sys.path.insert(0, str(ROOT / "bench"))
    from report.targets import target_notes, targets

    def run(source, system, rate):
        return {"source": source, "system": system, "samples_per_s": rate, "hit_rate": 0.4}

    full = [run("decode", "dataloader", 100.0), run("decode", "tsock", 300.0), run("decode", "tsock+belady@50", 360.0)]
    full += [run("io", "dataloader", 100.0), run("io", "tsock+belady@50", 620.0)]
    c = {"k": 4, "epochs": 5, "runs": full}
    rows = [r for r in targets({"cache": c}) if "50% cache" in r[0]]
    assert [(r[0].split(", ")[2].split(":")[0], r[2]) for r in rows] == [("decode-bound", False), ("io-bound", True)]
    notes = target_notes({"cache": c})
    assert "**Cache, decode-bound, 3.60x" in notes and "meets it (6.20x)" in notes and "io-bound," not in notes
    # The I/O-bound pair failed: no row, and the decode note does not point at one.
    c = {"k": 4, "epochs": 5, "runs": full[:4]}
    assert [r[0] for r in targets({"cache": c}) if "50% cache" in r[0]] == [rows[0][0]]
    assert "meets it" not in target_notes({"cache": c})
    # An I/O-bound miss gets its own note.
    c = {"k": 4, "epochs": 5, "runs": full[:4] + [run("io", "tsock+belady@50", 200.0)]}
    assert "**Cache, io-bound, 2.00x" in target_notes({"cache": c})
