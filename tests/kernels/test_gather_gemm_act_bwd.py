"""The gather GEMM's activation-backward epilogue (dH = dY[token] @ fc2[e], then d pre in place of the
saved pre-activations, p * act(pre) for dW2 and the router-probability partials) at every tile
width it can run, against float64 under the interpreter: the GPU's 256-wide tile runs its epilogue
in four 64-column chunks, the 128-wide one in two, narrower ones in one; widths that are not
multiples of the tile, an expert with no rows and unused slots whose rows must stay unwritten."""

from __future__ import annotations

import pytest
import torch
import triton

from moe_testing import check_saturated_activations, rel_error
from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels.gather_gemm import EPI_ACT_BWD, gather_gemm_ds_tiles
from moeblaze_megatron.kernels.tuning import gather_gemm_with


def _reference(dy, fc2, pre, probs, plan, h, activation):
    """float64 outputs for the used rows: (d pre, p * act(pre), <dH, act(pre)>)."""
    offsets = plan.expert_token_offsets.tolist()
    tokens = plan.expert_token_indices.long()
    d_pre, c, ds = [], [], []
    for e in range(plan.num_experts):
        rows = slice(offsets[e], offsets[e + 1])
        dh = dy.double()[tokens[rows]] @ fc2.double()[e]
        p = probs.double()[rows, None]
        g = pre.double()[rows, :h]
        if activation == "swiglu":
            up = pre.double()[rows, h:]
            sig = torch.sigmoid(g)
            act = g * sig * up
            d_pre.append(torch.cat([p * dh * up * sig * (1 + g * (1 - sig)), p * dh * g * sig], 1))
        else:
            g = g.requires_grad_()
            out = torch.nn.functional.gelu(g) if activation == "gelu" else torch.nn.functional.silu(g)
            (grad,) = torch.autograd.grad(out, g, p * dh)
            act, g = out.detach(), g.detach()
            d_pre.append(grad)
        c.append(p * act)
        ds.append((dh * act).sum(1))
    return torch.cat(d_pre), torch.cat(c), torch.cat(ds)


@pytest.mark.parametrize("block_n", [16, 64, 128, 256])
@pytest.mark.parametrize("activation", ["swiglu", "silu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_activation_backward_matches_float64_at_every_tile_width(block_n, activation, dtype):
    gen = torch.Generator().manual_seed(hash((block_n, activation, str(dtype))) % 2**31)
    T, E, K, d, h = 29, 5, 2, 24, 200  # h: not a multiple of 64, 128 or 256
    ids = torch.rand(T, E - 1, generator=gen).topk(K, dim=1).indices
    ids = ids + (ids >= 2).long()  # expert 2 gets no rows
    ids[torch.rand(T, K, generator=gen) < 0.2] = -1  # unused slots: their rows sit past the last offset
    plan = build_routing_plan(ids, E)
    rows_total, used = T * K, int(plan.expert_token_offsets[-1])
    width = 2 * h if activation == "swiglu" else h
    dy = torch.randn(T, d, generator=gen).to(dtype)
    fc2 = (torch.randn(E, d, h, generator=gen) * d**-0.5).to(dtype)
    pre = torch.randn(rows_total, width, generator=gen).to(dtype)
    probs = torch.rand(rows_total, generator=gen).to(dtype)
    d_pre = pre.clone()
    c = torch.full((rows_total, h), float("nan"), dtype=dtype)
    ds = torch.full((rows_total, gather_gemm_ds_tiles(h, block_n)), float("nan"))
    config = triton.Config({"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": 16, "GROUP_M": 2}, num_warps=4)
    gather_gemm_with(config, dy, fc2, c, plan, transpose_weight=False, epilogue=EPI_ACT_BWD, activation=activation,
                  pre=d_pre, probs_sorted=probs, ds_partial=ds, n=h)
    want_pre, want_c, want_ds = _reference(dy, fc2, pre, probs, plan, h, activation)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_error(d_pre[:used], want_pre) <= tol
    assert rel_error(c[:used], want_c) <= tol
    assert rel_error(ds[:used].sum(1), want_ds) <= tol
    # Rows of unused slots: nothing written (pre keeps its values, the poison stays).
    assert torch.equal(d_pre[used:], pre[used:])
    assert c[used:].isnan().all() and ds[used:].isnan().all()


@pytest.mark.parametrize("activation", ["swiglu", "silu"])  # GELU has no sigmoid
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")  # numpy's 2^x -> inf, meant
def test_activations_where_the_sigmoid_saturates(activation, dtype):
    """Pre-activations from -1e4 to 1e4 (the exponential past float32's range, denormal sigmoids)
    through both fused epilogues, element by element against float64 (the GPU's flush-to-zero
    sigmoid runs the same check in tests/gpu)."""
    config = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2}, num_warps=4)
    check_saturated_activations("cpu", dtype, activation, config=config)
