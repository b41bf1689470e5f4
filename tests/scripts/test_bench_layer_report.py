"""scripts/bench_layer.py's report (markdown table from saved records) runs without a GPU and
says what the records say: speed against the best peer, host time where recorded, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_layer.py"


def _record(impl, ms, **extra):
    return dict(config="qwen3-30b-like", T=64, d=16, h=8, E=4, K=2, activation="swiglu", impl=impl,
                ms_fwd=ms / 3, ms_fwdbwd=ms, tflops=100.0, pct_of_matmul=20.0, saved_bytes=2**20,
                floor_bytes=2**20, peak_bytes=3 * 2**20, check_ok=True, **extra)


def test_report_only_rewrites_the_table(tmp_path):
    meta = dict(gpu="test GPU", torch="t", triton="t", date="2026-11-29", command="python scripts/bench_layer.py",
                matmul_peak_tflops=500.0, matmul_sustained_tflops=400.0, env={"MOEBLAZE_AUTOTUNE": "0"},
                timing=dict(min_reps=5, seconds=2.0, warmup_seconds=1.0))
    records = [
        _record("moeblaze", 5.0, host_ms_fwdbwd=1.25, ms_fwdbwd_queued=4.5, pct_of_sustained_matmul=25.0),
        _record("grouped_mm", 10.0),  # a record from before host time was measured
        _record("scattermoe", 7.5, host_ms_fwdbwd=7.0),
        dict(config="qwen3-30b-like", activation="swiglu", impl="liger", error="OOM"),
    ]
    saved = tmp_path / "layer.json"
    saved.write_text(json.dumps(dict(meta=meta, notes=["megablocks: not run (ImportError)"], records=records)))
    done = subprocess.run([sys.executable, str(SCRIPT), "--report-only", str(saved)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    table = (tmp_path / "layer.md").read_text()
    rows = {line.split(" | ")[2]: line.split(" | ") for line in table.splitlines() if line.startswith("| qwen3")}
    header = next(line for line in table.splitlines() if line.startswith("| config")).split(" | ")
    col = {name.strip("| "): i for i, name in enumerate(header)}
    # The best peer is ScatterMoE (7.5 ms): moeblaze 1.50x, grouped_mm 0.75x.
    assert rows["moeblaze"][col["vs best peer"]] == "1.50x"
    assert rows["grouped_mm"][col["vs best peer"]] == "0.75x"
    assert rows["moeblaze"][col["host ms"]] == "1.25"
    assert rows["grouped_mm"][col["host ms"]] == "-"
    assert rows["moeblaze"][col["queued ms"]] == "4.50"
    assert rows["scattermoe"][col["queued ms"]] == "-"
    assert rows["moeblaze"][col["% matmul"]] == "20%"
    assert rows["moeblaze"][col["% sustained"]] == "25%"
    assert rows["grouped_mm"][col["% sustained"]] == "-"  # a record from before the sustained rate
    assert "500 TFLOP/s in a burst, 400 sustained." in table
    assert "median of at least 5 steps timed over at least 2 s, after 1 s of warm-up" in table
    assert rows["liger"][-1].strip("| ") == "OOM"
    assert len(rows["liger"]) == len(header)
    assert "megablocks: not run" in table
    assert "Command: `python scripts/bench_layer.py` with MOEBLAZE_AUTOTUNE=0" in table


def refusal(*argv):
    """bench_layer.py's exit status and stderr for a command line it should refuse."""
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    return done.returncode, done.stderr


@pytest.mark.parametrize("flag", ["--seconds", "--warmup-seconds"])
def test_negative_timing_is_refused_by_name(flag):
    returncode, stderr = refusal(flag, "-1")
    assert returncode == 1
    assert re.search("--seconds and --warmup-seconds must be >= 0", stderr), stderr[-2000:]


def test_no_timed_steps_is_refused_by_name():
    returncode, stderr = refusal("--reps", "0")
    assert returncode == 1
    assert re.search("--reps must be at least 1 .*, got 0", stderr), stderr[-2000:]


def test_first_call_compile_times_come_from_tritons_listener():
    import triton
    from benchlib.layer_bench import _compiled_text
    from benchlib.profiling import compile_times
    from triton.knobs import CompileTimes

    seen = []

    def previous(**kw):
        seen.append(kw["cache_hit"])

    triton.knobs.compilation.listener = previous
    try:
        with compile_times() as compiled:
            listener = triton.knobs.compilation.listener
            for hit, cubin in ((False, 2_000_000), (True, 0), (False, 500_000)):
                listener(src=None, metadata={}, metadata_group={}, cache_hit=hit,
                         times=CompileTimes(ir_initialization=100_000, lowering_stages=[("ttgir", 400_000), ("cubin", cubin)],
                                            store_results=0))
        assert triton.knobs.compilation.listener is previous  # the previous listener is back
    finally:
        triton.knobs.compilation.listener = None
    assert seen == [False, True, False]  # and it saw every compilation meanwhile
    assert compiled == {"kernels": 2, "cache_hits": 1, "seconds": pytest.approx(3.5), "ptxas_seconds": pytest.approx(2.5),
                        "worker_kernels": 0, "worker_seconds": 0.0}  # no compile workers under the interpreter
    assert _compiled_text({"first_call_compile": compiled}) == " (compiling 3.5 s, ptxas 2.5, 2 kernels)"
    # What the compile workers did is named beside it.
    helped = dict(compiled, kernels=1, worker_kernels=11, worker_seconds=13.4)
    assert _compiled_text({"first_call_compile": helped}) == (
        " (compiling 3.5 s, ptxas 2.5, 1 kernels; in workers 11 kernels, 13.4 s)")
    assert _compiled_text({"first_call_compile": {"kernels": 0}}) == _compiled_text({}) == ""


def test_the_power_table_lists_the_records_that_read_it():
    from benchlib.layer_report import power_lines

    assert power_lines([_record("grouped_mm", 10.0)]) == []  # no record read the power: no table
    capped = dict(steps=40, joules_per_step=10.87, mean_watts=674.4, mean_sm_mhz=1555.2, power_capped_share=1.0)
    lines = power_lines([_record("moeblaze", 15.58, power_fwdbwd=capped), _record("grouped_mm", 25.97)])
    assert lines[-2] == "|---|---|---|---|---|---|---|---|"
    assert lines[-1] == "| qwen3-30b-like | swiglu | moeblaze | 15.58 | 10.87 | 674 | 1555 | 100% |"
