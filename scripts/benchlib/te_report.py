"""The short table scripts/gpu_suite.sh prints after its Transformer Engine steps
(scripts/te_summary.py): from the JSON records of one results folder, the TE layer-spec checks,
the layer benchmark against te_grouped, the stock variant selection and the full-model comparison
against the fastest TE stock form. Missing records are left out; the goals of issue 23 are shown
next to the measured ratios."""

from __future__ import annotations

import json
from pathlib import Path

from .memory_search import largest_text

STEP_GOAL = 2.5  # moeblaze step time speedup over the fastest TE stock form
SEARCH_GOAL = 1.5  # largest micro-batch (or sequence) at equal memory


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check_lines(report: dict) -> list[str]:
    lines = ["| TE check | verdict |", "|---|---|"]
    for check in report.get("checks", []):
        verdict = "PASS" if check.get("pass") else "FAIL " + ", ".join(check.get("failed", [])) + (
            f" ({check['error']})" if check.get("error") else "")
        lines.append(f"| {check['check']} | {verdict} |")
    return lines


def layer_lines(bench: dict) -> list[str]:
    """Per config: moeblaze and te_grouped fwd+bwd ms and the speedup."""
    by_config = {}
    for r in bench.get("records", []):
        by_config.setdefault((r["config"], r["activation"]), {})[r["impl"]] = r
    lines = ["| layer config | act | moeblaze ms | te_grouped ms | speedup |", "|---|---|---|---|---|"]
    for (config, act), impls in by_config.items():
        ours, theirs = impls.get("moeblaze"), impls.get("te_grouped")

        def ms(r):
            return "-" if r is None else (r.get("error") or f"{r['ms_fwdbwd']:.2f}")

        speed = (f"{theirs['ms_fwdbwd'] / ours['ms_fwdbwd']:.2f}x" if ours and theirs and "error" not in ours
                 and "error" not in theirs else "-")
        lines.append(f"| {config} | {act} | {ms(ours)} | {ms(theirs)} | {speed} |")
    return lines


def selection_lines(family: str, record: dict) -> list[str]:
    selection = record.get("stock_selection") or {}
    parts = []
    for name, r in selection.get("variants", {}).items():
        parts.append(f"{name} {r['median_step_seconds'] * 1e3:.1f} ms" if "median_step_seconds" in r
                     else f"{name} not run")
    return [f"- {family}: fastest stock variant {selection.get('chosen')} ({'; '.join(parts)})"]


def compare_lines(rows: list[tuple[str, dict]]) -> list[str]:
    lines = [f"| family | stock (TE) ms | moeblaze ms | speedup (goal {STEP_GOAL:g}x) | tokens/s stock / moeblaze | "
             f"peak MiB stock / moeblaze | largest micro-batch stock / moeblaze (goal {SEARCH_GOAL:g}x) | losses |",
             "|---|---|---|---|---|---|---|---|"]
    for family, r in rows:
        runs = r.get("runs", {})
        base, cand = runs.get("baseline"), runs.get("candidate")
        if not (base and cand and "median_step_seconds" in base and "median_step_seconds" in cand):
            lines.append(f"| {family} | incomplete run{' (partial record)' if r.get('partial') else ''} |"
                         + " - |" * 6)
            continue
        speed = base["median_step_seconds"] / cand["median_step_seconds"]
        search = r.get("search") or {}
        fits = [search.get(k, {}).get("largest_fitting") for k in ("baseline", "candidate")]
        fit_text = (" / ".join(largest_text(search.get(k, {})) for k in ("baseline", "candidate"))
                    + (f" ({fits[1] / fits[0]:.2f}x)" if all(fits) else "") if search else "-")
        check = r.get("loss_check")
        losses = "-" if not check else (f"{'agree' if check['passed'] else 'DIVERGE'} over {len(check['steps'])} steps "
                                        f"(worst {check['worst_diff_over_tolerance']:.2f})")
        lines.append(
            f"| {family} | {base['median_step_seconds'] * 1e3:.1f} ({base.get('label', base['dispatcher'])}) | "
            f"{cand['median_step_seconds'] * 1e3:.1f} | {speed:.2f}x{'' if speed >= STEP_GOAL else ' (below goal)'} | "
            f"{base['tokens_per_second']:,.0f} / {cand['tokens_per_second']:,.0f} | "
            f"{base.get('peak_memory_bytes', 0) / 2**20:,.0f} / {cand.get('peak_memory_bytes', 0) / 2**20:,.0f} | "
            f"{fit_text} | {losses} |")
    return lines


def summary(out: Path) -> str:
    """The markdown summary of the TE records under ``out`` (empty when there are none)."""
    out = Path(out)
    sections = []
    check = _load(out / "gpu_megatron_check_te.json")
    if check:
        sections.append("\n".join(check_lines(check)))
    bench = _load(out / "bench_layer_te.json")
    if bench:
        sections.append("\n".join(layer_lines(bench)))
    selections = [line for path in sorted(out.glob("te_select_*.json")) if (record := _load(path))
                  for line in selection_lines(path.stem.removeprefix("te_select_"), record)]
    if selections:
        sections.append("\n".join(selections))
    compares = [(path.stem.removeprefix("te_compare_"), record) for path in sorted(out.glob("te_compare_*.json"))
                if (record := _load(path))]
    if compares:
        sections.append("\n".join(compare_lines(compares)))
    return "\n\n".join(sections)
