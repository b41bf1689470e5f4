"""scripts/compare_revisions.py checks its arguments before it starts a revision (the A/B itself
needs a GPU)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "compare_revisions.py"


def _run(*argv):
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})


def test_refuses_a_directory_without_the_package(tmp_path):
    done = _run("--old", str(tmp_path), "--new", str(REPO))
    assert done.returncode == 2 and "--old" in done.stderr and "holds no moeblaze_megatron/ package" in done.stderr


def test_refuses_an_unknown_config(tmp_path):
    done = _run("--old", str(REPO), "--new", str(REPO), "--configs", "qwen4")
    assert done.returncode != 0 and "qwen4" in done.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message given without a GPU")
def test_says_it_needs_a_gpu():
    done = _run("--old", str(REPO), "--new", str(REPO))
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr
