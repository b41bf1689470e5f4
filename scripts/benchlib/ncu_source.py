"""Nsight Compute's source page (``ncu -i X.ncu-rep --page source --csv --print-source sass``, the
gpu_suite ncu step's ncu_source.csv) read back: per SASS instruction its warp-state samples by
stall reason, and where a kernel's warps spend them.

Instructions that run the same number of times belong to the same loop level (once per launch,
per tile, per k-step, a spin on a barrier), so grouping the samples by execution count splits a
persistent kernel's time between its loops without reading its SASS by hand; the costliest
instructions name what each loop waits on.
"""

from __future__ import annotations

import csv
import gzip
import io
from collections import Counter
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Instruction:
    index: int  # position in the kernel's SASS
    sass: str
    executed: int
    samples: int
    stalls: Counter = field(default_factory=Counter)  # reason -> samples

    def top(self, n=3) -> str:
        return " ".join(f"{k}:{v}" for k, v in self.stalls.most_common(n) if v)


def _number(text: str) -> int:
    text = text.replace(",", "").strip()
    return int(float(text)) if text and text not in ("-", "n/a") else 0


def read_source(path: str) -> tuple[str, list[Instruction]]:
    """(kernel name, its instructions) from a source-page CSV, gzip-compressed or not."""
    raw = open(path, "rb").read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    rows = list(csv.reader(io.StringIO(raw.decode())))
    if len(rows) < 2 or rows[0][:1] != ["Kernel Name"]:
        raise ValueError(f"{path}: expected ncu's source page as CSV (a 'Kernel Name' line, then a header)")
    header = rows[1]
    missing = [c for c in ("Address", "Source", SAMPLES, EXECUTED) if c not in header]
    if missing:
        raise ValueError(f"{path}: the source page has no column {missing[0]!r}: profile with --section SourceCounters")
    col = {name: i for i, name in enumerate(header)}
    reasons = [name for name in header if name.startswith("stall_") and "(Not Issued)" not in name]
    instructions = [
        Instruction(n, row[col["Source"]].strip(), _number(row[col[EXECUTED]]), _number(row[col[SAMPLES]]),
                    Counter({r[len("stall_"):]: _number(row[col[r]]) for r in reasons}))
        for n, row in enumerate(rows[2:]) if len(row) == len(header)]
    return rows[0][1], instructions


def by_loop(instructions: list[Instruction]) -> list[tuple[int, int, int, Counter]]:
    """(execution count, instructions, samples, samples by reason) per execution count, most sampled first."""
    groups: dict[int, list[Instruction]] = {}
    for ins in instructions:
        groups.setdefault(ins.executed, []).append(ins)
    out = []
    for executed, members in groups.items():
        reasons = Counter()
        for ins in members:
            reasons.update(ins.stalls)
        out.append((executed, len(members), sum(i.samples for i in members), reasons))
    return sorted(out, key=lambda g: -g[2])


def report(path: str, top: int = 25, loops: int = 8) -> str:
    """The loop levels and costliest instructions of one source page, as text."""
    kernel, instructions = read_source(path)
    total = sum(i.samples for i in instructions) or 1
    lines = [f"{kernel}: {len(instructions)} instructions, {total} samples", "",
             "| executed | instructions | samples | share | top reasons |", "|---|---|---|---|---|"]
    for executed, count, samples, reasons in by_loop(instructions)[:loops]:
        why = " ".join(f"{k}:{v}" for k, v in reasons.most_common(4) if v)
        lines.append(f"| {executed} | {count} | {samples} | {100 * samples / total:.1f}% | {why} |")
    lines += ["", "| # | executed | samples | share | SASS | top reasons |", "|---|---|---|---|---|---|"]
    for ins in sorted(instructions, key=lambda i: -i.samples)[:top]:
        lines.append(f"| {ins.index} | {ins.executed} | {ins.samples} | {100 * ins.samples / total:.1f}% | "
                     f"`{ins.sass}` | {ins.top()} |")
    return "\n".join(lines)
