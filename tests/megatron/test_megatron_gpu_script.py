"""scripts/gpu_megatron_check.py end to end on tiny shapes on the CPU, so that the GPU run the lead
makes does not fail on a code path no test reached."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from moe_testing import free_port

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu_megatron_check.py")


def test_gpu_check_script_smoke(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    run = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [c["pass"] for c in report["checks"]] == [True, True]
    impls = {(row["what"].split(" T=")[0], row["impl"]) for row in report["timings"]}
    assert ("layer qwen3-like", "moeblaze") in impls and ("layer coarse", "stock alltoall+SequentialMLP") in impls
    assert all(row["ms"] > 0 for row in report["timings"])
    assert "| step (fwd+bwd, bf16) |" in run.stdout
