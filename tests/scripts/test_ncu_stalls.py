"""scripts/ncu_stalls.py and benchlib/ncu_source.py on a small source page written here in ncu's
CSV layout: samples grouped by loop level, the costliest instructions, plain and gzip input, and
a clear error for a file that is not a source page."""

from __future__ import annotations

import gzip
import random

import pytest

from benchlib.ncu_source import by_loop, read_source, report
from ncu_stalls import main

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "# Samples", "Instructions Executed", "stall_barrier", "stall_long_sb", "stall_wait",
          "stall_long_sb (Not Issued)"]


def _page(tmp_path, rows, compress=False):
    lines = ['"Kernel Name","gather_gemm_ws_kernel",', ",".join(f'"{h}"' for h in HEADER)]
    for n, (sass, executed, barrier, long_sb, wait) in enumerate(rows):
        total = barrier + long_sb + wait
        lines.append(",".join(f'"{v}"' for v in (
            hex(0x7f00 + 16 * n), f"      {sass}", total, total, total, f"{executed:,}", barrier, long_sb, wait, 0)))
    text = "\n".join(lines) + "\n"
    path = tmp_path / ("page.csv.gz" if compress else "page.csv")
    path.write_bytes(gzip.compress(text.encode()) if compress else text.encode())
    return path


def _random_rows(rng):
    """A prologue run once, a per-tile loop, a per-step loop and a spin, with random samples."""
    rows = [("LDC R1, c[0x0][0x28]", 132, 0, 0, rng.randint(0, 9))]
    rows += [(f"IADD3 R{i}, R{i}, 0x1, RZ", 5000, rng.randint(0, 50), rng.randint(0, 500), rng.randint(0, 50))
             for i in range(4)]
    rows += [("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], R24", 160000, 0, rng.randint(0, 9), rng.randint(100, 900)),
             ("@!P5  BRA 0x7f00", 160000, 0, rng.randint(1000, 5000), 0)]
    rows += [("@!P3  BRA 0x7f40", 9_000_000, 0, rng.randint(6000, 9000), 1)]
    return rows


@pytest.mark.parametrize("compress", [False, True])
def test_samples_by_loop_level_and_instruction(tmp_path, compress):
    rng = random.Random()
    rows = _random_rows(rng)
    kernel, instructions = read_source(str(_page(tmp_path, rows, compress)))
    assert kernel == "gather_gemm_ws_kernel" and [i.executed for i in instructions] == [r[1] for r in rows]
    assert [i.samples for i in instructions] == [sum(r[2:]) for r in rows]
    assert instructions[5].sass.startswith("HGMMA") and instructions[6].stalls["long_sb"] == rows[6][3]
    loops = by_loop(instructions)
    expected = {}
    for sass, executed, *stalls in rows:
        expected[executed] = expected.get(executed, 0) + sum(stalls)
    assert {e: s for e, _, s, _ in loops} == expected
    assert [s for _, _, s, _ in loops] == sorted(expected.values(), reverse=True)
    per_tile = next(g for g in loops if g[0] == 5000)
    assert per_tile[1] == 4 and per_tile[3]["long_sb"] == sum(r[3] for r in rows[1:5])
    text = report(str(_page(tmp_path, rows, compress)), top=2)
    spin = max(instructions, key=lambda i: i.samples)
    assert f"| {spin.index} | {spin.executed} | {spin.samples} |" in text
    assert text.count("`") == 4  # two instructions listed


def test_the_script_prints_the_report_and_refuses_another_csv(tmp_path, capsys):
    path = _page(tmp_path, _random_rows(random.Random()))
    assert main([str(path), "--top", "3"]) == 0
    assert "gather_gemm_ws_kernel: 8 instructions" in capsys.readouterr().out
    other = tmp_path / "details.csv"
    other.write_text('"ID","Process ID"\n"0","1"\n')
    with pytest.raises(SystemExit):
        main([str(other)])
    assert "expected ncu's source page as CSV" in capsys.readouterr().err
