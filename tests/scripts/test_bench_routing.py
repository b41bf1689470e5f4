"""scripts/bench_routing.py runs end to end in its tiny CPU mode and writes what it promises."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_quick_mode_writes_json_and_table(tmp_path):
    out = tmp_path / "routing.json"
    # Without TRITON_INTERPRET: --device cpu must set it itself before the kernels are imported.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_routing.py"), "--device", "cpu", "--quick", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    for key in ("gpu", "torch", "triton", "date", "command", "megatron", "records"):
        assert result[key], key
    methods = ("three_step", "sort", "auto", "auto_validated", "argsort", "megatron", "masked_select")
    assert len(result["records"]) == 8  # 2 T x 2 E x 2 K
    for record in result["records"]:
        assert all(record["median_ms"][m] > 0 for m in methods), record
        assert record["auto_vs_best"] > 0 and record["speedup_three_step_vs_argsort"] > 0
        # GPU time comes from CUDA graph replays: none on the CPU, every field still present.
        for key in ("graph_ms", "graph_p20_ms", "graph_p80_ms"):
            assert record[key] == dict.fromkeys(methods), (key, record[key])
        assert record["graph_auto_vs_best"] is None and record["graph_speedup_three_step_vs_argsort"] is None
    assert result["graph_not_captured"] == {}
    assert any(line.startswith("eager: auto against the best of") for line in result["summary"]), result["summary"]
    # Ratios are said in words that fit their side of 1, and no internal goal is printed.
    for line in result["summary"]:
        assert ">=" not in line and not re.search(r"\b0\.\d+x (faster|slower)", line), line
    assert result["summary"][0] == "GPU (CUDA graph): not measured"  # the GPU lines come first
    table = out.with_suffix(".md").read_text()
    assert "host-launch bound" in table  # why the GPU lines matter more than the eager ones
    assert table.count("\n| ") == 1 + len(result["records"])  # header and one row per shape
    header = next(line for line in table.splitlines() if line.startswith("| T |"))
    assert all(f"| {m} graph |" in header for m in ("three_step", "sort", "argsort")), header
    assert done.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])  # the table is printed last
    assert "every method matches the torch plan" in done.stdout
