"""The PNG plots of the document."""

from __future__ import annotations

from pathlib import Path

from .common import e2e_run, latency_row, size_label, throughput_row


def plots(res: dict, outdir: Path) -> list[str]:
    """Writes the PNGs; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    names = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(outdir / name, dpi=110)
        plt.close(fig)
        names.append(name)

    t = res.get("transport")
    if t and t["latency"]:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        readers = sorted({r["readers"] for r in t["latency"]})
        for ax, mode in zip(axes, ("spin", "futex")):
            for tr, mk in (("tsock", "o-"), ("uds", "s--"), ("zmq", "^:")):
                pts = [(n, latency_row(t, tr, mode, n)) for n in readers]
                pts = [(n, r["median_us"]) for n, r in pts if r]
                if pts:
                    ax.plot(*zip(*pts), mk, label=tr)
            base = t["cache_line"] if mode == "spin" else t["futex"]
            ax.axhline(
                base["median_us"], color="grey", lw=1, label="cache-line handoff" if mode == "spin" else "futex wake-up"
            )
            ax.set(xscale="log", yscale="log", xlabel="readers", title=f"median one-way latency, {mode}")
            ax.set_xticks(readers, [str(n) for n in readers])
            ax.legend(fontsize=8)
        axes[0].set_ylabel("µs")
        save(fig, "latency.png")
    if t and t["throughput"]:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        small = [r for r in t["throughput"] if r["bytes"] == 4096 and not r.get("error")]
        labels = [f"{r['transport']}\n{r['readers']} rd" for r in small]
        axes[0].bar(labels, [r["batches_per_s"] for r in small], color="tab:blue")
        axes[0].set(yscale="log", ylabel="batches/s per reader", title="4 KiB batches, flat out")
        big = sorted({r["bytes"] for r in t["throughput"] if r["touch"]})
        mem = {m["bytes"]: m for m in t["memcpy"]}
        w = 0.2
        for j, (lab, get) in enumerate(
            (
                ("tsock, 1 reader", lambda s: (throughput_row(t, "tsock", 1, s, True) or {}).get("gb_per_s")),
                ("ZMQ, 1 reader", lambda s: (throughput_row(t, "zmq", 1, s, True) or {}).get("gb_per_s")),
                ("memcpy", lambda s: mem.get(s, {}).get("memcpy_gb_per_s")),
                ("read in-process", lambda s: mem.get(s, {}).get("read_gb_per_s")),
            )
        ):
            xs = [i + (j - 1.5) * w for i in range(len(big))]
            axes[1].bar(xs, [get(s) or 0 for s in big], w, label=lab)
        axes[1].set_xticks(range(len(big)), [size_label(s) for s in big])
        axes[1].set(ylabel="GB/s", title="bandwidth, every byte read")
        axes[1].legend(fontsize=8)
        save(fig, "throughput.png")
    e = res.get("e2e")
    if e and e["runs"]:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        ks = sorted({r["k"] for r in e["runs"]})
        for system, mk in (("own", "s--"), ("tsock", "o-"), ("tensorsocket", "^:")):
            pts = [(k, e2e_run(e, system, k)) for k in ks]
            pts = [(k, r) for k, r in pts if r]
            if pts:
                label = {"own": "a DataLoader per trainer"}.get(system, system)
                axes[0].plot([k for k, _ in pts], [r["aggregate"] for _, r in pts], mk, label=label)
                axes[1].plot([k for k, _ in pts], [r["cpu_per_sample_ms"] for _, r in pts], mk, label=label)
        axes[0].set(xlabel="trainers K", ylabel="samples/s, all trainers", title="aggregate training throughput")
        axes[1].set(xlabel="trainers K", ylabel="CPU ms per sample", title="CPU per sample (all processes)")
        for ax in axes:
            ax.set_xticks(ks)
            ax.legend(fontsize=8)
        save(fig, "e2e.png")
    if t and t.get("scaling"):
        fig, ax = plt.subplots(figsize=(6, 4))
        sc = [r for r in t["scaling"] if not r.get("error")]
        ax.plot([max(r["readers"], 0.5) for r in sc], [r["cpu_us_median"] for r in sc], "o-")
        ax.set(xscale="symlog", xlabel="sleeping readers", ylabel="producer CPU µs per publish", title="producer cost")
        save(fig, "scaling.png")
    c = res.get("cache")
    if c and c.get("hit_rates"):
        h = c["hit_rates"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        pct = [100 * f for f in h["fractions"]]
        titles = {
            "shared": "one shared pipeline (the sweep above)",
            "own": f"{h['k']} pipelines of their own, one cache",
        }
        styles = (("optimum", "k-", "offline optimum"), ("belady", "o--", "Belady (store)"))
        styles += (("lru", "s:", "LRU"), ("fill-once", "^-.", "fill-once"))
        for ax, trace in zip(axes, ("shared", "own")):
            for policy, mk, label in styles:
                ax.plot(pct, h[trace][policy], mk, label=label, lw=1.5 if policy == "optimum" else 1)
            ax.set(xlabel="cache, % of the decoded dataset", title=titles[trace], ylim=(0, 1))
        for policy, mk in (("belady", "D"), ("lru", "x")):
            pts = [
                (float(r["system"].split("@")[1]), r["hit_rate"])
                for r in c["runs"]
                if r["system"].startswith(f"tsock+{policy}@") and "hit_rate" in r
            ]
            if pts:
                axes[0].plot(*zip(*pts), mk, ms=8, mfc="none", label=f"{policy}, measured (both sources)")
        axes[0].set_ylabel(f"hit rate over {h['epochs']} epochs")
        for ax in axes:
            ax.legend(fontsize=8)
        save(fig, "cache.png")
    return names
