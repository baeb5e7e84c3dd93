"""The headline comparisons, the targets and how to read them."""

from __future__ import annotations

import statistics

from .cache import goal
from .common import MiB, e2e_run, latency_row, num, pipeline_row, ratio, size_label, throughput_row


def targets(res: dict) -> list[list[str]]:
    """[target, measured, met, note] rows."""
    rows = []
    t = res.get("transport")
    if t:
        cost = [r for r in t.get("read_cost", []) if not r.get("error")]
        if len(cost) >= 2:
            lo, hi = min(r["mean90_ns"] for r in cost), max(r["mean90_ns"] for r in cost)
            spread = ", ".join(f"{size_label(r['bytes'])} {r['mean90_ns']:.0f} ns" for r in cost)
            rows.append(
                [
                    "reading cost independent of batch size",
                    f"acquire + release: {spread} (largest/smallest {hi / lo:.2f})",
                    hi <= 1.25 * lo,
                    "met when all sizes are within 25%; payload not read; mean of the fastest 90%",
                ]
            )
        pairs = t.get("pairs") or []
        if pairs:
            spin = statistics.median(p["tsock_spin_us"] / p["cache_line_us"] for p in pairs)
            fut = statistics.median(p["tsock_futex_us"] / p["futex_us"] for p in pairs)
            med = {k: statistics.median(p[k] for p in pairs) for k in pairs[0]}
            rows.append(
                [
                    "publish-to-acquire median ≤ 2× a raw cache-line handoff (busy-polling)",
                    f"{spin:.2f}x (tsock {num(med['tsock_spin_us'], 3)} µs, handoff {num(med['cache_line_us'], 3)} µs)",
                    spin <= 2,
                    f"1 reader; median ratio of {len(pairs)} back-to-back pairs",
                ]
            )
            rows.append(
                [
                    "publish-to-acquire median ≤ 1.5× a raw futex wake-up (futex)",
                    f"{fut:.2f}x (tsock {num(med['tsock_futex_us'])} µs, wake-up {num(med['futex_us'])} µs)",
                    fut <= 1.5,
                    f"1 reader; median ratio of {len(pairs)} back-to-back pairs",
                ]
            )
    e = res.get("e2e")
    if e:
        k = max(r["k"] for r in e["runs"]) if e["runs"] else None
        own, ts, tso = (e2e_run(e, s, k) for s in ("own", "tsock", "tensorsocket")) if k else (None, None, None)
        if own and ts:
            rows.append(
                [
                    f"K = {k}: aggregate throughput ≥ 3.5× the independent loaders",
                    f"{num(ts['aggregate'])} vs {num(own['aggregate'])} samples/s: "
                    f"{ratio(ts['aggregate'], own['aggregate'])}",
                    ts["aggregate"] >= 3.5 * own["aggregate"],
                    "",
                ]
            )
            rows.append(
                [
                    f"K = {k}: CPU per sample ≤ 1/3.5 of the independent loaders",
                    f"{num(ts['cpu_per_sample_ms'], 3)} vs {num(own['cpu_per_sample_ms'], 3)} ms: "
                    f"1/{own['cpu_per_sample_ms'] / ts['cpu_per_sample_ms']:.2f}",
                    ts["cpu_per_sample_ms"] * 3.5 <= own["cpu_per_sample_ms"],
                    "CPU of every process, DataLoader workers included",
                ]
            )
        if ts and tso:
            rows.append(
                [
                    f"K = {k}: ≥ 1.5× TensorSocket's throughput",
                    f"{num(ts['aggregate'])} vs {num(tso['aggregate'])} samples/s: "
                    f"{ratio(ts['aggregate'], tso['aggregate'])}",
                    ts["aggregate"] >= 1.5 * tso["aggregate"],
                    "",
                ]
            )
            rows.append(
                [
                    f"K = {k}: at half TensorSocket's CPU (per sample)",
                    f"{num(ts['cpu_per_sample_ms'], 3)} vs {num(tso['cpu_per_sample_ms'], 3)} ms: "
                    f"{ratio(ts['cpu_per_sample_ms'], tso['cpu_per_sample_ms'])}",
                    ts["cpu_per_sample_ms"] * 2 <= tso["cpu_per_sample_ms"],
                    "",
                ]
            )
    au = res.get("autosize")
    for src in (au or {}).get("sources", []):
        a = src["auto"]
        rows.append(
            [
                f'workers="auto", {src["source"]}-bound: within 10% of the best hand-set, settled in 30 s',
                f"{src.get('ratio_pair', src['ratio_tail']):.2f}x the best run right after it; "
                f"{src['ratio_tail']:.2f}x the sweep's best ({src['best']['batches_per_s']:.1f} batches/s); "
                f"settled at {a['settled_s']:.1f} s",
                src.get("ratio_pair", src["ratio_tail"]) >= 0.9 and a["settled_s"] <= 30,
                f"auto's last {au['tail']:g} s of {a['seconds']:g} against the best hand-set configuration of the "
                "sweep run again right after (back-to-back)",
            ]
        )
    c = res.get("cache")
    for source in ("decode", "io"):
        g = goal(c, source) if c else None
        if not g:
            continue
        b, d = g
        rows.append(
            [
                f"K = {c['k']}, 50% cache (Belady), {source}-bound: ≥ 5.7× the throughput of a DataLoader per trainer",
                f"{num(b['samples_per_s'])} vs {num(d['samples_per_s'])} samples/s: "
                f"{ratio(b['samples_per_s'], d['samples_per_s'])}",
                b["samples_per_s"] >= 5.7 * d["samples_per_s"],
                "CoorDL's hyper-parameter-search figure; all epochs, the first (cache filling) included; 2 CPUs",
            ]
        )
    return rows


def headline(res: dict) -> list[list[str]]:
    """[figure, tsock, baseline, ratio] rows: the main comparisons of the run."""
    rows = []
    t = res.get("transport")
    if t:
        for mode, what in (("spin", "busy-polling"), ("futex", "sleeping")):
            ts = latency_row(t, "tsock", mode, 1)
            for tr, name in (("uds", "descriptor over a Unix socket"), ("zmq", "payload over ZMQ")):
                b = latency_row(t, tr, mode, 1)
                if ts and b:
                    rows.append(
                        [
                            f"one-way latency µs, 1 reader, {what}, median (lower is better)",
                            num(ts["median_us"]),
                            f"{name}: {num(b['median_us'])}",
                            ratio(ts["median_us"], b["median_us"]),
                        ]
                    )
        ts = throughput_row(t, "tsock", 1, 4096, False)
        for tr, name in (("uds", "Unix socket"), ("zmq", "ZMQ")):
            b = throughput_row(t, tr, 1, 4096, False)
            if ts and b:
                rows.append(
                    [
                        "4 KiB batches/s, 1 reader (higher is better)",
                        num(ts["batches_per_s"]),
                        f"{name}: {num(b['batches_per_s'])}",
                        ratio(ts["batches_per_s"], b["batches_per_s"]),
                    ]
                )
        mem = {m["bytes"]: m for m in t.get("memcpy", [])}
        big = sorted(mem)
        if big:
            size = big[len(big) // 2]
            ts, z = throughput_row(t, "tsock", 1, size, True), throughput_row(t, "zmq", 1, size, True)
            if ts:
                rows.append(
                    [
                        f"{size_label(size)} batches, every byte read, GB/s (higher is better)",
                        num(ts["gb_per_s"]),
                        f"memcpy: {num(mem[size]['memcpy_gb_per_s'])}",
                        ratio(ts["gb_per_s"], mem[size]["memcpy_gb_per_s"]),
                    ]
                )
            if ts and z:
                rows.append(
                    [
                        f"{size_label(size)} batches, every byte read, GB/s (higher is better)",
                        num(ts["gb_per_s"]),
                        f"ZMQ: {num(z['gb_per_s'])}",
                        ratio(ts["gb_per_s"], z["gb_per_s"]),
                    ]
                )
    p = res.get("python")
    if p and p.get("dataloader_s"):
        np_row = next((r for r in p["rows"] if r["output"] == "numpy"), None)
        if np_row:
            rows.append(
                [
                    "Python consumer, µs per batch, numpy (lower is better)",
                    num(np_row["tsock_s"] * 1e6),
                    f"in-process DataLoader over a list: {num(p['dataloader_s'] * 1e6)}",
                    ratio(np_row["tsock_s"], p["dataloader_s"]),
                ]
            )
    e = res.get("e2e")
    if e and e.get("runs"):
        k = max(r["k"] for r in e["runs"])
        ts = e2e_run(e, "tsock", k)
        for system, name in (("own", "a DataLoader per trainer"), ("tensorsocket", "TensorSocket")):
            b = e2e_run(e, system, k)
            if ts and b:
                rows.append(
                    [
                        f"K = {k} trainers, samples/s of all trainers (higher is better)",
                        num(ts["aggregate"]),
                        f"{name}: {num(b['aggregate'])}",
                        ratio(ts["aggregate"], b["aggregate"]),
                    ]
                )
                rows.append(
                    [
                        f"K = {k} trainers, CPU ms per sample (lower is better)",
                        num(ts["cpu_per_sample_ms"], 3),
                        f"{name}: {num(b['cpu_per_sample_ms'], 3)}",
                        ratio(ts["cpu_per_sample_ms"], b["cpu_per_sample_ms"]),
                    ]
                )
                rows.append(
                    [
                        f"K = {k} trainers, peak PSS of all processes, MiB (lower is better)",
                        num(ts["peak_pss"] / MiB),
                        f"{name}: {num(b['peak_pss'] / MiB)}",
                        ratio(ts["peak_pss"], b["peak_pss"]),
                    ]
                )
    pl = res.get("pipeline")
    ts, dl = (pipeline_row(pl, s) for s in ("tsock", "dataloader")) if pl else (None, None)
    if ts and dl:
        w = f"{pl['workers']} workers"
        rows.append(
            [
                f"tsock.Pipeline, batches/s, {w} (higher is better)",
                num(ts["batches_per_s"]),
                f"DataLoader, persistent workers: {num(dl['batches_per_s'])}",
                ratio(ts["batches_per_s"], dl["batches_per_s"]),
            ]
        )
        rows.append(
            [
                f"tsock.Pipeline, CPU ms per sample, {w} (lower is better)",
                num(ts["cpu_ms_per_sample"], 3),
                f"DataLoader, persistent workers: {num(dl['cpu_ms_per_sample'], 3)}",
                ratio(ts["cpu_ms_per_sample"], dl["cpu_ms_per_sample"]),
            ]
        )
    return rows


def target_notes(res: dict) -> str:
    """How to read the targets, with this run's numbers."""
    out = ["Reading the targets (each miss: why, and what would close it):", ""]
    t = res.get("transport")
    if t and t.get("pairs"):
        pairs = t["pairs"]
        spin = statistics.median(p["tsock_spin_us"] / p["cache_line_us"] for p in pairs)
        fut = statistics.median(p["tsock_futex_us"] / p["futex_us"] for p in pairs)
        out.append(
            f"- **Busy-polling, {spin:.1f}x a cache-line handoff.** The primitive moves one cache line one way. A "
            "batch moves at least four, in three dependent steps: the reader sees `published` change; it copies "
            "the slot's head (stamp, epoch, sizes) and the tensor descriptor (two more lines), then re-checks the "
            "stamp (seqlock); the producer, before that, had to take those lines back from the reader's cache to "
            "write them. At one handoff per dependent transfer that is 3-4x the primitive; the rest is the "
            "reader's validation of every descriptor (it trusts no producer) and its clock reads. Closing it "
            "to 2x would take readers that wait on the next slot's stamp instead of `published` (measured: about "
            "15% less, see the last section) and a one-tensor descriptor inside the stamp's cache line (a "
            "layout change). The 2x target compares a message with a bare signal: a hand-off of several cache lines, "
            "as this layout has, cannot reach it."
        )
        fx_go = t.get("futex_go", {}).get("median_us")
        go = (
            f" A Go waiter, this run: {t['futex_go']['median_us']:.1f} µs against {t['futex']['median_us']:.1f} "
            "µs for the C waiter (the waiter's runtime threads can keep its CPU out of idle)."
            if fx_go
            else ""
        )
        out.append(
            f"- **Sleeping, {fut:.2f}x a futex wake-up.** A sleeping tsock reader is a futex wake-up plus the same "
            "few transfers, so it sits at the primitive; most of the time is the idle CPU's wake-up (in a VM, an "
            f"exit from HLT), which only a spinning reader avoids (tsock's default: spin 20 µs, then sleep).{go} "
            "A reader blocked on a Unix socket is woken faster than any futex waiter here (see the tables), most "
            "likely because a socket wakes its reader as a synchronous wake-up, so the kernel may run it on the "
            "sender's CPU, which is about to sleep, instead of waking the idle one; a futex wake has no such hint. "
            "At the batch rates of training (tens to thousands per second) this is microseconds per batch."
        )
    e = res.get("e2e")
    if e and e.get("runs"):
        c = e["costs"]
        p, m = c["pipeline_ms"], c["model_ms"]
        k = max(r["k"] for r in e["runs"])
        bound = k * (p + m) / (p + k * m)
        out.append(
            f"- **End to end, K = {k}, on 2 CPUs.** If the pipeline and the model were the only costs, sharing one "
            f"pipeline among K trainers would divide the CPU per sample by K(P+M)/(P+KM) = {bound:.2f} (P = {p:.3f} "
            f"ms of pipeline CPU per sample, M = {m:.4f} ms of training-step CPU per sample, both measured "
            "in-process in this run). Two things move the measured ratio off it, either way: every trainer process "
            "adds per-batch work of its own (its Python loop, reading the batch, context switches among all the "
            "processes on 2 CPUs), and the independent loaders pay K sets of DataLoader workers (started each "
            "epoch, every batch pickled from worker to trainer), which sharing removes too. The model here runs "
            "on the same 2 CPUs as the pipeline; on a GPU node, where M runs on the GPU, the ideal is K. With the "
            "targets this close to the ideal, a loaded machine can decide a run either way: in five full runs "
            "during development (other jobs on the machine, load average 1-5), the throughput ratio at K = 4 went "
            "from 3.0x to 3.7x and the CPU ratio from 1/3.1 to 1/4.4."
        )
    c = res.get("cache")
    for source in ("decode", "io"):
        note = _cache_note(c, source) if c else None
        if note:
            out.append(note)
    return "\n".join(out)


def _cache_note(c: dict, source: str) -> str | None:
    """Why the 5.7x cache target missed on `source`, or None (met, or not run)."""
    g = goal(c, source)
    if not g or g[0]["samples_per_s"] >= 5.7 * g[1]["samples_per_s"]:
        return None
    b, d = g
    ts = next((r for r in c["runs"] if (r["source"], r["system"]) == (source, "tsock")), None)
    shared = ts["samples_per_s"] / d["samples_per_s"] if ts else None
    share = f"sharing alone {shared:.2f}x, " if ts else ""
    bound = 0.5 * (c["epochs"] - 1) / c["epochs"]
    head = (
        f"- **Cache, {source}-bound, {b['samples_per_s'] / d['samples_per_s']:.2f}x a DataLoader per trainer "
        f"({share}hit rate {b.get('hit_rate', 0):.2f}).** With one shared pipeline the hit rate is at most about "
        f"50% × (E - 1) / E = {bound:.2f} (a little more as the workers overlap epochs)"
    )
    if source != "decode":
        return (
            head + ". A hit spares a read's wait, which costs no CPU: what limits the ratio is how many reads the "
            "workers wait on at once, and a loaded machine that slows their decoding."
        )
    ceiling = (
        f": {shared:.2f}x / (1 - {bound:.2f}) = {shared / (1 - bound):.2f}x even if decoding were all the CPU "
        "and a hit cost nothing"
        if ts
        else ""
    )
    io = goal(c, "io")
    met = (
        f" The I/O-bound source, where a hit spares a read's wait rather than CPU, meets it "
        f"({io[0]['samples_per_s'] / io[1]['samples_per_s']:.2f}x)."
        if io and io[0]["samples_per_s"] >= 5.7 * io[1]["samples_per_s"]
        else ""
    )
    return (
        head + f", so the cache can at best cut the decoding by that fraction on top of sharing{ceiling}. The "
        "trainers' reads, the producer's copies, the lookups and inserts and the Pipeline's per-sample Python are "
        "paid from the same CPUs as decoding. CoorDL's figure comes from a server with many cores per job; here it "
        "would take sharing itself nearer K and decoding costlier against those fixed costs (larger images)." + met
    )
