"""Compiling one layer's expert GEMMs for Hopper (sm_90a) on a machine without a GPU, for the
kernel tests: a stand-in driver that names the target and launches nothing, the layer's launches
on CPU tensors of its shapes, and one launch compiled through Triton's own JIT (``warmup``) with
what its PTX and ptxas say (registers, spills, wgmma and TMA use, an instruction histogram).

Run the compiles without TRITON_INTERPRET (the interpreter compiles nothing): ``run_compiled``
runs code in a process without it. Imported as ``from hopper_compile import ...`` (pytest puts
tests/ on sys.path).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from benchlib.profiling import compile_times
from triton.backends.compiler import GPUTarget

from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels import configs as cf
from moeblaze_megatron.kernels import gather_gemm as rg
from moeblaze_megatron.kernels import gather_gemm_ws as ws
from moeblaze_megatron.kernels import weight_grad as wg
from moeblaze_megatron.kernels.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[1]

TARGET = GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def offline_target(target=TARGET):
    """Triton's active driver replaced by one that names ``target`` and launches nothing, and the
    interpreter switch off (the config lists are the GPU's, as MOEBLAZE_AUTOTUNE chose them at
    import); both restored afterwards. CPU tensors take TMA descriptors wherever aligned ones
    would on Hopper (``configs.tma_takes``)."""
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime import driver

    class OfflineDriver(CudaDriver):
        def __init__(self):  # no CUDA library to load
            self.utils = None

        def get_current_target(self):
            return target

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

    # The driver as it was, unset included (reset_active would build the default, which fails
    # where no GPU is).
    saved = (SETTINGS.interpret, driver._active)
    driver.set_active(OfflineDriver())
    SETTINGS.interpret = False
    try:
        yield
    finally:
        SETTINGS.interpret, driver._active = saved


def layer_launches(T, d, h, E, K, dtype=torch.bfloat16, seed=0):
    """{name: KernelCall} of one SwiGLU layer's expert GEMMs on CPU tensors of the layer's shapes
    (the tensors are never read: only their dtypes, strides and alignment matter)."""
    g = torch.Generator().manual_seed(seed)
    plan = build_routing_plan(torch.rand(T, E, generator=g).topk(K, dim=1).indices, E)
    rows = plan.expert_token_indices.shape[0]
    empty = lambda *shape: torch.empty(*shape, dtype=dtype)  # noqa: E731
    x, w1, w3, fc2 = empty(T, d), empty(E, h, d), empty(E, h, d), empty(E, d, h)
    fc1 = empty(E, 2 * h, d)
    pre, hid, rows_d, grad_pre = empty(rows, 2 * h), empty(rows, h), empty(rows, d), empty(rows, 2 * h)
    probs = empty(rows)
    ds = torch.empty(rows, rg.gather_gemm_ds_tiles(h))
    fwd = dict(transpose_weight=True, epilogue=rg.EPI_ACT_FWD, activation="swiglu", pre=pre, n=h)
    return {
        "fc1_act": rg.gather_gemm_call(x, fc1, hid, plan, warp_specialize=False, **fwd),
        "fc1_act_halves": rg.gather_gemm_call(x, (w1, w3), hid, plan, warp_specialize=False, **fwd),
        "fc2": rg.gather_gemm_call(hid, fc2, rows_d, plan, transpose_weight=True, gather_a=False, n=d),
        "dh_act_bwd": rg.gather_gemm_call(x, fc2, hid, plan, transpose_weight=False, epilogue=rg.EPI_ACT_BWD,
                                       activation="swiglu", pre=pre, probs_sorted=probs, ds_partial=ds, n=h,
                                       warp_specialize=False),
        # The fused epilogues in the warp-specialized Gluon kernel (what a Hopper GPU runs).
        "fc1_act_ws": ws.ws_call(x, fc1, hid, plan, epilogue=rg.EPI_ACT_FWD, act_id=rg.ACT_SWIGLU, glu=True, pre=pre,
                                 n=h, sm_count=132),
        "fc1_act_halves_ws": ws.ws_call(x, (w1, w3), hid, plan, epilogue=rg.EPI_ACT_FWD, act_id=rg.ACT_SWIGLU, glu=True,
                                        pre=pre, n=h, sm_count=132),
        "dh_act_bwd_ws": ws.ws_call(x, fc2, hid, plan, epilogue=rg.EPI_ACT_BWD, act_id=rg.ACT_SWIGLU, glu=True, pre=pre,
                                    probs_sorted=probs, ds_partial=ds, n=h, sm_count=132),
        "fc1_recompute": rg.gather_gemm_call(x, fc1, pre, plan, transpose_weight=True, n=2 * h),
        "dx": rg.gather_gemm_call(grad_pre, fc1, rows_d, plan, transpose_weight=False, gather_a=False, n=d),
        "dx_halves": rg.gather_gemm_call(grad_pre, (w1, w3), rows_d, plan, transpose_weight=False, gather_a=False, n=d),
        "dw1": wg.weight_grad_call(grad_pre, x, empty(E, 2 * h, d), plan, gather_a=False, gather_b=True),
        "dw2": wg.weight_grad_call(x, hid, empty(E, d, h), plan, gather_a=True, gather_b=False),
    }


def kept_configs(call):
    """The configs the GPU's autotuner would time for this launch (its pruning, or all of them);
    [None] for a kernel that is not autotuned (its constexprs are the whole config)."""
    kernel = call.kernel
    if not hasattr(kernel, "configs"):
        return [None]
    prune = kernel.early_config_prune
    names = dict(zip(kernel.arg_names, call.args))
    return prune(kernel.configs, names, **call.constexprs) if prune else list(kernel.configs)


def ptxas_info(ptx: str, arch: str) -> dict:
    """Registers and spill bytes of a PTX module, from the ptxas Triton bundles."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        info = subprocess.run([ptxas, "-v", "--gpu-name", arch, f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    number = lambda pattern: max((int(v) for v in re.findall(pattern, info)), default=0)  # noqa: E731
    # C7518: ptxas serialized the wgmma chain (a branch it cannot prove uniform inside the main loop).
    return {"registers": number(r"Used (\d+) registers"), "spill_store_bytes": number(r"(\d+) bytes spill stores"),
            "spill_load_bytes": number(r"(\d+) bytes spill loads"), "wgmma_serialized": "C7518" in info}


def histogram(ptx: str) -> dict:
    """Instruction opcodes of a PTX module and their counts (directives, labels and braces left out;
    a predicated instruction counts under its opcode, not its guard ``@%p1``)."""
    lines = (line.split() for line in ptx.splitlines() if line.strip()
             and not line.strip().startswith((".", "//", "$", "{", "}", ")", "(")))
    ops = (words[1] if words[0].startswith("@") and len(words) > 1 else words[0] for words in lines)
    return dict(collections.Counter(ops))


def compile_variant(call, config, arch="sm_90a") -> dict:
    """Compile one launch with one config (the config's pre-hook sizes its TMA boxes first), or,
    for a kernel that is not autotuned (``config`` None), as it is."""
    kernel = call.kernel
    if config is None:
        with compile_times() as compiled_now:
            compiled = kernel.warmup(*call.args, grid=(1,), **call.constexprs)
        config_name = "fixed"
    else:
        kwargs = {**call.constexprs, **config.all_kwargs()}
        if config.pre_hook is not None:
            config.pre_hook({**dict(zip(kernel.arg_names, call.args)), **kwargs})
        with compile_times() as compiled_now:
            compiled = kernel.fn.warmup(*call.args, grid=(1,), **kwargs)
        config_name = cf.config_label(config)
    ptx = compiled.asm["ptx"]
    # None where Triton's caches (this process's or the disk's) had the kernel: nothing compiled.
    seconds = compiled_now["seconds"] if compiled_now["kernels"] else None
    return {"config": config_name, "compile_seconds": seconds, "wgmma": "wgmma" in ptx,
            "tma": "cp.async.bulk.tensor" in ptx, "shared_bytes": compiled.metadata.shared, **ptxas_info(ptx, arch),
            "histogram": histogram(ptx)}


def run_compiled(code: str, cache_dir, timeout: float = 900, **env_extra) -> dict:
    """Run ``code`` in a fresh process without the interpreter, Triton's cache in ``cache_dir``,
    and return the JSON its last line prints (the process must succeed)."""
    # Neither the interpreter nor tests/gpu's MOEBLAZE_AUTOTUNE=0: the GPU's config lists.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOEBLAZE_AUTOTUNE")}
    # A PYTHONPATH given stays behind the repository's (another Triton's install, for instance).
    path = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests")]
    path += [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    env.update(TRITON_CACHE_DIR=str(cache_dir), PYTHONPATH=os.pathsep.join(path), **env_extra)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])
