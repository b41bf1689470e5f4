"""fc2 and dX, whose rows are already in expert order, go through torch._grouped_mm where it
applies (bfloat16 on Hopper) and through the row-GEMM kernel elsewhere: both branches against a
float64 product per expert, on the CPU (the grouped branch forced, as torch runs it there too)."""

from __future__ import annotations

import pytest
import torch

from conftest import rel_error
from moeblaze_megatron import build_routing_plan, moe_mlp
from moeblaze_megatron.kernels import expert_gemm as eg


def _ids(T, E, K, kind, gen):
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    if kind == "empty_expert":
        ids = torch.rand(T, E - 1, generator=gen).topk(K, dim=1).indices
        ids = ids + (ids >= 1).long()  # expert 1 gets nothing
    elif kind == "dropped":
        ids[torch.rand(T, K, generator=gen) < 0.3] = -1
    return ids


def test_grouped_mm_applies_to_bfloat16_on_hopper_only(monkeypatch):
    a = torch.randn(4, 8).bfloat16()
    w = torch.randn(2, 8, 8).bfloat16()
    assert not eg.grouped_mm_applies(a, w, transpose_weight=True)  # CPU
    # As on an H200 (compute capability 9.0): dtype and, untransposed, the reduction length decide.
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert eg.grouped_mm_applies(a, w, transpose_weight=True)
    assert eg.grouped_mm_applies(a, w, transpose_weight=False)
    assert not eg.grouped_mm_applies(a.float(), w.float(), transpose_weight=True)
    assert not eg.grouped_mm_applies(a.half(), w.half(), transpose_weight=True)
    k = eg.GROUPED_MM_MAX_K_UNTRANSPOSED
    assert eg.grouped_mm_applies(torch.empty(4, k).bfloat16(), w, transpose_weight=False)
    assert not eg.grouped_mm_applies(torch.empty(4, k + 8).bfloat16(), w, transpose_weight=False)
    assert eg.grouped_mm_applies(torch.empty(4, 4 * k).bfloat16(), w, transpose_weight=True)
    # A weight whose rows are not 16 bytes apart stays on the kernel.
    assert not eg.grouped_mm_applies(a, torch.randn(2, 8, 12).bfloat16()[:, :, :4], transpose_weight=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not eg.grouped_mm_applies(a, w, transpose_weight=True)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("transpose_weight", [True, False])
@pytest.mark.parametrize("kind", ["random", "empty_expert", "dropped"])
def test_expert_order_gemm_matches_float64_per_expert(monkeypatch, grouped, transpose_weight, kind):
    gen = torch.Generator().manual_seed(hash((grouped, transpose_weight, kind)) % 2**31)
    T, E, K, k_dim, n = 41, 6, 2, 24, 40  # rows per expert and widths not multiples of the tile
    plan = build_routing_plan(_ids(T, E, K, kind, gen), E)
    monkeypatch.setattr(eg, "grouped_mm_applies", lambda a, weight, transpose_weight: grouped)
    a = torch.randn(T * K, k_dim, generator=gen).bfloat16()
    weight = torch.randn(E, n, k_dim, generator=gen).bfloat16() if transpose_weight else \
        torch.randn(E, k_dim, n, generator=gen).bfloat16()
    out = eg.expert_order_gemm(a, weight, plan, transpose_weight=transpose_weight, n=n)
    offsets = plan.expert_token_offsets.tolist()
    w64 = weight.double().transpose(1, 2) if transpose_weight else weight.double()
    expected = torch.cat([a.double()[lo:hi] @ w64[e] for e, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:]))])
    used = offsets[-1]
    assert out.shape == (T * K, n) and out.dtype == torch.bfloat16
    assert rel_error(out[:used], expected) < 1e-2


def test_layer_through_grouped_mm_matches_the_kernel_path(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    T, d, h, E, K = 29, 32, 24, 5, 2
    x = torch.randn(T, d, generator=gen).bfloat16()
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    probs = torch.rand(T, K, generator=gen).bfloat16()
    fc1 = (torch.randn(E, 2 * h, d, generator=gen) * d**-0.5).bfloat16()
    fc2 = (torch.randn(E, d, h, generator=gen) * h**-0.5).bfloat16()
    gy = torch.randn(T, d, generator=gen).bfloat16()
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *args, **kw: calls.append(1) or grouped_mm(*args, **kw))
    results = []
    for grouped in (False, True):
        monkeypatch.setattr(eg, "grouped_mm_applies", lambda a, weight, transpose_weight, grouped=grouped: grouped)
        leaves = [t.clone().requires_grad_() for t in (x, probs, fc1, fc2)]
        y = moe_mlp(leaves[0], ids, leaves[1], leaves[2], leaves[3], backend="triton")
        y.backward(gy)
        results.append([y.detach()] + [t.grad for t in leaves])
    assert len(calls) == 2  # fc2 and dX, in the second pass only
    for kernel, grouped in zip(*results):
        assert rel_error(grouped, kernel) < 1e-2
