"""compare_dispatchers.py's report.md: the runs' table (step time, tokens/s, memory, the search),
the stock variants timed, the ratios, the loss table against its tolerance and the resume check."""

from __future__ import annotations

from .comparison import mib, run_label
from .memory_search import largest_text
from .wording import faster, larger, less


def markdown(result: dict) -> str:
    base, cand = result["runs"]["baseline"], result["runs"]["candidate"]
    lines = [
        f"# {run_label(cand)} vs {run_label(base)}: {result['config']['family']} on {result['environment']['device']}",
        "",
        f"Command: `{result['command']}`",
        "",
        "| dispatcher | median step (ms) | tokens/s | peak memory (MiB) | saved for backward (MiB) |"
        + (f" largest {result['search']['dimension']} in {result['config']['memory_budget_gib']:g} GiB |"
           if result.get("search") else ""),
        "|---|---|---|---|---|" + ("---|" if result.get("search") else ""),
    ]
    for run_name, run in (("baseline", base), ("candidate", cand)):
        row = (f"| {run_label(run)} | {run['median_step_seconds'] * 1e3:.1f} | {run['tokens_per_second']:,.0f} | "
               f"{mib(run.get('peak_memory_bytes'))} | {mib(run.get('saved_activation_bytes'))} |")
        if result.get("search"):
            row += f" {largest_text(result['search'][run_name])} |"
        lines.append(row)
    if any(r.get("extra_args") for r in (base, cand)):
        lines += [""] + [f"{run_label(r)} flags: `{' '.join(r['extra_args'])}`" for r in (base, cand) if r.get("extra_args")]
    if result.get("stock_selection"):
        lines += ["", "Stock variants, each timed from the same weights on the same batches; the fastest is the "
                  "baseline:", "", *variants_markdown(result["stock_selection"])]
    ratios = result["ratios"]
    said = [f"step time {faster(ratios['step_time_speedup'])} with {run_label(cand)}"]
    if ratios.get("saved_activation_fraction"):
        said.append(f"saved activations {less(ratios['saved_activation_fraction'])}")
    if ratios.get("largest_fitting_ratio"):
        said.append(f"largest {result['search']['dimension']} {larger(ratios['largest_fitting_ratio'])}")
    lines += ["", "Against " + run_label(base) + ": " + "; ".join(said) + "."]
    check = result["loss_check"]
    lines += ["", f"## Losses ({'agree' if check['passed'] else 'DIVERGE'}: worst |diff| / tolerance = "
              f"{check['worst_diff_over_tolerance']:.2f})", "",
              f"Tolerance per step: max({check['noise_factor']:g} x the running max of |control - "
              f"{check.get('control_of', 'baseline')}|, "
              f"{check['noise_floor_roundoffs']:g} x max({check['unit_roundoff']:.2e} x loss / sqrt("
              f"{check['tokens_per_step']} tokens), float32 ulp of the loss)); the control run repeats the "
              f"{check.get('control_of', 'baseline')} with every initial weight moved by one ulp.", "",
              "| step | baseline | candidate | control | abs diff | tolerance |", "|---|---|---|---|---|---|"]
    rows = check["steps"]
    shown = sorted({0, len(rows) - 1, *range(0, len(rows), max(1, len(rows) // 10))})
    for i in shown:
        r = rows[i]
        lines.append(f"| {r['step']} | {r['baseline']:.5f} | {r['candidate']:.5f} | {r['control']:.5f} | "
                     f"{r['abs_diff']:.2e} | {r['tolerance']:.2e} |")
    if result.get("resume"):
        resume = result["resume"]
        lines += ["", f"## Resume ({'ok' if resume['passed'] else 'FAILED'})", "",
                  f"Tiny model, {resume['steps']} steps; the {run_label(base)} run saved a Megatron "
                  f"checkpoint at step {resume['checkpoint_step']}, resumed under each dispatcher:", ""]
        for name, r in resume["resumed"].items():
            lines.append(f"- {name}: max |loss diff| vs uninterrupted {r['max_abs_diff']:.2e} "
                         f"(worst diff / tolerance {r['worst_diff_over_tolerance']:.2f})")
    return "\n".join(lines) + "\n"


def variants_markdown(selection: dict) -> list[str]:
    """The stock variants' table: flags, median step time or why it did not run, the chosen one."""
    lines = [f"| stock variant | flags (stock / both) | median step (ms) over {selection['steps'] - selection['warmup']} "
             f"steps |", "|---|---|---|"]
    for name, r in selection["variants"].items():
        flags = " ".join(r["stock_args"]) + " / " + (" ".join(r["shared_args"]) or "-")
        flags += "".join(f" ({k}={v})" for k, v in r["env"].items())
        time_ = f"{r['median_step_seconds'] * 1e3:.1f}" if "median_step_seconds" in r else f"not run: {r['error']}"
        lines.append(f"| {name}{' (chosen)' if name == selection['chosen'] else ''} | {flags} | {time_} |")
    return lines
