"""scripts/gpu_suite.sh over stand-in tools (no GPU): the commands of its steps parse with the
scripts' own parsers, and the Transformer Engine parts that run without TE: the te_grouped layer
peer is listed and skipped with its reason, gpu_megatron_check.py --te refuses the CPU, the suite
knows its TE steps."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import torch
from benchlib.layer_bench import available_impls
from benchlib.baselines import IMPLS

REPO = Path(__file__).resolve().parents[2]


def test_te_grouped_peer_is_listed_and_skipped_without_te():
    assert "te_grouped" in IMPLS
    notes = []
    assert available_impls(["te_grouped"], torch.float32, torch.device("cpu"), notes) == {}
    assert len(notes) == 1 and notes[0].startswith("te_grouped: not run") and "Transformer Engine" in notes[0]


def test_fp8_peers_are_listed_and_moeblazes_meets_its_check():
    """moeblaze_fp8 passes the benchmark's float64 check at FP8's bar (not bf16's), and is not
    the bf16 op; te_grouped_fp8 is skipped without TE as te_grouped is."""
    from benchlib.accuracy import CHECK_TOL, check_impl
    from benchlib.baselines import FP8_CHECK_TOL, IMPL_CLASSES

    assert {"moeblaze_fp8", "te_grouped_fp8"} <= set(IMPLS)
    fp8, bf16 = (check_impl(IMPL_CLASSES[name], 48, 256, 128, 4, 2, "swiglu", torch.bfloat16, torch.device("cpu"), 1)
                 for name in ("moeblaze_fp8", "moeblaze"))
    assert max(fp8.values()) < FP8_CHECK_TOL and max(fp8.values()) > max(CHECK_TOL, max(bf16.values())), (fp8, bf16)
    notes = []
    assert available_impls(["te_grouped_fp8"], torch.bfloat16, torch.device("cpu"), notes) == {}
    assert len(notes) == 1 and notes[0].startswith("te_grouped_fp8: not run"), notes


def test_gpu_check_te_refuses_the_cpu():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_megatron_check.py"), "--te", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--te runs on the GPU only" in done.stderr
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_megatron_check.py"), "--no-router-fusion",
                           "--device", "cpu", "--smoke"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--no-router-fusion applies to --te" in done.stderr


def test_gpu_suite_names_its_te_steps(tmp_path):
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_suite.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "STEPS": "te_check te_bogus", "OUT": str(tmp_path)})
    assert done.returncode == 1
    assert "STEPS names 'te_bogus'" in done.stdout and "te_check te_layer te_select te_compare" in done.stdout


# A python3 for gpu_suite.sh: every call logged; compare_dispatchers.py and bench_layer.py calls
# parsed by the scripts' own parsers (a misspelt flag fails the run); --select-only writes the
# selection record the suite hands to te_compare; everything else (the TE probe, the checks) exits 0.
_PARSE = r"""
import importlib.util, json, os, sys
name, argv = sys.argv[1], sys.argv[2:]
spec = importlib.util.spec_from_file_location(os.path.basename(name)[:-3], name)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
args = module.parse_args(argv)
if getattr(args, "select_only", False):
    os.makedirs(args.out, exist_ok=True)
    chosen = args.stock_variants.split(",")[-1]
    json.dump({"stock_selection": {"chosen": chosen, "variants": {}}}, open(os.path.join(args.out, "variants.json"), "w"))
"""


def _fake_tools(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "parse.py").write_text(_PARSE)
    (bin_dir / "python3").write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {tmp_path}/calls.log\n'
        f'echo "${{MOEBLAZE_WARP_SPECIALIZE:-unset}} $1" >> {tmp_path}/knobs.log\n'
        'case "$1 $2" in\n'
        "  *transformer_engine*|*megatron.core*) exit 0 ;;\n"
        f'  "-c "*) exec {sys.executable} "$@" ;;\n'
        f"  scripts/compare_dispatchers.py*|scripts/bench_layer.py*|scripts/compare_torchtitan.py*) "
        f"PYTHONPATH={REPO}:{REPO}/scripts exec {sys.executable} "
        f'{tmp_path}/parse.py "$@" ;;\n'
        "esac\n"
        "exit 0\n")
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho fake-gpu\n")
    # Nsight Compute: logs its command line; -o NAME writes NAME.ncu-rep, -i prints a page.
    (bin_dir / "ncu").write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {tmp_path}/ncu.log\n'
        'prev=; for a in "$@"; do [ "$prev" = -o ] && echo rep > "$a.ncu-rep"; prev=$a; done\n'
        '[ "$1" = -i ] && echo "page,$4"\n'
        "exit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def _fake_suite(tmp_path, **env):
    """gpu_suite.sh over the fake tools with ``env``: (its results folder, the finished process,
    the scripts it ran, one command line each), the run checked to have passed."""
    bin_dir = _fake_tools(tmp_path)
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_suite.sh")], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), **env})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done, [c for c in (tmp_path / "calls.log").read_text().splitlines() if c.startswith("scripts/")]


def test_gpu_suite_te_steps_commands(tmp_path):
    """STEPS="te_check te_layer te_select te_compare": the commands the suite runs parse with the
    scripts' own parsers; the selected variant of each family reaches its comparison; only
    TE_RESUME_FAMILY runs the resume check; the outputs fold into the archive and top-level JSON."""
    out, done, calls = _fake_suite(tmp_path, STEPS="te_check te_layer te_select te_compare",
                                   TE_STATE_DIR=str(tmp_path / "state"), TE_RESUME_FAMILY="qwen3_moe")
    scripts_run = [c.split()[0] for c in calls]
    assert scripts_run == ["scripts/gpu_megatron_check.py", "scripts/bench_layer.py"] + [
        "scripts/compare_dispatchers.py"] * 4
    assert all("rc=0" in line for line in done.stdout.splitlines() if line.startswith("== ") and "rc=" in line)
    compares = [c for c in calls if c.startswith("scripts/compare_dispatchers.py") and "--select-only" not in c]
    assert "--family qwen3_moe" in compares[0] and "--stock-variants te_op_fuser " in compares[0]
    assert "--family deepseek_v3" in compares[1] and "--stock-variants te_shared_overlap " in compares[1]
    assert "--no-resume-check" not in compares[0] and "--no-resume-check" in compares[1]
    assert (tmp_path / "state" / "deepseek_v3.variant").read_text().strip() == "te_shared_overlap"
    kept = sorted(p.name for p in out.iterdir())
    assert "results.tar.gz" in kept and "te_select_qwen3_moe.json" in kept and all(p.is_file() for p in out.iterdir())


def test_gpu_suite_titan_step(tmp_path):
    """STEPS=titan runs compare_torchtitan.py (its own parser takes the command) with TITAN_FLAGS,
    its output under the results folder."""
    out, done, calls = _fake_suite(tmp_path, STEPS="titan", TITAN_FLAGS="--loss plain --local-batch-size 8")
    assert "== titan rc=0" in done.stdout
    assert calls == [f"scripts/compare_torchtitan.py --out {out}/compare_torchtitan --loss plain --local-batch-size 8"]


def test_gpu_suite_ncu_step(tmp_path):
    """STEPS=ncu profiles one launch of the warp-specialized kernel while tune_kernels.py times
    NCU_OPS at NCU_SHAPE, and exports the details and SASS source pages into the archive."""
    out, done, _ = _fake_suite(tmp_path, STEPS="ncu", NCU_SHAPE="qwen3", TMPDIR=str(tmp_path))
    assert "== ncu rc=0" in done.stdout
    profile, *exports = (tmp_path / "ncu.log").read_text().splitlines()
    assert "-k regex:gather_gemm_ws -s 1 -c 1" in profile and "--section SourceCounters" in profile
    (other := tmp_path / "skip").mkdir()
    _fake_suite(other, STEPS="ncu", NCU_KERNEL="weight_grad", NCU_SKIP="2", TMPDIR=str(other))
    assert "-k regex:weight_grad -s 2 -c 1" in (other / "ncu.log").read_text().splitlines()[0]
    assert profile.endswith("scripts/tune_kernels.py --shapes qwen3 --ops dh_ws --configs none --reps 2 "
                            "--out /tmp/ncu_tune")
    assert [e.split("--page ")[1].split()[0] for e in exports] == ["details", "source"]
    with tarfile.open(out / "results.tar.gz") as tar:
        assert {"./ncu_details.csv", "./ncu_source.csv"} <= set(tar.getnames())


def test_gpu_suite_ws_ab_step(tmp_path):
    """STEPS=ws_ab alternates bench_layer runs with MOEBLAZE_WARP_SPECIALIZE at the default ("fwd")
    and at 1, each round's records under its own tag, the float64 check in the first round only."""
    _, _, calls = _fake_suite(tmp_path, STEPS="ws_ab", WS_AB_ROUNDS="2")
    assert [c.split("--tag ")[1].split()[0] for c in calls] == [
        "bench_layer_ws_fwd_1", "bench_layer_ws_1_1", "bench_layer_ws_fwd_2", "bench_layer_ws_1_2"]
    assert ["--no-check" in c for c in calls] == [False, False, True, True]
    assert all("--configs conf4 --acts swiglu,silu" in c and "--impls moeblaze" in c for c in calls)
    knobs = [line.split()[0] for line in (tmp_path / "knobs.log").read_text().splitlines()
             if line.endswith("scripts/bench_layer.py")]
    assert knobs == ["fwd", "1", "fwd", "1"]


def test_gpu_suite_fp8_step_commands(tmp_path):
    """STEPS=fp8: the FP8 GPU tests, then bench_layer.py (its own parser takes the command) timing
    moeblaze_fp8 against moeblaze on FP8_CONFIGS."""
    out, done, calls = _fake_suite(tmp_path, STEPS="fp8", FP8_CONFIGS="qwen3,conf4")
    runs = (tmp_path / "calls.log").read_text().splitlines()
    assert any(c.startswith("-m pytest tests/gpu/test_fp8_gpu.py") for c in runs), runs
    assert calls == [c for c in calls if c.startswith("scripts/bench_layer.py")] and len(calls) == 1
    assert "--configs qwen3,conf4" in calls[0] and "--impls moeblaze,moeblaze_fp8" in calls[0]
    assert all("rc=0" in line for line in done.stdout.splitlines() if line.startswith("== ") and "rc=" in line)


def test_gpu_suite_sweep_step_commands(tmp_path):
    """STEPS=sweep: one bench_layer.py run (its parser takes the command) over NAME@rN shapes, rows
    per expert at the bases' widths, SonicMoE among the peers, moeblaze profiled."""
    out, done, calls = _fake_suite(tmp_path, STEPS="sweep", SWEEP_BASES="qwen3", SWEEP_ROWS="64 8192")
    assert len(calls) == 1 and "--configs qwen3@r64,qwen3@r8192 " in calls[0], calls
    assert "--impls moeblaze,sonicmoe,grouped_mm" in calls[0] and "--profile" in calls[0]


def test_rows_per_expert_shapes():
    from benchlib.shapes import CONFIGS, config_names

    names = config_names("qwen3@r512,7b@r64,conf4")
    assert names == ["qwen3-30b-like@r512", "7b-fine-grained@r64", "paper-d2048-e16-k4"]
    assert CONFIGS[names[0]] == (8192, 2048, 768, 128, 8) and CONFIGS[names[1]] == (1024, 1536, 256, 128, 8)
    assert "qwen3@r5x" not in CONFIGS and "bogus@r64" not in CONFIGS and names[0] in CONFIGS
    assert "sonicmoe" in IMPLS
    notes = []
    assert available_impls(["sonicmoe"], torch.bfloat16, torch.device("cpu"), notes) == {}
    assert notes == ["sonicmoe: not run (RuntimeError: sonicmoe runs on CUDA (CuTe-DSL kernels))"], notes
