"""One ring hop on one GPU: the compute a rank does per hop of RelayMoE's ring, measured at the
memory model's shapes, so the overlap condition (a hop's compute >= its transfer) rests on
measurements (bench_ring_hop).

A hop, in either ring, runs this rank's share of one shard: the slots of T tokens routed to E/P
experts (T*K/P of them under uniform routing), through ``parallel.ring.hop_forward`` and
``hop_backward``, the functions the ring calls (plan build, fused kernels, fc1 recomputed in
backward). The expert ring runs it on its own tokens against an arriving shard, the token ring on
an arriving block against its own shard: the same work. One GPU cannot time the transfers; their
time is the model's at a given link bandwidth (``ep_memory.hop_times``). Each hop's output and
gradients are checked against the float64 reference on the first token count of each layer.
"""

from __future__ import annotations

import math
import statistics

import torch

from moeblaze_megatron.parallel.ring import hop_backward, hop_forward, shard_row_counts
from moeblaze_megatron.passes import PassOptions

from .accuracy import rel_err
from .ep_memory import LAYERS, op_transient, shard_numel
from .timing import cuda_time

CHECK_TOL = 8 * 2.0**-9  # bf16: a few roundings of 2^-9 each

# A hop as the ring runs it (nothing saved: fc1 recomputed in backward), on the kernels and in
# the float64 reference.
KERNELS = PassOptions("swiglu", False, "triton")
REFERENCE = PassOptions("swiglu", False, "reference", "torch")


def hop_inputs(layer, tokens: int, ranks: int, device, seed: int):
    """A rank's tokens (x, global top-k ids of uniform routing, softmax probabilities) and shard 0's
    weights, bf16, scaled so that activations are O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, layer.d, device=device, generator=g).bfloat16()
    logits = torch.randn(tokens, layer.experts, device=device, generator=g)
    top, ids = logits.topk(layer.topk, dim=1)
    probs = torch.softmax(top, dim=1)
    local = layer.experts // ranks
    fc1 = (torch.randn(local, 2 * layer.h, layer.d, device=device, generator=g) / math.sqrt(layer.d)).bfloat16()
    fc2 = (torch.randn(local, layer.d, layer.h, device=device, generator=g) / math.sqrt(layer.h)).bfloat16()
    return x, ids.to(torch.int32), probs, (fc1, fc2)


def check_hop(x, ids, probs, weights, rows) -> dict:
    """Relative errors of one hop's output and gradients against the float64 reference."""
    grad_y = torch.randn_like(x, dtype=torch.float32).bfloat16()
    needs = (True, True, True, True)
    got = (hop_forward(x, ids, probs, weights, 0, rows, KERNELS),
           *hop_backward(grad_y, x, ids, probs, weights, 0, rows, KERNELS, needs))
    x64, probs64, *weights64 = (t.double() for t in (x, probs, *weights))
    want = (hop_forward(x64, ids, probs64, weights64, 0, rows, REFERENCE),
            *hop_backward(grad_y.double(), x64, ids, probs64, weights64, 0, rows, REFERENCE, needs))
    return {name: rel_err(a, b) for name, a, b in zip(("y", "dx", "dprobs", "dfc1", "dfc2"), got, want)}


def measure_hop(layer_name: str, tokens: int, ranks: int, device, *, warmup_s: float, min_s: float,
                check: bool) -> dict:
    """One hop's forward and backward: median ms, peak bytes above the start against the model's
    ``op_transient``, and (``check``) the errors against float64."""
    layer = LAYERS[layer_name]
    x, ids, probs, weights = hop_inputs(layer, tokens, ranks, device, seed=tokens + ranks)
    rows = int(shard_row_counts(ids, layer.experts // ranks, ranks)[0])
    grad_y = torch.randn_like(x, dtype=torch.float32).bfloat16()
    needs = (True, True, True, True)

    def forward():
        return hop_forward(x, ids, probs, weights, 0, rows, KERNELS)

    def backward():
        return hop_backward(grad_y, x, ids, probs, weights, 0, rows, KERNELS, needs)

    record = {"layer": layer_name, "tokens_per_rank": tokens, "P": ranks, "hop_rows": rows,
              "experts_per_rank": layer.experts // ranks, "shard_MiB": shard_numel(layer, ranks) * 2 / 2**20}
    for name, fn in (("forward", forward), ("backward", backward)):
        ms = cuda_time(fn, 2, 5, warmup_s=warmup_s, min_s=min_s)[0]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize()
        record[f"{name}_ms"] = ms
        record[f"{name}_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        del out
    flops = 2 * rows * 3 * layer.h * layer.d
    record["forward_tflops"] = flops / (record["forward_ms"] * 1e-3) / 1e12
    record["backward_tflops"] = 3 * flops / (record["backward_ms"] * 1e-3) / 1e12
    model = op_transient(layer, rows, tokens, layer.experts // ranks, 4, True)
    record["model_forward_bytes"], record["model_backward_bytes"] = model
    if check:
        record["errors"] = check_hop(x, ids, probs, weights, rows)
        record["passed"] = all(e < CHECK_TOL for e in record["errors"].values())
    return record


def run_hops(layers, ranks_list, tokens_list, device, *, warmup_s: float, min_s: float, say=print) -> list[dict]:
    records = []
    for layer_name in layers:
        for i, tokens in enumerate(tokens_list):
            for ranks in ranks_list:
                record = measure_hop(layer_name, tokens, ranks, device, warmup_s=warmup_s, min_s=min_s,
                                     check=i == 0)
                records.append(record)
                say(f"{layer_name} T={tokens} P={ranks}: rows {record['hop_rows']}, fwd {record['forward_ms']:.3f} ms, "
                    f"bwd {record['backward_ms']:.3f} ms" + (f", check {'ok' if record['passed'] else 'FAILED'}"
                                                             if "passed" in record else ""))
                torch.cuda.empty_cache()
    return records


def table_lines(records: list[dict]) -> list[str]:
    lines = ["| layer | T/rank | P | hop rows | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | fwd peak MiB (model) | "
             "bwd peak MiB (model) | check |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        check = "-" if "passed" not in r else ("ok" if r["passed"] else "FAILED") + f" ({max(r['errors'].values()):.1e})"
        lines.append(
            f"| {r['layer']} | {r['tokens_per_rank']} | {r['P']} | {r['hop_rows']} | {r['forward_ms']:.3f} | "
            f"{r['backward_ms']:.3f} | {r['forward_tflops']:.0f} | {r['backward_tflops']:.0f} | "
            f"{r['forward_peak_bytes'] / 2**20:.0f} ({r['model_forward_bytes'] / 2**20:.0f}) | "
            f"{r['backward_peak_bytes'] / 2**20:.0f} ({r['model_backward_bytes'] / 2**20:.0f}) | {check} |")
    return lines


def median_ratio(records: list[dict], key: str, model_key: str) -> float:
    """The median of measured / modelled bytes over the records."""
    return statistics.median(r[key] / r[model_key] for r in records)
