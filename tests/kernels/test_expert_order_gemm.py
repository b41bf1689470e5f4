"""The GEMMs over rows already in expert order (fc2 and dX, through the row-GEMM kernel) and, for
experts at least as wide as the model, the weight gradients as a gather into expert order plus
torch._grouped_mm (bfloat16 on Hopper; forced on the CPU, where torch runs it too): against
float64 per expert, with the rows of unused slots poisoned and experts that get no rows."""

from __future__ import annotations

import pytest
import torch

from moe_testing import per_expert_weight_grad64, rel_error
from moeblaze_megatron import build_routing_plan, fused, moe_mlp
from moeblaze_megatron.kernels import weight_grad as wg
from moeblaze_megatron.kernels.calls import stand_in
from moeblaze_megatron.kernels.gather_gemm import expert_order_gemm
from moeblaze_megatron.routing import RoutingPlan


def _ids(T, E, K, kind, gen):
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    if kind == "empty_expert":
        ids = torch.rand(T, E - 1, generator=gen).topk(K, dim=1).indices
        ids = ids + (ids >= 1).long()  # expert 1 gets nothing
    elif kind == "dropped":
        ids[torch.rand(T, K, generator=gen) < 0.3] = -1
    return ids


@pytest.mark.parametrize("transpose_weight", [True, False])
@pytest.mark.parametrize("kind", ["random", "empty_expert", "dropped"])
def test_expert_order_gemm_matches_float64_per_expert(transpose_weight, kind):
    gen = torch.Generator().manual_seed(hash((transpose_weight, kind)) % 2**31)
    T, E, K, k_dim, n = 41, 6, 2, 24, 40  # rows per expert and widths not multiples of the tile
    plan = build_routing_plan(_ids(T, E, K, kind, gen), E)
    a = torch.randn(T * K, k_dim, generator=gen).bfloat16()
    weight = torch.randn(E, n, k_dim, generator=gen).bfloat16() if transpose_weight else \
        torch.randn(E, k_dim, n, generator=gen).bfloat16()
    out = expert_order_gemm(a, weight, plan, transpose_weight=transpose_weight, n=n)
    offsets = plan.expert_token_offsets.tolist()
    w64 = weight.double().transpose(1, 2) if transpose_weight else weight.double()
    expected = torch.cat([a.double()[lo:hi] @ w64[e] for e, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:]))])
    used = offsets[-1]
    assert out.shape == (T * K, n) and out.dtype == torch.bfloat16
    assert rel_error(out[:used], expected) < 1e-2


@pytest.mark.parametrize("kind", ["random", "dropped"])
def test_layer_through_grouped_mm_matches_the_kernel_path(monkeypatch, kind):
    gen = torch.Generator().manual_seed(3)
    T, d, h, E, K = 29, 32, 24, 5, 2
    x = torch.randn(T, d, generator=gen).bfloat16()
    ids = _ids(T, E, K, kind, gen)
    probs = torch.rand(T, K, generator=gen).bfloat16()
    fc1 = (torch.randn(E, 2 * h, d, generator=gen) * d**-0.5).bfloat16()
    fc2 = (torch.randn(E, d, h, generator=gen) * h**-0.5).bfloat16()
    gy = torch.randn(T, d, generator=gen).bfloat16()
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *args, **kw: calls.append(1) or grouped_mm(*args, **kw))
    results = []
    for grouped in (False, True):
        monkeypatch.setattr(fused, "grouped_weight_grads_apply", lambda x, ffn, grouped=grouped: grouped)
        leaves = [t.clone().requires_grad_() for t in (x, probs, fc1, fc2)]
        y = moe_mlp(leaves[0], ids, leaves[1], leaves[2], leaves[3], backend="triton")
        y.backward(gy)
        results.append([y.detach()] + [t.grad for t in leaves])
    assert len(calls) == 2  # dW2 and dW1, in the second pass only
    for kernel, grouped in zip(*results):
        assert rel_error(grouped, kernel) < 1e-2
    for kernel, grouped in zip(results[0][:3], results[1][:3]):  # y, dx and dprobs: the same path
        assert torch.equal(kernel, grouped)


@pytest.mark.parametrize("gather_a", [True, False])
@pytest.mark.parametrize("kind", ["random", "empty_expert", "dropped"])
def test_gathered_weight_grad_matches_float64_per_expert(gather_a, kind):
    gen = torch.Generator().manual_seed(hash((gather_a, kind)) % 2**31)
    T, E, K, rows_width, token_width = 41, 6, 2, 24, 40  # not multiples of any tile
    plan = build_routing_plan(_ids(T, E, K, kind, gen), E)
    offsets = plan.expert_token_offsets.tolist()
    rows = torch.randn(T * K, rows_width, generator=gen).bfloat16()
    rows[offsets[-1]:] = float("nan")  # unused slots' rows: never written by the kernels before it
    tokens = torch.randn(T, token_width, generator=gen).bfloat16()
    buffer = torch.full((T * K, token_width), float("nan"), dtype=torch.bfloat16)
    a, b = (tokens, rows) if gather_a else (rows, tokens)
    out = wg.gathered_weight_grad(a, b, plan, gather_a=gather_a, buffer=buffer)
    expected = per_expert_weight_grad64(tokens, rows, plan, gather_a)
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert rel_error(out, expected) < 1e-2
    for e in range(E):
        if offsets[e] == offsets[e + 1]:
            assert (out[e] == 0).all()
    # On meta stand-ins (the layer's recorded launches) the same shape and dtype, nothing run.
    meta_plan = RoutingPlan(*map(stand_in, plan.tensors()))
    meta = wg.gathered_weight_grad(stand_in(a), stand_in(b), meta_plan, gather_a=gather_a, buffer=stand_in(buffer))
    assert meta.is_meta and meta.shape == out.shape and meta.dtype == out.dtype


def test_grouped_weight_grads_apply_to_wide_bfloat16_experts_on_hopper_only(monkeypatch):
    x = torch.randn(4, 16).bfloat16()
    assert not wg.grouped_weight_grads_apply(x, 64)  # CPU
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(wg, "capability", lambda index: (9, 0))
    assert wg.grouped_weight_grads_apply(x, 64)
    assert wg.grouped_weight_grads_apply(x, 16)
    assert not wg.grouped_weight_grads_apply(x, 8)  # fine-grained experts stay on the kernel
    assert not wg.grouped_weight_grads_apply(x, 36)  # rows of 72 bytes: not what grouped_mm takes
    assert not wg.grouped_weight_grads_apply(torch.randn(4, 12).bfloat16(), 64)
    assert not wg.grouped_weight_grads_apply(x.half(), 64)
    assert not wg.grouped_weight_grads_apply(x.float(), 64)
    monkeypatch.setattr(wg, "capability", lambda index: (8, 0))
    assert not wg.grouped_weight_grads_apply(x, 64)
