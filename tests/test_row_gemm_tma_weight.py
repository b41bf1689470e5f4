"""The row-GEMM kernel's weight through a TMA descriptor (the default where one can take it):
every epilogue gives the pointer form's bits under the interpreter, at widths that are not
multiples of the tile (the descriptor's zero fill must stand in for the masks)."""

from __future__ import annotations

import pytest
import torch
import triton

from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels import expert_gemm as eg

CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, num_warps=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_every_epilogue_matches_pointer_loads(dtype, activation):
    gen = torch.Generator().manual_seed(hash((str(dtype), activation)) % 2**31)
    T, E, K, d, h = 37, 5, 2, 40, 24
    plan = build_routing_plan(torch.rand(T, E, generator=gen).topk(K, dim=1).indices, E)
    width = 2 * h if activation == "swiglu" else h
    x = torch.randn(T, d, generator=gen).to(dtype)
    fc1 = torch.randn(E, width, d, generator=gen).to(dtype)
    fc2 = torch.randn(E, d, h, generator=gen).to(dtype)
    dy = torch.randn(T, d, generator=gen).to(dtype)
    probs = torch.rand(T * K, generator=gen).to(dtype)
    results = []
    for tma in (False, True):
        kw = dict(plan=plan, config=CONFIG, tma_weight=tma)
        nan = lambda *shape: torch.full(shape, float("nan"), dtype=dtype)  # noqa: E731
        pre, hid, out2, hs, dx = nan(T * K, width), nan(T * K, h), nan(T * K, d), nan(T * K, h), nan(T * K, d)
        eg.row_gemm(x, fc1, hid, transpose_weight=True, epilogue=eg.EPI_ACT_FWD, activation=activation, pre=pre,
                    n=h, **kw)
        eg.row_gemm(hid, fc2, out2, transpose_weight=True, gather_a=False, n=d, **kw)
        dpre = pre.clone()
        ds = torch.zeros(T * K, eg.row_gemm_ds_tiles(h))
        eg.row_gemm(dy, fc2, hs, transpose_weight=False, epilogue=eg.EPI_ACT_BWD, activation=activation,
                    pre=dpre, probs_sorted=probs, ds_partial=ds, n=h, **kw)
        eg.row_gemm(dpre, fc1, dx, transpose_weight=False, gather_a=False, n=d, **kw)
        results.append((pre, hid, out2, dpre, hs, ds, dx))
    for plain, tma in zip(*results):
        assert torch.isfinite(tma).all()
        assert torch.equal(plain, tma)


def test_tma_weight_refuses_what_a_descriptor_cannot_take():
    plan = build_routing_plan(torch.tensor([[0], [1]]), 2)
    x = torch.randn(2, 16)
    strided = torch.randn(2, 16, 32)[:, :, ::2]
    with pytest.raises(ValueError, match="weight must be on a GPU .* unit last stride"):
        eg.row_gemm(x, strided, torch.empty(2, 16), plan, transpose_weight=True, n=16, config=CONFIG, tma_weight=True)


@pytest.mark.parametrize("weight", ["contiguous", "strided", "misaligned"])
def test_default_reads_the_weight_through_tma_where_it_can(weight, monkeypatch):
    plan = build_routing_plan(torch.tensor([[0], [1], [1]]), 2)
    x = torch.randn(3, 16)
    w = {"contiguous": torch.randn(2, 16, 16), "strided": torch.randn(2, 16, 32)[:, :, ::2],
         "misaligned": torch.randn(2 * 16 * 16 + 1)[1:].view(2, 16, 16)}[weight]
    taken = []
    monkeypatch.setattr(eg, "_launch", lambda kernel, grid, args, constexprs, config: taken.append(
        (constexprs["TMA_B"], isinstance(args[1], eg.TensorDescriptor))))
    eg.row_gemm(x, w, torch.empty(3, 16), plan, transpose_weight=True, n=16)
    assert taken == [(weight == "contiguous",) * 2]


def test_every_autotuned_row_config_sizes_the_weight_box(monkeypatch):
    monkeypatch.setattr(eg, "interpreting", lambda: False)
    monkeypatch.setattr(eg, "autotuning", lambda: True)
    configs = eg._row_gemm_configs()
    assert len(configs) > 1
    w = torch.randn(3, 32, 64)
    for config in configs:
        assert config.pre_hook is eg._set_weight_box
        bk, bn = config.kwargs["BLOCK_K"], config.kwargs["BLOCK_N"]
        for desc, trans, box in ((eg.TensorDescriptor.from_tensor(w.view(3, 2, 16, 64), [1, 2, 8, 8]), True,
                                  [1, 2, bn, bk]),
                                 (eg.TensorDescriptor.from_tensor(w, [1, 8, 8]), True, [1, bn, bk]),
                                 (eg.TensorDescriptor.from_tensor(w, [1, 8, 8]), False, [1, bk, bn])):
            config.pre_hook({"b_ptr": desc, "TRANS_B": trans, **config.kwargs})
            assert list(desc.block_shape) == box


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_layer_with_descriptors_is_bitwise_the_pointer_form(monkeypatch, dtype, activation):
    from moeblaze_megatron import moe_mlp

    gen = torch.Generator().manual_seed(13)
    T, d, h, E, K = 33, 32, 24, 6, 3
    width = 2 * h if activation == "swiglu" else h
    x = torch.randn(T, d, generator=gen).to(dtype)
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    probs = torch.rand(T, K, generator=gen).to(dtype)
    fc1 = (torch.randn(E, width, d, generator=gen) * d**-0.5).to(dtype)
    fc2 = (torch.randn(E, d, h, generator=gen) * h**-0.5).to(dtype)
    gy = torch.randn(T, d, generator=gen).to(dtype)
    launched, results = [], []
    launch = eg._launch
    monkeypatch.setattr(eg, "_launch", lambda kernel, grid, args, constexprs, config: launched.append(
        constexprs.get("TMA_B")) or launch(kernel, grid, args, constexprs, config))
    takes = eg._tma_takes
    for descriptors in (False, True):
        monkeypatch.setattr(eg, "_tma_takes", takes if descriptors else lambda t: False)
        leaves = [t.clone().requires_grad_() for t in (x, probs, fc1, fc2)]
        y = moe_mlp(leaves[0], ids, leaves[1], leaves[2], leaves[3], activation, backend="triton")
        y.backward(gy)
        results.append([y.detach()] + [t.grad for t in leaves])
    row_launches = [t for t in launched if t is not None]
    half = len(row_launches) // 2
    assert row_launches[:half] == [False] * half and row_launches[half:] == [True] * half
    for plain, tma in zip(*results):
        assert torch.equal(plain, tma)
