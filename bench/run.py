"""Every tsock benchmark in one run: writes docs/BENCHMARKS.md and its plots.

    python bench/run.py            # the full run (under 10 minutes on 2 CPUs)
    python bench/run.py --quick    # a smoke run (about a minute), into build/bench-quick

Sections (--only to pick some): transport (latency, throughput, bandwidth,
producer scaling and shared memory: bench/latency, a Go driver with C reader
processes), python (bench/python_consumer.py), e2e (bench/e2e.py). Every
figure is a ratio against a baseline measured in the same run. Needs `make
build` and the environment of `make bench-env`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
SECTIONS = ("transport", "python", "e2e")


def _cmd(*args: str) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def machine() -> dict:
    model, mhz = "unknown CPU", ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        k, _, v = line.partition(":")
        if k.strip() == "model name" and model == "unknown CPU":
            model = v.strip()
        if k.strip() == "cpu MHz" and not mhz:
            mhz = f", {float(v):.0f} MHz"
    mem = next((ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")), 0)
    virt = "virtual machine" if " hypervisor" in Path("/proc/cpuinfo").read_text() else ""
    versions = {
        "Go": _cmd("go", "env", "GOVERSION"),
        "cc": _cmd("cc", "-dumpfullversion"),
        "Python": platform.python_version(),
    }
    for mod in ("numpy", "torch", "jax", "zmq", "matplotlib"):
        try:
            m = __import__(mod)
            versions["pyzmq" if mod == "zmq" else mod] = m.__version__
        except ImportError:
            pass
    versions["libzmq"] = _cmd("pkg-config", "--modversion", "libzmq") or "not found"
    import e2e

    versions["tensorsocket"] = e2e.tensorsocket_version() or "not installed"
    commit = _cmd("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD")
    dirty = (
        " (with local changes)" if _cmd("git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no") else ""
    )
    summary = (
        f"{model}{mhz}, {os.cpu_count()} CPUs (nproc){', ' + virt if virt else ''}, "
        f"{int(mem) / 2**20:.0f} GiB RAM, Linux {platform.release()}, tsock {commit}{dirty}"
    )
    return {
        "summary": summary,
        "versions": versions,
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "load_start": _load(),
    }


def transport(quick: bool, tmp: Path) -> dict:
    exe = ROOT / "build" / "bench" / "latency"
    exe.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["go", "build", "-o", str(exe), "./bench/latency"], cwd=ROOT, check=True)
    out = tmp / "transport.json"
    args = [str(exe), "--helper", "auto", "--transports", "tsock,uds,zmq", "--interval-per-reader", "25us"]
    args += ["--throughput", "--shm", "--json", str(out)]
    if quick:
        args += ["--quick", "--readers", "1,4", "--tput-readers", "1", "--scaling", "0,1,4"]
    else:
        args += ["--readers", "1,4,16,64", "--samples", "10000", "--max-time", "3s", "--tput-readers", "1,4"]
        args += ["--repeats", "3", "--scaling", "0,1,2,4,8,16,32,64"]
    proc = subprocess.run(args, cwd=ROOT, text=True, capture_output=True)
    print(proc.stdout, end="", flush=True)
    if not out.exists():  # a failed measurement still writes its JSON: only a crash gets here
        raise RuntimeError(f"bench/latency failed ({proc.returncode}):\n{proc.stderr}")
    if proc.returncode:
        print(proc.stderr, file=sys.stderr)
    return json.loads(out.read_text())


def python_section(quick: bool) -> dict:
    import python_consumer

    r = python_consumer.measure(quick)
    for row in r["rows"]:
        print(
            f"  {row['output']:6} tsock {row['tsock_s'] * 1e6:6.2f} us/batch, list {row['list_s'] * 1e6:6.3f} us/batch",
            flush=True,
        )
    return r


def e2e_section(quick: bool, tmp: Path) -> dict:
    import e2e

    return e2e.measure(e2e.parse(["--quick"] if quick else []), tmp)


TARGET_NOTES = """Why each miss, and what would close it:

- **Busy-polling latency vs a cache-line handoff.** The primitive moves one cache line one way. A batch
  hand-off moves at least four in three dependent steps: the reader sees `published` change (one line), then
  copies the slot's stamp and descriptors (the slot head and three lines of tensor descriptor) and re-checks the
  stamp (the seqlock), then touches the payload (one more line); each cross-core transfer costs about one
  cache-line handoff. About 3-4x the primitive is the floor of this design; what is left above it is the reader's
  validation of every descriptor (the producer is not trusted) and two clock reads. Closing it to 2x would take
  readers that wait on the slot's own stamp instead of `published` (one dependent transfer less) and a
  descriptor packed into the stamp's cache line for one-tensor batches: a layout change (version 2), not done here.
- **Sleeping latency vs a futex wake-up.** tsock's sleeping reader is a futex wake-up plus the same few
  transfers: within noise of the primitive when both waiters are C processes (the table's baseline). A waiter
  whose CPU never idles is woken about twice as fast (`futex wake-up, Go waiter` above: the Go runtime's
  threads keep its CPU busy); on this VM the rest is the idle CPU's exit from HLT, which only a spinning reader
  avoids (tsock's default: spin 20 µs, then sleep).
- **End to end on 2 CPUs.** Sharing cannot do better than K(P+M)/(P+KM) when every CPU is busy (P: pipeline CPU
  per sample, M: model CPU per sample, both measured in the same run, see below). On this machine the
  trainers' models run on the same 2 CPUs as the pipeline, and each trainer process adds its own per-batch costs
  (optimizer step, Python loop, reading the batch); on a GPU node, where M is on the GPU, the bound is K."""


def measure(a, only: list[str]) -> dict:
    os.environ.setdefault("TSOCK_LIBRARY_DIR", str(ROOT / "build"))
    t0 = time.monotonic()
    res = {"machine": machine(), "quick": a.quick}
    print(f"machine: {res['machine']['summary']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="tsock-bench-") as tmp:
        for section, run in (
            ("transport", lambda: transport(a.quick, Path(tmp))),
            ("python", lambda: python_section(a.quick)),
            ("e2e", lambda: e2e_section(a.quick, Path(tmp))),
        ):
            if section in only:
                print(f"== {section} ({time.monotonic() - t0:.0f} s)", flush=True)
                res[section] = run()
    res["machine"]["load_end"] = _load()
    res["seconds"] = time.monotonic() - t0
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer configurations and samples")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run (default all: {','.join(SECTIONS)})")
    ap.add_argument("--out", type=Path, help="document folder (default: docs; --quick: build/bench-quick)")
    ap.add_argument("--report", type=Path, help="measure nothing: rewrite the document from a results.json")
    a = ap.parse_args(argv)
    only = [s for s in a.only.split(",") if s]
    bad = set(only) - set(SECTIONS)
    if bad:
        ap.error(f"unknown sections {sorted(bad)}")
    out = a.out or (ROOT / "build" / "bench-quick" if a.quick else ROOT / "docs")
    (out / "bench").mkdir(parents=True, exist_ok=True)
    if a.report:
        res = json.loads(a.report.read_text())
    else:
        res = measure(a, only)
        # The measurements first: a failing report can be rebuilt with --report.
        (out / "bench" / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    import e2e
    import report

    res["target_notes"] = TARGET_NOTES
    if "e2e" in res:
        res["e2e"]["notes"] = e2e.NOTES
    images = report.plots(res, out / "bench")
    command = "make bench" + (" BENCH_ARGS=--quick" if res["quick"] else "")
    (out / "BENCHMARKS.md").write_text(report.markdown(res, images, command))
    print(f"wrote {out / 'BENCHMARKS.md'} and {len(images)} plots ({res['seconds']:.0f} s of measurements)", flush=True)
    for target, measured, met, _ in report.targets(res):
        print(f"  {'met ' if met else 'MISS'} {target}: {measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
