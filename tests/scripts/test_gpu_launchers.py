"""The GPU-only launchers on a machine without a GPU (CUDA_VISIBLE_DEVICES empty): each ends with
its own message and a non-zero exit status, before torchrun starts (no ChildFailedError, no
traceback) and before anything is installed, built or prepared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}


def _no_traceback(done):
    text = done.stdout + done.stderr
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]


@pytest.mark.parametrize("launcher", ["qwen3_moe.sh", "mixtral.sh", "deepseek_v3.sh", "resume_check.sh"])
def test_the_examples_end_with_the_entry_points_message(launcher):
    done = subprocess.run(["bash", str(REPO / "examples" / launcher)], capture_output=True, text=True, timeout=120,
                          env=NO_GPU)
    assert done.returncode == 1 and done.stdout == "", done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[0] == "scripts/pretrain_gpt.py: Megatron pretraining needs a CUDA GPU, and this machine has none."
    assert lines[-1].strip().startswith("python scripts/compare_dispatchers.py")
    _no_traceback(done)


def test_the_multi_gpu_suite_says_it_needs_gpus_before_installing(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_multi.sh")], capture_output=True, text=True,
                          timeout=120, env={**NO_GPU, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path)})
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip().splitlines() == [
        "gpu_multi: expert parallelism on GPUs needs 2 or more, and this machine has 0; on the CPU: torchrun "
        "--nproc-per-node 2 scripts/bench_expert_parallel.py --device cpu --shape tiny --out DIR"]
    _no_traceback(done)


def test_the_megatron_check_ends_with_its_argument_error():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_megatron_check.py")], capture_output=True,
                          text=True, timeout=120, env=NO_GPU)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "gpu_megatron_check.py: error: --device cuda needs a GPU (use --device cpu --smoke to test the script)")
    _no_traceback(done)
