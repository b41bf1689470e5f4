"""How a ratio of two measurements is said in a report: "1.27x faster" above 1, "1.27x slower"
below it (the inverse, never "0.79x faster"), "level" where both read 1.00x."""

from __future__ import annotations

import math


def times(ratio: float, above: str, below: str) -> str:
    """``ratio`` (what is better when larger, e.g. the baseline's time over the candidate's) in
    words: "1.27x {above}" where it exceeds 1, "1.27x {below}" (its inverse) where it is under 1,
    "level (1.00x)" where both show as 1.00."""
    if not (math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"a ratio of two measurements is finite and positive, got {ratio!r}")
    if f"{ratio:.2f}" == "1.00" and f"{1 / ratio:.2f}" == "1.00":
        return "level (1.00x)"
    return f"{ratio:.2f}x {above}" if ratio > 1 else f"{1 / ratio:.2f}x {below}"


def faster(speedup: float) -> str:
    """A speedup (the other's time over this one's) as "Nx faster" or "Nx slower"."""
    return times(speedup, "faster", "slower")


def less(fraction: float) -> str:
    """A fraction (this one's bytes over the other's) as "Nx less" or "Nx more"."""
    if not (math.isfinite(fraction) and fraction > 0):
        raise ValueError(f"a fraction of two byte counts is finite and positive, got {fraction!r}")
    return times(1 / fraction, "less", "more")


def larger(ratio: float) -> str:
    """A size ratio (this one's over the other's) as "Nx larger" or "Nx smaller"."""
    return times(ratio, "larger", "smaller")
