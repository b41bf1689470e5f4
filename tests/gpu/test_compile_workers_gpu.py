"""The compile workers on the GPU (skipped without CUDA): a layer's first call, each in a fresh
process with an empty Triton cache and the tuned config lists, with workers and without. With
them, the layer's GEMMs compile in the workers (the process compiles only what runs before the
layer's prefetch: the routing plan's kernels) and the outputs and gradients are bitwise those
compiled in the process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]

_FIRST_CALL = """
import json, sys, time
import torch
from benchlib.profiling import compile_times
from moeblaze_megatron import moe_mlp

T, d, h, E, K = 4096, 512, 256, 16, 4
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(T, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
ids = torch.randn(T, E, device="cuda", generator=g).topk(K, dim=1).indices
probs = torch.rand(T, K, device="cuda", generator=g).requires_grad_()
fc1 = (torch.randn(E, 2 * h, d, device="cuda", generator=g) / d**0.5).to(torch.bfloat16).requires_grad_()
fc2 = (torch.randn(E, d, h, device="cuda", generator=g) / h**0.5).to(torch.bfloat16).requires_grad_()
started = time.perf_counter()
with compile_times() as compiled:
    y = moe_mlp(x, ids, probs, fc1, fc2)
    y.float().square().sum().backward()
    torch.cuda.synchronize()
seconds = time.perf_counter() - started
torch.save([t.cpu() for t in (y, x.grad, probs.grad, fc1.grad, fc2.grad)], sys.argv[1])
print(json.dumps(dict(compiled, first_call_s=seconds)))
"""


def _first_call(tmp_path, workers):
    env = {k: v for k, v in os.environ.items() if k not in ("MOEBLAZE_AUTOTUNE", "MOEBLAZE_COMPILE_WORKERS")}
    cache = tmp_path / f"cache{workers}"
    env.update(TRITON_CACHE_DIR=str(cache), MOEBLAZE_COMPILE_WORKERS=str(workers),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts")]))
    out = tmp_path / f"out{workers}.pt"
    done = subprocess.run([sys.executable, "-c", _FIRST_CALL, str(out)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), torch.load(out)


def test_a_first_call_compiles_its_gemms_in_the_workers_bitwise_the_same(tmp_path):
    alone, expected = _first_call(tmp_path, 0)
    helped, got = _first_call(tmp_path, 4)
    print(f"first call: {alone['first_call_s']:.1f} s compiling in the process ({alone['kernels']} kernels), "
          f"{helped['first_call_s']:.1f} s with 4 workers ({helped['worker_kernels']} kernels there, "
          f"{helped['kernels']} here)")
    assert alone["worker_kernels"] == 0 and alone["kernels"] >= 8, alone
    # Here only what the routing plan builds before the layer's prefetch; every GEMM in the workers.
    assert helped["worker_kernels"] >= 6 and helped["kernels"] <= 3, helped
    assert helped["kernels"] + helped["worker_kernels"] >= alone["kernels"], (alone, helped)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
