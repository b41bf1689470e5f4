"""scripts/compile_report.py: the layer's expert GEMMs compiled for sm_90a with no GPU (a stand-in
driver names the target), each variant's registers, spills, wgmma and TMA use read from the PTX;
its comparison of two runs instruction by instruction; and its refusal under the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchlib.compile_report import compile_layer, diff_histograms

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compile_report.py"


def _run(*argv):
    # The interpreter compiles nothing; tests/gpu sets MOEBLAZE_AUTOTUNE=0 at collection.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOEBLAZE_AUTOTUNE")}
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env, timeout=600)


def test_compiles_the_halves_for_hopper_and_compares_runs(tmp_path):
    out = tmp_path / "compile.json"
    args = ["--shape", "7b", "--configs", "1", "--launches", "fc1_act_halves,dx_halves,dw1"]
    done = _run(*args, "--fresh", "--out", str(out))
    assert done.returncode == 0, done.stderr
    records = json.loads(out.read_text())["records"]
    assert [r["launch"] for r in records] == ["fc1_act_halves", "dx_halves", "dw1"]
    for r in records:
        # Hopper's matrix instructions and TMA loads, a register count from ptxas, a fresh compile.
        assert r["wgmma"] and r["tma"] and 0 < r["registers"] <= 255 and r["compile_seconds"] > 0, r
        assert any(op.startswith("wgmma.mma_async") for op in r["histogram"]), r["histogram"]
    again = _run(*args, "--compare", str(out))
    assert again.returncode == 0, again.stderr
    assert "every launch compiled to the same instructions" in again.stdout
    assert "| dx_halves |" in again.stdout.splitlines()[-2]


def test_the_warp_specialized_epilogues_compile_for_hopper(tmp_path):
    """The Gluon kernel (no interpreter: this is its CPU check) compiles with this machine's Triton
    for sm_90a, fc1's forward (stacked and as halves) and dH's backward, within the registers its
    launch gives a thread (12 warps x 168), its main loop's wgmma chain not
    serialized by ptxas, and no more than a few spilled bytes (dH: 8 with Triton 3.6's ptxas, 72 with 3.8's; the tilings
    that did not fit spilled kilobytes)."""
    from moeblaze_megatron.kernels.configs import EPI_ACT_BWD, EPI_ACT_FWD
    from moeblaze_megatron.kernels.gather_gemm_ws import WS_TILES, ws_registers

    limit = {"fc1_act_ws": ws_registers(WS_TILES[EPI_ACT_FWD]), "fc1_act_halves_ws": ws_registers(WS_TILES[EPI_ACT_FWD]),
             "dh_act_bwd_ws": ws_registers(WS_TILES[EPI_ACT_BWD])}
    assert limit == {"fc1_act_ws": 168, "fc1_act_halves_ws": 168, "dh_act_bwd_ws": 168}

    out = tmp_path / "compile.json"
    launches = ["fc1_act_ws", "fc1_act_halves_ws", "dh_act_bwd_ws"]
    done = _run("--shape", "7b", "--launches", ",".join(launches), "--fresh", "--out", str(out))
    assert done.returncode == 0, done.stderr
    records = json.loads(out.read_text())["records"]
    assert [r["launch"] for r in records] == launches
    for record in records:
        assert record["config"] == "fixed" and record["wgmma"] and record["tma"], record
        assert 0 < record["registers"] <= limit[record["launch"]] and not record["wgmma_serialized"], record
        assert record["spill_store_bytes"] <= 128, record
        # Hopper's 227 KB a program may have (dH: four stages, the tile buffer, a tile's pre by TMA).
        assert 0 < record["shared_bytes"] <= 227 * 1024, record
        assert any(op.startswith("setmaxnreg") for op in record["histogram"]), record["histogram"]
        assert any(op.startswith("cp.async.mbarrier.arrive") for op in record["histogram"]), record["histogram"]


def test_diff_names_the_moved_opcodes():
    old = [{"launch": "dx", "config": "c", "histogram": {"add.s32": 3, "wgmma": 4}},
           {"launch": "fc2", "config": "c", "histogram": {"add.s32": 1}}]
    new = [{"launch": "dx", "config": "c", "histogram": {"add.s32": 5, "wgmma": 4, "mul.lo.s32": 1}},
           {"launch": "fc2", "config": "c", "histogram": {"add.s32": 1}},
           {"launch": "dw1", "config": "c", "histogram": {}}]  # not in the old run: nothing to compare
    assert diff_histograms(old, new) == ["dx c: add.s32 3 -> 5, mul.lo.s32 0 -> 1"]


def test_refuses_under_the_interpreter():
    # This suite runs with TRITON_INTERPRET=1: the kernels here are interpreted, not compiled.
    with pytest.raises(RuntimeError, match="run it without TRITON_INTERPRET"):
        compile_layer((64, 32, 16, 4, 2))
    done = _run("--shape", "nonsense")
    assert done.returncode == 2 and "--shape: unknown 'nonsense'" in done.stderr


def test_a_predicated_instruction_counts_under_its_opcode():
    from benchlib.compile_report import _histogram

    ptx = "\n".join([".reg .b32 %r<4>;", "// a comment", "$L__BB0_1:", "\tld.global.v4.b32 {%r1, %r2}, [%rd1];",
                     "\t@%p1 st.global.v4.b32 [%rd2], {%r1, %r2};", "\t@!%p2 st.global.v4.b32 [%rd3], {%r1, %r2};",
                     "\t@%p3 bra $L__BB0_1;", "\tret;"])
    assert _histogram(ptx) == {"ld.global.v4.b32": 1, "st.global.v4.b32": 2, "bra": 1, "ret;": 1}
