"""What the compiler makes of the expert GEMMs for Hopper, without a GPU
(scripts/compile_report.py): every launch of one layer (fc1 with the activation, stacked and as
torchtitan's (gate, up) halves, fc2, dH with the activation backward, the fc1 recompute, dX stacked
and on halves, dW1, dW2) with each config the GPU's autotuner would time, compiled for sm_90a
through Triton's own JIT (``warmup``: compiled, not launched) against a stand-in driver that
names the target. Per variant: registers and spill bytes (the bundled ptxas -v), whether the PTX
uses wgmma and TMA, the compile seconds (None where Triton's caches had it; ``--fresh`` compiles
everything) and an instruction histogram, so two versions of a kernel can be compared
instruction by instruction (``diff_histograms``) before any device time.

The GPU's config lists are built with the interpreter off: run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget

from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels import configs as cf
from moeblaze_megatron.kernels import gather_gemm as rg
from moeblaze_megatron.kernels import gather_gemm_ws as ws
from moeblaze_megatron.kernels import weight_grad as wg
from moeblaze_megatron.kernels.settings import SETTINGS

from .profiling import compile_times

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


def _kept_configs(call):
    """The configs the GPU's autotuner would time for this launch (its pruning, or all of them);
    [None] for a kernel that is not autotuned (its constexprs are the whole config)."""
    kernel = call.kernel
    if not hasattr(kernel, "configs"):
        return [None]
    prune = kernel.early_config_prune
    names = dict(zip(kernel.arg_names, call.args))
    return prune(kernel.configs, names, **call.constexprs) if prune else list(kernel.configs)


def _ptxas_info(ptx: str, arch: str) -> dict:
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


def _histogram(ptx: str) -> dict:
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
            "tma": "cp.async.bulk.tensor" in ptx, "shared_bytes": compiled.metadata.shared, **_ptxas_info(ptx, arch),
            "histogram": _histogram(ptx)}


def compile_layer(shape, launches=None, configs_per_launch=None, progress=print) -> list[dict]:
    """Every variant of the named launches (all by default) at ``shape`` = (T, d, h, E, K)."""
    if SETTINGS.interpret:
        raise RuntimeError("compile_report: the kernels were imported under TRITON_INTERPRET=1, which runs them in "
                           "the interpreter and compiles nothing; run it without TRITON_INTERPRET")
    records = []
    with offline_target():
        calls = layer_launches(*shape)
        for name in launches or calls:
            if name not in calls:
                raise ValueError(f"unknown launch {name!r}; expected some of: {', '.join(calls)}")
            for config in _kept_configs(calls[name])[:configs_per_launch]:
                record = {"launch": name, **compile_variant(calls[name], config)}
                progress(f"  {name:15s} {record['config']:22s} {_seconds(record):>8s}  "
                         f"{record['registers']:3d} registers, {record['spill_store_bytes']} B spilled, "
                         f"{record['shared_bytes'] // 1024} KB shared")
                records.append(record)
    return records


def diff_histograms(old: list[dict], new: list[dict]) -> list[str]:
    """Lines naming every (launch, config) whose instruction histogram differs between two runs,
    with the opcodes that moved (old count -> new count)."""
    before = {(r["launch"], r["config"]): r["histogram"] for r in old}
    lines = []
    for r in new:
        key = (r["launch"], r["config"])
        if key not in before:
            continue
        a, b = before[key], r["histogram"]
        moved = {op: (a.get(op, 0), b.get(op, 0)) for op in sorted(set(a) | set(b)) if a.get(op, 0) != b.get(op, 0)}
        if moved:
            lines.append(f"{key[0]} {key[1]}: " + ", ".join(f"{op} {x} -> {y}" for op, (x, y) in moved.items()))
    return lines


def table(records: list[dict]) -> str:
    """A markdown table of the variants."""
    rows = ["| launch | config | registers | spill stores (B) | shared (KB) | wgmma | TMA | compile (s) |",
            "|---|---|---|---|---|---|---|---|"]
    rows += [f"| {r['launch']} | {r['config']} | {r['registers']} | {r['spill_store_bytes']} | "
             f"{r.get('shared_bytes', 0) // 1024} | {'yes' if r['wgmma'] else 'no'} | {'yes' if r['tma'] else 'no'} | "
             f"{_seconds(r)} |" for r in records]
    return "\n".join(rows)


def _seconds(record) -> str:
    return "cached" if record["compile_seconds"] is None else f"{record['compile_seconds']:.1f} s"
