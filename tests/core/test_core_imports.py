"""The framework-neutral core imports neither Megatron nor the training aids: a torchtitan user,
or one who wants only the op, needs neither installed (issue 20's layering, checked at run time
in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

CORE = ["moeblaze_megatron", "moeblaze_megatron.config", "moeblaze_megatron.routing", "moeblaze_megatron.moe_mlp",
        "moeblaze_megatron.reference", "moeblaze_megatron.parallel.alltoall", "moeblaze_megatron.parallel.ring",
        "moeblaze_megatron.parallel.traffic"]


def test_core_imports_no_megatron_and_no_training_aids():
    probe = (f"import sys\nfor m in {CORE!r}: __import__(m)\n"
             "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'megatron' or '.training' in m)\n"
             "print(bad)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_install_is_loaded_on_demand():
    probe = ("import sys, moeblaze_megatron as m\nbefore = 'megatron.core' in sys.modules\n"
             "install = m.install\nprint(before, 'megatron.core' in sys.modules, install.__module__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True", "moeblaze_megatron.megatron_plugin"], out
