"""A small tour of the op: route random tokens, build the plan, run moe_mlp forward and backward,
check it against a float64 loop over experts, and audit what it keeps for backward.

    python examples/demo_moe_mlp.py

Runs on the GPU when there is one (the fused kernels), else on the CPU (the PyTorch reference), in
seconds either way. Ends with PASS when the output and every gradient are within TOLERANCE of the
float64 loop, else FAIL and exit status 1.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from moeblaze_megatron import build_routing_plan, moe_mlp
from moeblaze_megatron.training.audit import saved_bytes_for_backward

T, D, H, E, K = 1024, 256, 128, 8, 2  # tokens, hidden, expert ffn hidden, experts, top-k
# Relative error allowed against float64: the bf16 bar of the op's own tests. bf16 keeps 8 bits
# (u = 2**-9); the few roundings in sequence give ~4e-3, a routing or indexing mistake ~1.
TOLERANCE = 8 * 2.0**-9


def dense_loop(x, topk_ids, topk_probs, fc1, fc2):
    """y[t] = sum_k p[t,k] * fc2[e] @ (silu(gate) * up), every expert on every token, float64."""
    x, topk_probs, fc1, fc2 = x.double(), topk_probs.double(), fc1.double(), fc2.double()
    y = torch.zeros_like(x)
    for e in range(fc1.shape[0]):
        gate, up = (x @ fc1[e].t()).chunk(2, dim=-1)  # Megatron's GLU layout: [gate | up]
        weight = (topk_probs * (topk_ids == e)).sum(dim=1, keepdim=True)
        y += weight * ((F.silu(gate) * up) @ fc2[e].t())
    return y


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    router = torch.randn(D, E, device=device, dtype=dtype) / D**0.5
    fc1 = (torch.randn(E, 2 * H, D, device=device) / D**0.5).to(dtype).requires_grad_()
    fc2 = (torch.randn(E, D, H, device=device) / H**0.5).to(dtype).requires_grad_()

    # A top-k softmax router, as Megatron's; drop a few slots as a capacity limit would (-1).
    scores = (x.detach() @ router).float().softmax(dim=-1)
    topk_probs, topk_ids = scores.topk(K, dim=-1)
    topk_ids[torch.rand(T, K, device=device) < 0.02] = -1
    topk_probs.requires_grad_()

    plan = build_routing_plan(topk_ids, E)
    print(f"device {device}, {dtype}, T={T} d={D} h={H} E={E} K={K}, SwiGLU")
    print(f"plan: tokens per expert {plan.tokens_per_expert.tolist()}, {int((topk_ids < 0).sum())} unused slots")
    print(f"  expert 0 takes tokens {plan.expert_token_indices[:8].tolist()}...; "
          f"token 0's slots sit at {plan.token_index_map[0].tolist()}")

    y, saved = saved_bytes_for_backward(lambda: moe_mlp(x, topk_ids, topk_probs, fc1, fc2, "swiglu", plan), [fc1, fc2])
    grad_y = torch.randn_like(y)
    y.backward(grad_y)

    leaves = [t.detach().double().requires_grad_() for t in (x, topk_probs, fc1, fc2)]
    want = dense_loop(leaves[0], topk_ids, *leaves[1:])
    want.backward(grad_y.double())
    inputs = {"x": x, "probs": topk_probs, "fc1": fc1, "fc2": fc2}
    results = [("y", y, want)] + [(f"grad {n}", t.grad, leaf.grad) for (n, t), leaf in zip(inputs.items(), leaves)]
    failed = []
    for name, got, ref in results:
        diff = got.double() - ref
        relative = (diff.norm() / ref.norm()).item()
        if not relative <= TOLERANCE:  # a NaN fails too
            failed.append(name)
        print(f"{name:>10}: max |error| {diff.abs().max().item():.2e}, "
              f"relative {relative:.2e} vs float64")

    floor = 2 * T * D + 4 * T * K * H  # bf16 bytes: x, and the pre-activations a|b
    print(f"saved for backward (weights excluded): {saved / 2**20:.2f} MiB; "
          f"floor 2Td + 4TKh = {floor / 2**20:.2f} MiB; the rest is the O(T*K) index maps and probs")
    if failed:
        print(f"FAIL: {', '.join(failed)} beyond the relative tolerance {TOLERANCE:.2e} against float64")
        return 1
    print(f"PASS: the output and every gradient within the relative tolerance {TOLERANCE:.2e} against float64")
    return 0


if __name__ == "__main__":
    sys.exit(main())
