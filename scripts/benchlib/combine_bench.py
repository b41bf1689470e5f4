"""The combine kernel with and without its router-probability side outputs, next to the torch ops
those side outputs replace (scripts/bench_combine.py)."""

from __future__ import annotations

import torch

from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels.combine import combine
from moeblaze_megatron.kernels.gather_gemm import gather_gemm_ds_tiles

from .shapes import CONFIGS, config_name, make_inputs
from .timing import cuda_time

SPIN = 2_000_000  # cycles of GPU spin before each timed launch: its launch queues, no host wait is timed


def gpu_ms(fn, reps=20):
    """Median GPU ms of ``fn`` over ``reps`` launches, each queued behind a short spin."""
    return cuda_time(fn, 3, reps, queued=True, spin=SPIN)[0]


def combine_times(cfg, device):
    """{variant: GPU ms} of the combine's variants and of the torch ops they replace at config
    ``cfg`` (a name or alias; SwiGLU, bf16)."""
    T, d, h, E, K = CONFIGS[config_name(cfg)]
    _, ids, probs, _, _ = make_inputs(T, d, h, E, K, "swiglu", torch.bfloat16, device, 1)
    plan = build_routing_plan(ids, E)
    rows = torch.randn(T * K, d, device=device, dtype=torch.bfloat16)
    probs_sorted = probs.new_empty(T * K)
    ds = torch.randn(T * K, gather_gemm_ds_tiles(h), device=device)
    grad_probs = torch.empty(T, K, device=device, dtype=probs.dtype)
    tim = plan.token_index_map
    return {
        "fwd plain": gpu_ms(lambda: combine(rows, tim, probs, torch.bfloat16)),
        "fwd scatter": gpu_ms(lambda: combine(rows, tim, probs, torch.bfloat16, probs_sorted=probs_sorted)),
        "permute_probs (torch)": gpu_ms(lambda: plan.permute_probs(probs)),
        "bwd plain": gpu_ms(lambda: combine(rows, tim, None, torch.bfloat16)),
        "bwd gather ds": gpu_ms(lambda: combine(rows, tim, None, torch.bfloat16, ds_partial=ds, grad_probs=grad_probs)),
        "unpermute(sum) (torch)": gpu_ms(lambda: plan.unpermute_rows(ds.sum(1)).to(probs.dtype)),
    }
