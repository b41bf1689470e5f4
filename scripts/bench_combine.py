"""Time the combine kernel with and without its router-probability side outputs on the GPU, next
to the torch ops those side outputs replace (``RoutingPlan.permute_probs`` before the activation
backward, ``unpermute_rows`` of the summed partials after it).

    python scripts/bench_combine.py 7b,qwen3,conf4,dsv3

Each time is the median of 20 launches, each queued behind a short GPU spin (no host wait timed).
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_layer as bl  # noqa: E402

from moeblaze_megatron import build_routing_plan  # noqa: E402
from moeblaze_megatron.kernels import combine as cb  # noqa: E402
from moeblaze_megatron.kernels import expert_gemm as eg  # noqa: E402


def gtime(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def main(configs: str = "7b,qwen3,conf4,dsv3"):
    dev = torch.device("cuda")
    for cfg in configs.split(","):
        T, d, h, E, K = bl.CONFIGS[bl.ALIASES.get(cfg, cfg)]
        _, ids, probs, _, _ = bl.make_inputs(T, d, h, E, K, "swiglu", torch.bfloat16, dev, 1)
        plan = build_routing_plan(ids, E)
        rows = torch.randn(T * K, d, device=dev, dtype=torch.bfloat16)
        probs_sorted = probs.new_empty(T * K)
        ds = torch.randn(T * K, eg.row_gemm_ds_tiles(h), device=dev)
        grad_probs = torch.empty(T, K, device=dev, dtype=probs.dtype)
        tim = plan.token_index_map
        times = {
            "fwd plain": gtime(lambda: cb.combine(rows, tim, probs, torch.bfloat16)),
            "fwd scatter": gtime(lambda: cb.combine(rows, tim, probs, torch.bfloat16, probs_sorted=probs_sorted)),
            "permute_probs (torch)": gtime(lambda: plan.permute_probs(probs)),
            "bwd plain": gtime(lambda: cb.combine(rows, tim, None, torch.bfloat16)),
            "bwd gather ds": gtime(lambda: cb.combine(rows, tim, None, torch.bfloat16, ds_partial=ds,
                                                      grad_probs=grad_probs)),
            "unpermute(sum) (torch)": gtime(lambda: plan.unpermute_rows(ds.sum(1)).to(probs.dtype)),
        }
        print(f"== {cfg} GPU ms: " + "  ".join(f"{k} {v:.3f}" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
