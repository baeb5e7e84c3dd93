"""The transport section: publish to acquire, latency and throughput against the socket baselines."""

from __future__ import annotations

from .common import latency_row, num, ratio, size_label, table, throughput_row


def transport_md(t: dict, lat_png: bool, tput_png: bool) -> list[str]:
    cl, fx = t["cache_line"], t["futex"]
    L = ["## Transport: publish to acquire", ""]
    L += [
        f"Go producer (the product's `producer` package) and reader processes in C (`bench/latency/helper/tbench.c`, "
        f"the C reader of `libtsock_reader.so`, so no Go runtime or allocation sits in the measured path). "
        f"One {t['latency_payload_bytes']}-byte batch per interval, the interval growing with the readers "
        "(max(100 µs, 25 µs × readers)) so that readers woken one after the other on 2 CPUs can drain each batch; "
        "each reader records `CLOCK_MONOTONIC` on return minus the batch's publish time. `spin`: readers busy-poll; "
        "`futex`: tsock readers never spin and sleep on the futex, socket readers block in `recv`.",
        "",
        "Baselines, same run: **cache-line handoff** (two processes ping-pong a counter in a shared mapping, RTT/2), "
        "**futex wake-up** (FUTEX_WAKE to the sleeper running), **UDS** (the same descriptor, 224 bytes, sent over a "
        "Unix-domain `SOCK_SEQPACKET` socket to each reader), **ZMQ** (the same payload over libzmq PUB/SUB on "
        "loopback TCP, as TensorSocket moves its batches, in C so that both sides pay no interpreter).",
        "",
        table(
            ["baseline", "median µs", "p99 µs"],
            [
                ["cache-line handoff", num(cl["median_us"], 3), num(cl["p99_us"], 3)],
                ["futex wake-up", num(fx["median_us"]), num(fx["p99_us"])],
            ]
            + (
                [["futex wake-up, Go waiter", num(t["futex_go"]["median_us"]), num(t["futex_go"]["p99_us"])]]
                if t.get("futex_go", {}).get("n")
                else []
            ),
        ),
        "",
        "The futex baseline's waiter is a C process, like the readers it is compared with; the Go waiter of the "
        "previous version of this benchmark is shown for comparison (its runtime's threads keep running while it "
        "sleeps in the kernel, which can keep its vCPU out of idle and its wake-ups shorter).",
        "",
    ]
    pairs = t.get("pairs") or []
    if pairs:
        L += [
            "Back-to-back pairs, 1 reader (the targets): each tsock measurement right after its baseline, so that "
            "both see the same placement of the VM's vCPUs on host cores (between runs the cache-line handoff "
            "changes several-fold with it).",
            "",
            table(
                ["pair", "cache-line µs", "tsock spin µs", "ratio", "futex wake-up µs", "tsock futex µs", "ratio"],
                [
                    [
                        i + 1,
                        num(p["cache_line_us"], 3),
                        num(p["tsock_spin_us"], 3),
                        ratio(p["tsock_spin_us"], p["cache_line_us"]),
                        num(p["futex_us"]),
                        num(p["tsock_futex_us"]),
                        ratio(p["tsock_futex_us"], p["futex_us"]),
                    ]
                    for i, p in enumerate(pairs)
                ],
            ),
            "",
            "All configurations (one run each, baselines measured once at the start):",
            "",
        ]
    rows = []
    for r in t["latency"]:
        if r.get("error"):
            rows.append([r["transport"], r["mode"], r["readers"], "FAILED: " + r["error"], "", "", ""])
            continue
        base = cl if r["mode"] == "spin" else fx
        tsock = latency_row(t, "tsock", r["mode"], r["readers"])
        rows.append(
            [
                r["transport"],
                r["mode"],
                r["readers"],
                num(r["median_us"]),
                num(r["p99_us"]),
                ratio(r["median_us"], base["median_us"]),
                "1.00x" if r["transport"] == "tsock" else ratio(r["median_us"], tsock["median_us"] if tsock else 0),
            ]
        )
    L.append(
        table(
            ["transport", "mode", "readers", "median µs", "p99 µs", "median / baseline", "median / tsock's"],
            rows,
            2,
        )
    )
    L += [
        "",
        "Baseline: the cache-line handoff for `spin`, the futex wake-up for `futex`. With more busy-polling "
        "readers than CPUs (here: 4, 16 and 64 spinning readers plus the producer on 2 vCPUs), a batch waits "
        "for its reader to be scheduled: those rows measure the Linux scheduler's time slices, not the "
        "transport, for every transport alike. The sleeping (`futex`) rows show the cost of waking readers "
        "one after the other.",
        "",
    ]
    if lat_png:
        L += ["![latency](bench/latency.png)", ""]
    L += ["### Throughput and bandwidth", ""]
    L += [
        "Flat out: the producer publishes as fast as readers let it, for "
        f"{t['throughput'][0]['repeats'] if t['throughput'] else '?'} run(s) of a fixed time, median kept. "
        "Readers use "
        "tsock's default wait (spin 20 µs, then the futex); socket readers a blocking `recv`. The ZMQ publisher uses "
        "back-pressure (`ZMQ_XPUB_NODROP`) and sends its payload frame without a copy (`zmq_msg_init_data`); UDS sends "
        "the descriptor only. tsock's producer writes the first 8 bytes of each batch (readers check them); bandwidth "
        "readers sum every 64-bit word of every batch.",
        "",
    ]
    rows = []
    uds1 = throughput_row(t, "uds", 1, 4096, False)
    for r in t["throughput"]:
        if r["bytes"] != 4096:
            continue
        if r.get("error"):
            rows.append([r["transport"], r["readers"], "FAILED: " + r["error"], ""])
            continue
        ts = throughput_row(t, "tsock", r["readers"], 4096, False)
        rows.append(
            [
                r["transport"],
                r["readers"],
                num(r["batches_per_s"]),
                ratio(ts["batches_per_s"], r["batches_per_s"]) if ts else "",
            ]
        )
    L.append(table(["4 KiB batches", "readers", "batches/s per reader", "tsock / this"], rows))
    L += [""]
    _ = uds1
    mem = {m["bytes"]: m for m in t["memcpy"]}
    rows = []
    for r in t["throughput"]:
        if not r["touch"]:
            continue
        m = mem.get(r["bytes"], {})
        if r.get("error"):
            rows.append([r["transport"], size_label(r["bytes"]), r["readers"], "FAILED: " + r["error"], "", "", "", ""])
            continue
        rows.append(
            [
                r["transport"],
                size_label(r["bytes"]),
                r["readers"],
                num(r["batches_per_s"]),
                num(r["gb_per_s"]),
                num(r["agg_gb_per_s"]),
                ratio(r["gb_per_s"], m.get("memcpy_gb_per_s")),
                ratio(r["gb_per_s"], m.get("read_gb_per_s")),
            ]
        )
    L.append(
        table(
            [
                "every byte read",
                "batch",
                "readers",
                "batches/s per reader",
                "GB/s per reader",
                "GB/s all readers",
                "per reader / memcpy",
                "per reader / in-process read",
            ],
            rows,
        )
    )
    L += [
        "",
        "In-process baselines, same run, cycling through a ring-sized working set (the same caches as the "
        "transports): "
        + "; ".join(
            f"{size_label(b)} × {m['slots']}: memcpy {num(m['memcpy_gb_per_s'])} GB/s, "
            f"read {num(m['read_gb_per_s'])} GB/s"
            for b, m in sorted(mem.items())
        )
        + ".",
        "",
    ]
    cost = t.get("read_cost") or []
    if cost:
        base = cost[0].get("mean90_ns")
        L += [
            "Reading cost against batch size: a C reader's `acquire` + `release` of a batch already published "
            "(the reader naps 2 ms, the ring fills, then it times up to 8 release + acquire pairs, checking each batch "
            "while it holds it, outside the timed calls; the producer never blocks, so no release has a producer to "
            "wake), 16 slots, payload not read by tsock.",
            "",
            table(
                ["batch", "acquire + release ns", "median ns", "p99 ns", f"/ {size_label(cost[0]['bytes'])}"],
                [
                    [
                        size_label(r["bytes"]),
                        f"{r['mean90_ns']:.1f}",
                        f"{r['median_ns']:.0f}",
                        f"{r['p99_ns']:,.0f}",
                        ratio(r["mean90_ns"], base),
                    ]
                    if not r.get("error")
                    else [size_label(r["bytes"]), "FAILED: " + r["error"], "", "", ""]
                    for r in cost
                ],
            ),
            "",
            "acquire + release: the mean of the fastest 90% of the samples (the clock ticks in steps of 10 ns "
            "on this VM, too coarse for a median of 100 ns; the slowest 10% are preemptions).",
            "",
        ]
    if tput_png:
        L += ["![throughput](bench/throughput.png)", ""]
    return L
