"""What the two training comparisons (compare_dispatchers.py, compare_torchtitan.py) share: the
progress lines, each step's record, the median step and the ratios of the candidate's run to the
baseline's (and how a ratio is worded), the loss check against the rounding noise a control run
measures, and the loss overlay.

The loss check: at every step the candidate's loss must lie within NOISE_FACTOR x the running
maximum of |control - reference| of the baseline's, the control being the reference run repeated
from weights moved by one ulp; before the control has diverged, NOISE_FLOOR x the loss's own
rounding noise u |loss| / sqrt(tokens per step), and never less than NOISE_FLOOR float32 ulps.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

NOISE_FACTOR = 4.0
NOISE_FLOOR = 4.0


class ArgumentError(SystemExit):
    """An argument the comparison cannot run with, found before anything is built: exit status 2,
    as argparse's own errors; ``argument_errors`` prints it as one line naming the flag."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def check_counts(parser, args, positive, steps="steps") -> None:
    """The numbers both comparisons take, checked where the command line is parsed:
    ``positive`` (names of args) above 0 where given, --warmup at least 0, ``steps`` at least 4
    (warm-up plus timed steps); ``parser.error`` names the flag otherwise."""
    for name in positive:
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    if getattr(args, steps) is not None and getattr(args, steps) < 4:
        parser.error(f"--steps must be at least 4 (warmup plus timed steps), got {getattr(args, steps)}")


def argument_errors(prog: str, resolve, *args):
    """``resolve(*args)``'s result; on an ArgumentError, "prog: error: message" on stderr and
    the exit status 2 (then the result is None)."""
    try:
        return resolve(*args), 0
    except ArgumentError as error:
        print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
        return None, 2


class Progress:
    """Prints a message with the seconds since it was made."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f}s] {message}", flush=True)


def record_step(record: dict, result, label: str, index: int, steps: int, progress, iteration: int) -> None:
    """Append step ``index``'s loss, time and tokens to ``record``; fail on a non-finite loss
    (``iteration``: the trainer's step count, for the message); report six times a run."""
    record["losses"].append(result.loss)
    record["step_seconds"].append(result.seconds)
    record["tokens_per_step"] = result.tokens
    if not math.isfinite(result.loss):
        raise RuntimeError(f"{label}: loss is {result.loss} at step {iteration}")
    if (index + 1) % max(1, steps // 6) == 0 or index + 1 == steps:
        progress(f"  {label}: step {index + 1:4d}/{steps}  loss {result.loss:.4f}  {result.seconds * 1e3:8.1f} ms/step")


def comparison_ratios(base: dict, cand: dict, search: dict | None, byte_keys=("saved_activation_bytes",)) -> dict:
    """The candidate's run against the baseline's, each ratio named for its direction:
    ``step_time_speedup`` baseline / candidate step time; ``<name>_fraction`` candidate / baseline
    bytes for each of ``byte_keys`` ("<name>_bytes") and the peak (below 1: less);
    ``largest_fitting_ratio`` candidate / baseline largest fitting size of the memory search."""
    ratios = {"step_time_speedup": base["median_step_seconds"] / cand["median_step_seconds"]}
    for key in byte_keys:
        if base.get(key) is not None and cand.get(key) is not None:  # None: not counted
            ratios[key.removesuffix("_bytes") + "_fraction"] = cand[key] / max(1, base[key])
    if base.get("peak_memory_bytes"):
        ratios["peak_memory_fraction"] = cand["peak_memory_bytes"] / base["peak_memory_bytes"]
    if search and search["baseline"]["largest_fitting"] and search["candidate"]["largest_fitting"]:
        ratios["largest_fitting_ratio"] = search["candidate"]["largest_fitting"] / search["baseline"]["largest_fitting"]
    return ratios


def summarize(record: dict, warmup: int) -> None:
    """Add the run's median step time (its first ``warmup`` steps left out) and tokens/s."""
    timed = record["step_seconds"][warmup:]
    record["median_step_seconds"] = statistics.median(timed)
    record["tokens_per_second"] = record["tokens_per_step"] / record["median_step_seconds"]


def loss_check(baseline: list[float], candidate: list[float], control: list[float], unit_roundoff: float,
               tokens_per_step: int, control_of: str = "baseline") -> dict:
    """Per step: |candidate - baseline| <= max(NOISE_FACTOR * envelope, floor), the envelope being
    the running maximum of |control - reference| (the reference: the run the control repeats from
    weights moved by one ulp, ``control_of`` "baseline" or "candidate") and the floor
    NOISE_FLOOR * max(u * |baseline| / sqrt(tokens_per_step), float32 ulp of the baseline)."""
    import numpy

    if control_of not in ("baseline", "candidate"):
        raise ValueError(f"control_of must be 'baseline' or 'candidate', got {control_of!r}")
    reference = baseline if control_of == "baseline" else candidate
    envelope, rows, worst = 0.0, [], 0.0
    for step, (b, c, k, r) in enumerate(zip(baseline, candidate, control, reference), start=1):
        envelope = max(envelope, abs(k - r))
        floor = NOISE_FLOOR * max(unit_roundoff * abs(b) / math.sqrt(tokens_per_step),
                                  float(numpy.spacing(numpy.float32(abs(b)))))
        tolerance = max(NOISE_FACTOR * envelope, floor)
        diff = abs(c - b)
        worst = max(worst, diff / tolerance)
        rows.append({"step": step, "baseline": b, "candidate": c, "control": k, "abs_diff": diff,
                     "tolerance": tolerance})
    return {"passed": worst <= 1.0, "worst_diff_over_tolerance": worst, "noise_factor": NOISE_FACTOR,
            "noise_floor_roundoffs": NOISE_FLOOR, "unit_roundoff": unit_roundoff,
            "tokens_per_step": tokens_per_step, "control_of": control_of, "steps": rows}


def mib(value) -> str:
    """Bytes in MiB for a table: whole MiB from 100 up, two decimals below, n/a for None."""
    if value is None:
        return "n/a"
    mebibytes = value / 2**20
    return f"{mebibytes:,.0f}" if mebibytes >= 100 else f"{mebibytes:.2f}"


def run_label(run: dict) -> str:
    """How a run is named in a report: its label, else its dispatcher."""
    return run.get("label", run["dispatcher"])


def plot(path: Path, result: dict) -> bool:
    """The loss overlay at ``path``; False where matplotlib is missing (said once, nothing written)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no losses.png (pip install matplotlib)", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["loss_check"]["steps"]
    steps = [r["step"] for r in rows]
    base, cand = run_label(result["runs"]["baseline"]), run_label(result["runs"]["candidate"])
    control_of = result["loss_check"].get("control_of", "baseline")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    top.plot(steps, [r["baseline"] for r in rows], label=base, linewidth=2)
    top.plot(steps, [r["candidate"] for r in rows], label=cand, linewidth=1.2, linestyle="--")
    top.set_ylabel("lm loss")
    top.set_title(f"{result['config']['family']}: {cand} vs {base} ({result['environment']['device']})")
    top.legend()
    bottom.semilogy(steps, [max(r["abs_diff"], 1e-12) for r in rows], label=f"|{cand} - {base}|")
    bottom.semilogy(steps, [max(abs(r["control"] - r[control_of]), 1e-12) for r in rows],
                    label=f"|control - {control_of}| (1-ulp weights)", alpha=0.7)
    bottom.semilogy(steps, [r["tolerance"] for r in rows], label="tolerance", color="black", linestyle=":")
    bottom.set_xlabel("step")
    bottom.set_ylabel("abs loss difference")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
