"""The weight-gradient kernel's expert-order operand through a ragged TMA descriptor (the default
where a descriptor can take it) against its pointer-load form and a float64 reduction, under the
interpreter: every expert's rows and none of its neighbours'."""

from __future__ import annotations

import pytest
import torch
import triton
from triton.tools.ragged_tma import create_ragged_descriptor

from moe_testing import rel_error, weight_grad_reference
from moeblaze_megatron import build_routing_plan, moe_mlp
from moeblaze_megatron.kernels import configs as cf
from moeblaze_megatron.kernels import weight_grad as wg
from moeblaze_megatron.kernels.settings import SETTINGS
from moeblaze_megatron.kernels.tuning import weight_grad_with

CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=4)


def _routing(num_tokens, num_experts, topk, kind, gen):
    if kind == "one_expert_empty":
        ids = torch.rand(num_tokens, num_experts - 1, generator=gen).topk(topk, dim=1).indices
        return ids + (ids >= 2).long()  # expert 2 gets nothing
    if kind == "all_on_one":
        return (torch.arange(topk).repeat(num_tokens, 1) + 1) % num_experts
    return torch.rand(num_tokens, num_experts, generator=gen).topk(topk, dim=1).indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["random", "one_expert_empty", "all_on_one"])
@pytest.mark.parametrize("gathered", ["a", "b"])
def test_tma_variant_matches_pointer_loads_and_float64(dtype, kind, gathered):
    gen = torch.Generator().manual_seed(hash((str(dtype), kind, gathered)) % 2**31)
    T, E, K, M, N = 37, 5, 2, 40, 24  # rows per expert and widths not multiples of the tile
    ids = _routing(T, E, K, kind, gen)
    plan = build_routing_plan(ids, E)
    rows = T * K
    tokens = torch.randn(T, M if gathered == "a" else N, generator=gen).to(dtype)
    ordered = torch.randn(rows, N if gathered == "a" else M, generator=gen).to(dtype)
    a, b = (tokens, ordered) if gathered == "a" else (ordered, tokens)
    flags = dict(gather_a=gathered == "a", gather_b=gathered == "b")
    outs = []
    for tma in (False, True):
        out = torch.full((E, M, N), float("nan"), dtype=dtype)
        weight_grad_with(CONFIG, a, b, out, plan, tma=tma, **flags)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    expected = weight_grad_reference(a, b, plan, gathered)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_error(outs[1], expected) < tol
    if kind == "one_expert_empty":
        assert torch.equal(outs[1][2], torch.zeros(M, N, dtype=dtype))


def test_tma_refuses_two_gathers_and_tensors_a_descriptor_cannot_take():
    plan = build_routing_plan(torch.tensor([[0], [1]]), 2)
    x = torch.randn(2, 16)
    out = torch.empty(2, 16, 16)
    with pytest.raises(ValueError, match="needs exactly one gathered operand"):
        weight_grad_with(CONFIG, x, x, out, plan, gather_a=True, gather_b=True, tma=True)
    # A TMA descriptor needs rows 16 bytes apart: 12 bfloat16 columns are 24.
    narrow = torch.randn(2, 12).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"b must be on a GPU .* rows a multiple of 16 bytes apart"):
        weight_grad_with(CONFIG, x.to(torch.bfloat16), narrow, torch.empty(2, 16, 12, dtype=torch.bfloat16), plan,
                         gather_a=True, gather_b=False, tma=True)


@pytest.mark.parametrize("tensor", ["aligned", "misaligned", "narrow_rows"])
def test_default_takes_tma_where_a_descriptor_can_and_pointer_loads_elsewhere(tensor, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    T, E, K, M, N = 21, 3, 2, 16, 24
    plan = build_routing_plan(torch.rand(T, E, generator=gen).topk(K, dim=1).indices, E)
    tokens = torch.randn(T, M, generator=gen)
    if tensor == "aligned":
        ordered = torch.randn(T * K, N, generator=gen)
    elif tensor == "misaligned":  # starts 4 bytes into its storage
        ordered = torch.randn(T * K, N + 1, generator=gen)[:, 1:]
    else:  # rows 12 bytes apart
        ordered = torch.randn(T * K, 3, generator=gen)
        N = 3
    taken = []
    monkeypatch.setattr(wg, "launch_call", lambda call: taken.append(call.constexprs["TMA"]))
    wg.weight_grad(tokens, ordered, torch.empty(E, M, N), plan, gather_a=True, gather_b=False)
    wg.weight_grad(tokens, tokens, torch.empty(E, M, M), plan, gather_a=True, gather_b=True)
    assert taken == [tensor == "aligned", False]


def test_every_autotuned_config_sizes_the_descriptor_box(monkeypatch):
    monkeypatch.setattr(SETTINGS, "interpret", False)
    monkeypatch.setattr(SETTINGS, "autotune", True)
    configs = cf.weight_grad_configs()
    assert len({cf.config_label(c) for c in configs}) == len(configs) > 1
    ordered = torch.randn(64, 32)
    for config in configs:
        assert config.pre_hook is cf.set_tma_box
        desc = create_ragged_descriptor(ordered, [16, 16])
        config.pre_hook({"a_ptr": ordered, "b_ptr": desc, **config.kwargs})
        assert list(desc.block_shape)[-2:] == [config.kwargs["BLOCK_K"], config.kwargs["BLOCK_N"]]


@pytest.mark.parametrize("gathered", ["a", "b"])
def test_tma_variant_reads_no_row_of_the_next_expert(gathered):
    # NaN in expert 3's rows must stay in expert 3: a TMA box reaching past an expert's last row
    # would multiply them by the zero-masked rows of the gathered operand and spread NaN.
    gen = torch.Generator().manual_seed(7)
    T, E, K, M, N = 29, 6, 2, 24, 40
    # Token t goes to experts t % E and (t + 1) % E: 9-10 rows each, so one row tile (16) holds a
    # whole expert and any row past its end would be the next expert's.
    t = torch.arange(T)
    plan = build_routing_plan(torch.stack([t % E, (t + 1) % E], dim=1), E)
    counts = plan.expert_token_offsets.diff()
    assert ((counts > 0) & (counts < CONFIG.kwargs["BLOCK_K"])).all()
    lo, hi = plan.expert_token_offsets[3].item(), plan.expert_token_offsets[4].item()
    tokens = torch.randn(T, M if gathered == "a" else N, generator=gen)
    ordered = torch.randn(T * K, N if gathered == "a" else M, generator=gen)
    ordered[lo:hi] = float("nan")
    a, b = (tokens, ordered) if gathered == "a" else (ordered, tokens)
    out = torch.full((E, M, N), float("nan"))
    weight_grad_with(CONFIG, a, b, out, plan, gather_a=gathered == "a", gather_b=gathered == "b", tma=True)
    others = [e for e in range(E) if e != 3]
    assert torch.isfinite(out[others]).all()
    assert torch.isnan(out[3]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_with_tma_weight_gradients_is_bitwise_pointer_loads(monkeypatch, dtype):
    gen = torch.Generator().manual_seed(11)
    T, d, h, E, K = 33, 32, 24, 6, 3
    x = torch.randn(T, d, generator=gen).to(dtype)
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    probs = torch.rand(T, K, generator=gen).to(dtype)
    fc1 = (torch.randn(E, 2 * h, d, generator=gen) * d**-0.5).to(dtype)
    fc2 = (torch.randn(E, d, h, generator=gen) * h**-0.5).to(dtype)
    gy = torch.randn(T, d, generator=gen).to(dtype)
    grads = []
    for tma in (True, False):
        if not tma:
            monkeypatch.setattr(wg, "ragged_tma_takes", lambda ordered, rows_total: False)
        leaves = [t.clone().requires_grad_() for t in (x, probs, fc1, fc2)]
        y = moe_mlp(leaves[0], ids, leaves[1], leaves[2], leaves[3], backend="triton")
        y.backward(gy)
        grads.append([y.detach()] + [t.grad for t in leaves])
    for with_tma, plain in zip(*grads):
        assert torch.equal(with_tma, plain)
