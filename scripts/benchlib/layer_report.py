"""bench_layer's report: the markdown table of its records and the chart, from a run or a saved
JSON (``scripts/bench_layer.py --report-only``)."""

from __future__ import annotations

import json
import os

from .nvml import SAMPLE_PERIOD_S


def rewrite_report(path):
    """The markdown table and the chart of a saved run (its JSON at ``path``), written beside it."""
    with open(path) as f:
        saved = json.load(f)
    write_report(saved["meta"], saved["notes"], saved["records"], os.path.dirname(path) or ".",
                 os.path.splitext(os.path.basename(path))[0])


def write_report(meta, notes, records, out, tag):
    """``out``/``tag``.md (the table, printed too) and ``out``/``tag``.png (the chart, where
    matplotlib is installed)."""
    table = markdown_table(meta, notes, records)
    with open(os.path.join(out, f"{tag}.md"), "w") as f:
        f.write(table)
    try:
        plot(records, os.path.join(out, f"{tag}.png"))
    except ImportError:
        print("matplotlib is not installed: no chart", flush=True)
    print(table)


def plot(records, path):
    """Speedup over the best peer and bytes saved for backward, per config, as the paper's figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "error" not in r]
    acts = sorted({r["activation"] for r in ok})
    fig, axes = plt.subplots(2, len(acts), figsize=(7 * len(acts), 8), squeeze=False)
    for col, act in enumerate(acts):
        recs = [r for r in ok if r["activation"] == act]
        configs = list(dict.fromkeys(r["config"] for r in recs))
        impls = list(dict.fromkeys(r["impl"] for r in recs))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            speed, mem = [], []
            for cfg in configs:
                group = [r for r in recs if r["config"] == cfg]
                mine = next((r for r in group if r["impl"] == impl), None)
                # grouped_mm in its faster layout (contiguous copies or transposed views).
                base = min((r for r in group if r["impl"].startswith("grouped_mm")), key=lambda r: r["ms_fwdbwd"],
                           default=None)
                speed.append(base["ms_fwdbwd"] / mine["ms_fwdbwd"] if mine and base else 0)
                mem.append(mine["saved_bytes"] / 2**30 if mine else 0)
            xs = [c + (i - len(impls) / 2 + 0.5) * width for c in range(len(configs))]
            axes[0, col].bar(xs, speed, width, label=impl)
            axes[1, col].bar(xs, mem, width, label=impl)
        for row, ylabel in enumerate(("speedup over grouped_mm (fwd+bwd)", "saved for backward (GiB)")):
            ax = axes[row, col]
            ax.set_xticks(range(len(configs)))
            ax.set_xticklabels(configs, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{act}")
        axes[0, col].axhline(1.0, color="gray", lw=0.8)
        axes[0, col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def timing_lines(timing):
    """How the times were taken (runs before the sustained timing have no ``timing``)."""
    if not timing:
        return []
    return [f"Each fwd+bwd time is the median of at least {timing['min_reps']} steps timed over at least "
            f"{timing['seconds']:g} s, after {timing['warmup_seconds']:g} s of warm-up steps (fwd: half of each; queued: "
            f"half the time, no warm-up), so every implementation is timed in the clock and power state it holds "
            f"under sustained load. % matmul: of the burst rate; % sustained: of the dense matmul timed the same "
            f"way as the layer.", ""]


def markdown_table(meta, notes, records):
    lines = [
        "# bench_layer: one MoE layer, forward+backward, routing given",
        "",
        f"{meta['date']} on {meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}; "
        f"dense bf16 matmul in the same run: {meta['matmul_peak_tflops']:.0f} TFLOP/s in a burst"
        + (f", {meta['matmul_sustained_tflops']:.0f} sustained." if "matmul_sustained_tflops" in meta else "."),
        f"Command: `{meta['command']}`" + "".join(f" with {k}={v}" for k, v in meta.get("env", {}).items()),
        "",
        *timing_lines(meta.get("timing")),
        "host ms: how long the forward+backward call took to return on the host (its launches and any "
        "synchronization); where it nears fwd+bwd ms the GPU waits on the host. queued ms: fwd+bwd with its "
        "launches queued behind ~20 ms of GPU work, so no wait on the host is timed (as inside a model; an "
        "implementation that synchronizes with the host still waits there). The GPU also enters the step from "
        "another clock and power state then (on the large shapes every implementation ran ~10% faster queued): "
        "compare implementations within one column.",
        "",
        "| config | act | impl | fwd ms | fwd+bwd ms | host ms | queued ms | TFLOP/s | % matmul | % sustained | "
        "vs best peer | saved MiB | floor MiB | peak MiB | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups = {}
    for r in records:
        groups.setdefault((r["config"], r["activation"]), []).append(r)
    for (cfg, act), recs in groups.items():
        ok = [r for r in recs if "error" not in r]
        peers = [r["ms_fwdbwd"] for r in ok if not r["impl"].startswith("moeblaze")]
        best_peer = min(peers) if peers else None
        for r in recs:
            if "error" in r:
                lines.append(f"| {cfg} | {act} | {r['impl']} |" + " - |" * 11 + f" {r['error']} |")
                continue
            speed = f"{best_peer / r['ms_fwdbwd']:.2f}x" if best_peer else "-"
            check = "ok" if r.get("check_ok", True) else "FAIL"
            # Older runs lack some columns.
            host, queued = (f"{r[k]:.2f}" if k in r else "-" for k in ("host_ms_fwdbwd", "ms_fwdbwd_queued"))
            sustained = f"{r['pct_of_sustained_matmul']:.0f}%" if "pct_of_sustained_matmul" in r else "-"
            lines.append(
                f"| {cfg} | {act} | {r['impl']} | {r['ms_fwd']:.2f} | {r['ms_fwdbwd']:.2f} | {host} | {queued} | {r['tflops']:.0f} | "
                f"{r['pct_of_matmul']:.0f}% | {sustained} | {speed} | {r['saved_bytes'] / 2**20:.0f} | {r['floor_bytes'] / 2**20:.0f} | "
                f"{r['peak_bytes'] / 2**20:.0f} | {check} |")
    lines += power_lines(records)
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def power_lines(records):
    """The power table of the records that read it (none: no lines): energy per back-to-back
    fwd+bwd step, mean power and SM clock, and how often the power cap held the clock down."""
    read = [r for r in records if r.get("power_fwdbwd")]
    if not read:
        return []
    lines = ["", f"Power over the timed back-to-back fwd+bwd steps (NVML, sampled every {1e3 * SAMPLE_PERIOD_S:g} ms). "
             "Where the power cap "
             "holds the clock down, the step time is its energy over the power the board allows, so J/step is what "
             "an implementation's speed there comes down to.", "",
             "| config | act | impl | fwd+bwd ms | J/step | mean W | SM MHz | power-capped |", "|---|---|---|---|---|---|---|---|"]
    for r in read:
        p = r["power_fwdbwd"]
        lines.append(f"| {r['config']} | {r['activation']} | {r['impl']} | {r['ms_fwdbwd']:.2f} | "
                     f"{p['joules_per_step']:.2f} | {p['mean_watts']:.0f} | {p['mean_sm_mhz']:.0f} | "
                     f"{100 * p['power_capped_share']:.0f}% |")
    return lines
