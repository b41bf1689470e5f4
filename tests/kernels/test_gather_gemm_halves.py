"""The gather GEMM on a weight given as two tensors (torchtitan's w1 and w3): the SwiGLU forward
with gate and up read from their own tensors, and the plain GEMM reducing over both halves (dX),
against a float64 oracle, through pointers and TMA descriptors, on awkward plans (empty experts,
unused slots, every token on one expert, top-1, K = E) and widths off the tile; bitwise the
stacked weight's result where the halves' width is a multiple of the tile (the same k blocks).
The layer end to end (fused forward and backward, both recompute modes) and the refusals."""

from __future__ import annotations

import pytest
import torch

from moe_testing import make_topk_ids, rel_error
from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.fused import fused_backward, fused_forward
from moeblaze_megatron.kernels import gather_gemm as rg

# (kind, T, E, K, F): F = 32 is two of the interpreter's 16-wide tiles, 24 is not a multiple.
CASES = [("random", 37, 5, 2, 32), ("empty_experts", 50, 8, 2, 24), ("unused", 41, 6, 3, 32),
         ("one_expert", 30, 4, 1, 24), ("random", 20, 4, 4, 32)]
CASE_IDS = ["random", "empty_experts_f24", "unused_slots", "top1_one_expert_f24", "k_equals_e"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _problem(kind, T, E, K, F, dtype, seed, d=40):
    g = torch.Generator().manual_seed(seed)
    plan = build_routing_plan(make_topk_ids(kind, T, E, K, g), E)
    x = torch.randn(T, d, generator=g).to(dtype)
    w1, w3 = ((torch.randn(E, F, d, generator=g) * d**-0.5).to(dtype) for _ in range(2))
    grad_pre = torch.randn(plan.expert_token_indices.shape[0], 2 * F, generator=g).to(dtype)
    return plan, x, w1, w3, grad_pre


def _rows64(plan):
    """(token, expert) of every used slot of the plan, in expert order."""
    offsets = plan.expert_token_offsets.tolist()
    return [(int(plan.expert_token_indices[r]), e) for e in range(plan.num_experts)
            for r in range(offsets[e], offsets[e + 1])]


def _nan(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("tma", [False, True, "rows"], ids=["pointers", "descriptors", "descriptors_and_ragged_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,T,E,K,F", CASES, ids=CASE_IDS)
def test_halves_match_float64_and_the_stacked_weight(kind, T, E, K, F, dtype, tma):
    plan, x, w1, w3, grad_pre = _problem(kind, T, E, K, F, dtype, seed=T * E + K)
    rows, d = plan.expert_token_indices.shape[0], x.shape[1]
    results = []
    for weight in ((w1, w3), torch.cat([w1, w3], dim=1)):
        pre, h, dx = _nan(rows, 2 * F, dtype=dtype), _nan(rows, F, dtype=dtype), _nan(rows, d, dtype=dtype)
        rg.gather_gemm(x, weight, h, plan, transpose_weight=True, epilogue=rg.EPI_ACT_FWD, activation="swiglu",
                    pre=pre, n=F, tma_weight=bool(tma))
        # "rows": dX's A (both halves' columns) and output through ragged descriptors too.
        rg.gather_gemm(grad_pre, weight, dx, plan, transpose_weight=False, gather_a=False, n=d, tma_weight=bool(tma),
                    tma_rows=tma == "rows" and plan.expert_token_offsets[-1].item() > 0)
        results.append((pre, h, dx))
    (pre, h, dx), stacked = results
    used = plan.expert_token_offsets[-1].item()
    w1_64, w3_64, x64, gp64 = w1.double(), w3.double(), x.double(), grad_pre.double()
    want_pre = torch.stack([torch.cat([w1_64[e] @ x64[t], w3_64[e] @ x64[t]]) for t, e in _rows64(plan)]) \
        if used else torch.zeros(0, 2 * F, dtype=torch.float64)
    want_dx = torch.stack([gp64[r, :F] @ w1_64[e] + gp64[r, F:] @ w3_64[e] for r, (_, e) in enumerate(_rows64(plan))]) \
        if used else torch.zeros(0, d, dtype=torch.float64)
    gate, up = want_pre[:, :F], want_pre[:, F:]
    want_h = torch.nn.functional.silu(gate) * up
    # The kernel rounds pre to the storage dtype before the activation: compare h on its own pre.
    got_gate, got_up = pre[:used, :F].double(), pre[:used, F:].double()
    assert rel_error(pre[:used], want_pre) <= TOL[dtype]
    assert rel_error(h[:used], torch.nn.functional.silu(got_gate) * got_up) <= TOL[dtype]
    assert rel_error(h[:used], want_h) <= 2 * TOL[dtype]
    assert rel_error(dx[:used], want_dx) <= TOL[dtype]
    # Unused slots' rows stay unwritten.
    assert torch.isnan(pre[used:]).all() and torch.isnan(h[used:]).all() and torch.isnan(dx[used:]).all()
    for got, want in zip((pre, h, dx), stacked):
        if F % 16 == 0 or got is not dx:  # dX's k blocks differ from the stacked ones at F = 24
            assert torch.equal(got[:used], want[:used])


@pytest.mark.parametrize("recompute", ["activation", "fc1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_on_halves_is_bitwise_the_stacked_layer(dtype, recompute):
    # Forward and backward over the kernels with fc1 as (gate, up): the same bits as with fc1
    # stacked, and fc1's gradient as the two halves' gradients.
    plan, x, w1, w3, _ = _problem("unused", 45, 6, 2, 32, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    probs = torch.rand(x.shape[0], 2, generator=g).to(dtype)
    fc2 = (torch.randn(6, x.shape[1], 32, generator=g) * 32**-0.5).to(dtype)
    gy = torch.randn_like(x)
    runs = []
    for fc1 in ((w1, w3), torch.cat([w1, w3], dim=1)):
        y, probs_sorted, pre = fused_forward(x, probs, fc1, fc2, plan, "swiglu", save_pre=recompute == "activation")
        runs.append((y, *fused_backward(gy, x, probs_sorted, fc1, fc2, plan, "swiglu", pre, (True,) * 4)))
    (y, gx, gp, (g1, g3), g2), (y_s, gx_s, gp_s, g13_s, g2_s) = runs
    for got, want in ((y, y_s), (gx, gx_s), (gp, gp_s), (torch.cat([g1, g3], dim=1), g13_s), (g2, g2_s)):
        assert torch.isfinite(got).all() and torch.equal(got, want)
    assert g1.shape == w1.shape and g1.is_contiguous() and g3.is_contiguous()


def test_halves_refused_where_no_launch_takes_them():
    plan, x, w1, w3, _ = _problem("random", 10, 3, 2, 16, torch.float32, seed=0)
    rows = plan.expert_token_indices.shape[0]
    out = torch.empty(rows, 16)
    with pytest.raises(ValueError, match="gate, up.*SwiGLU forward.*got epilogue 1, activation 'gelu'"):
        rg.gather_gemm(x, (w1, w3), out, plan, transpose_weight=True, epilogue=rg.EPI_ACT_FWD, activation="gelu", n=16)
    with pytest.raises(ValueError, match="got epilogue 0.*transpose_weight=True"):
        rg.gather_gemm(x, (w1, w3), out, plan, transpose_weight=True, n=16)
    with pytest.raises(ValueError, match="must match in shape, strides, dtype and device"):
        rg.gather_gemm(x, (w1, w3[:, :8]), out, plan, transpose_weight=True, epilogue=rg.EPI_ACT_FWD, n=16)
    # dX over halves of 16 rows each needs A 32 wide.
    with pytest.raises(ValueError, match=r"each half of the weight pair must be \[E, 15, 40\] for A of width 30"):
        rg.gather_gemm(torch.randn(rows, 30), (w1, w3), torch.empty(rows, 40), plan, transpose_weight=False,
                    gather_a=False, n=40)
    with pytest.raises(ValueError, match=r"must be \[E, 8, 40\].*got \(3, 16, 40\)"):
        rg.gather_gemm(x, (w1, w3), out, plan, transpose_weight=True, epilogue=rg.EPI_ACT_FWD, n=8)
