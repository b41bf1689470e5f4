"""The row-GEMM kernel's TMA descriptors: the weight (``tma_weight``, the default where one can
take it), and A and the output of fc2 and dX, rows in expert order (``tma_rows``, ragged
descriptors that stop at each tile's expert; the default from TMA_ROWS_MIN_FLOPS on). Each gives
the pointer form's bits under the interpreter, at widths that are not multiples of the tile (the
descriptor's zero fill and clipping must stand in for the masks), on plans with empty experts,
unused slots (their rows stay unwritten), every token on the same experts, K = E and top-1."""

from __future__ import annotations

import pytest
import torch
import triton
from triton.tools.ragged_tma import create_ragged_descriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_testing import PERSISTENT_CASES, make_topk_ids, gather_gemm_layer
from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels import configs as cf
from moeblaze_megatron.kernels import gather_gemm as rg
from moeblaze_megatron.kernels.settings import SETTINGS
from moeblaze_megatron.kernels.tuning import gather_gemm_with

CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, num_warps=4)


# A config unlike the kernel list's first (whose tiles the launcher's descriptors start with) and
# without the list's box-sizing pre-hook: the pinned launch must still size the boxes to its tiles.
OTHER_TILES = triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}, num_warps=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("config", [CONFIG, OTHER_TILES], ids=["tile16", "tile32_no_hook"])
def test_every_epilogue_matches_pointer_loads(dtype, activation, config):
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
        kw = dict(plan=plan, tma_weight=tma)
        nan = lambda *shape: torch.full(shape, float("nan"), dtype=dtype)  # noqa: E731
        pre, hid, out2, hs, dx = nan(T * K, width), nan(T * K, h), nan(T * K, d), nan(T * K, h), nan(T * K, d)
        gather_gemm_with(config, x, fc1, hid, transpose_weight=True, epilogue=rg.EPI_ACT_FWD, activation=activation,
                      pre=pre, n=h, **kw)
        gather_gemm_with(config, hid, fc2, out2, transpose_weight=True, gather_a=False, n=d, **kw)
        dpre = pre.clone()
        ds = torch.zeros(T * K, rg.gather_gemm_ds_tiles(h))
        gather_gemm_with(config, dy, fc2, hs, transpose_weight=False, epilogue=rg.EPI_ACT_BWD, activation=activation,
                      pre=dpre, probs_sorted=probs, ds_partial=ds, n=h, **kw)
        gather_gemm_with(config, dpre, fc1, dx, transpose_weight=False, gather_a=False, n=d, **kw)
        results.append((pre, hid, out2, dpre, hs, ds, dx))
    for plain, tma in zip(*results):
        assert torch.isfinite(tma).all()
        assert torch.equal(plain, tma)


# The persistent test's awkward plans with tokens (no rows: nothing for a descriptor to take), and top-1.
ROW_CASES = {name: case for name, case in PERSISTENT_CASES.items() if case[1] > 0} | {"top1": ("random", 45, 5, 1)}


@pytest.mark.parametrize("case", list(ROW_CASES))
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("activation,dtype", [("swiglu", torch.bfloat16), ("gelu", torch.float32)])
def test_rows_through_descriptors_give_the_pointer_bits(case, persistent, activation, dtype):
    kind, tokens, E, K = ROW_CASES[case]
    plan = build_routing_plan(make_topk_ids(kind, tokens, E, K, torch.Generator().manual_seed(5)), E)
    config = triton.Config({**CONFIG.kwargs, "PERSISTENT": persistent}, num_warps=4)
    seed = hash((case, activation)) % 2**31
    # d = 40, h = 24: neither a multiple of the 16-wide tile.
    pointers, descriptors = (gather_gemm_layer(plan, tokens, 40, 24, activation, dtype, seed, config, tma_rows=tma)
                             for tma in (False, True))
    used = int(plan.expert_token_offsets[-1])
    for want, got in zip(pointers, descriptors):
        assert torch.equal(got[:used], want[:used])
        assert not got[:used].isnan().any()
        assert got[used:].isnan().all()  # unused slots' rows are not written


def test_rows_through_descriptors_leave_an_outputs_columns_past_n_alone():
    # The pointer form masks the columns past n of a wider output; the descriptor must stop there too.
    gen = torch.Generator().manual_seed(21)
    T, E, k, n = 30, 3, 24, 40  # n not a multiple of the 16-wide tile
    plan = build_routing_plan(make_topk_ids("unused", T, E, 1, gen), E)
    a, w = torch.randn(T, k, generator=gen), torch.randn(E, n, k, generator=gen)
    outs = []
    for tma in (False, True):
        out = torch.full((T, n + 24), float("nan"))
        gather_gemm_with(CONFIG, a, w, out, plan, transpose_weight=True, gather_a=False, n=n, tma_rows=tma)
        outs.append(out)
    used = int(plan.expert_token_offsets[-1])
    assert torch.equal(outs[1][:used, :n], outs[0][:used, :n]) and not outs[1][:used, :n].isnan().any()
    assert outs[1][:, n:].isnan().all() and outs[1][used:].isnan().all()


@pytest.mark.parametrize("why", ["activation_forward", "gathered_a", "no_rows", "misaligned_out", "strided_a"])
def test_tma_rows_refuses_what_a_descriptor_cannot_take(why):
    T, E, d, n = 0 if why == "no_rows" else 6, 2, 16, 16
    plan = build_routing_plan(torch.arange(T)[:, None] % E, E)
    a = torch.randn(T, 2 * d)[:, ::2] if why == "strided_a" else torch.randn(T, d)
    out = torch.empty(T * n + 1)[1:].view(T, n) if why == "misaligned_out" else torch.empty(T, n)
    kw = dict(plan=plan, transpose_weight=True, n=n, tma_rows=True)
    with pytest.raises(ValueError, match=r"tma_rows=True.*plain GEMM"):
        if why == "activation_forward":
            gather_gemm_with(CONFIG, a, torch.randn(E, n, d), out, epilogue=rg.EPI_ACT_FWD, activation="gelu",
                          gather_a=False, pre=torch.empty(T, n), **kw)
        else:
            gather_gemm_with(CONFIG, a, torch.randn(E, n, d), out, gather_a=why == "gathered_a", **kw)


@pytest.mark.parametrize("case", ["large", "small", "misaligned_out", "gathered_a", "no_rows"])
def test_default_takes_descriptors_for_large_plain_gemms_in_expert_order(case, monkeypatch):
    T, E, k, n = 0 if case == "no_rows" else 3, 2, 16, 16
    # "small": one FLOP short of the threshold; the others at it.
    monkeypatch.setattr(rg, "TMA_ROWS_MIN_FLOPS", 2 * T * n * k + (case == "small"))
    plan = build_routing_plan(torch.arange(T)[:, None] % E, E)
    out = torch.empty(T * n + 1)[1:].view(T, n) if case == "misaligned_out" else torch.empty(T, n)
    taken = []
    monkeypatch.setattr(rg, "launch_call", lambda call: taken.append(
        (call.constexprs["TMA_ROWS"], isinstance(call.args[0], TensorDescriptor),
         isinstance(call.args[3], TensorDescriptor))))
    rg.gather_gemm(torch.randn(T, k), torch.randn(E, n, k), out, plan, transpose_weight=True, n=n,
                gather_a=case == "gathered_a")
    assert taken == [(case == "large",) * 3]


def test_tma_weight_refuses_what_a_descriptor_cannot_take():
    plan = build_routing_plan(torch.tensor([[0], [1]]), 2)
    x = torch.randn(2, 16)
    strided = torch.randn(2, 16, 32)[:, :, ::2]
    with pytest.raises(ValueError, match="weight must be on a GPU .* unit last stride"):
        gather_gemm_with(CONFIG, x, strided, torch.empty(2, 16), plan, transpose_weight=True, n=16, tma_weight=True)


@pytest.mark.parametrize("weight", ["contiguous", "strided", "misaligned"])
def test_default_reads_the_weight_through_tma_where_it_can(weight, monkeypatch):
    plan = build_routing_plan(torch.tensor([[0], [1], [1]]), 2)
    x = torch.randn(3, 16)
    w = {"contiguous": torch.randn(2, 16, 16), "strided": torch.randn(2, 16, 32)[:, :, ::2],
         "misaligned": torch.randn(2 * 16 * 16 + 1)[1:].view(2, 16, 16)}[weight]
    taken = []
    monkeypatch.setattr(rg, "launch_call", lambda call: taken.append(
        (call.constexprs["TMA_B"], isinstance(call.args[1], TensorDescriptor))))
    rg.gather_gemm(x, w, torch.empty(3, 16), plan, transpose_weight=True, n=16)
    assert taken == [(weight == "contiguous",) * 2]


def test_every_autotuned_row_config_sizes_the_weight_box(monkeypatch):
    monkeypatch.setattr(SETTINGS, "interpret", False)
    monkeypatch.setattr(SETTINGS, "autotune", True)
    configs = cf.gather_gemm_configs()
    assert len(configs) > 1
    w = torch.randn(3, 32, 64)
    rows = torch.randn(40, 32)
    for config in configs:
        assert config.pre_hook is cf.set_gather_gemm_boxes
        bm, bk, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_K"], config.kwargs["BLOCK_N"]
        for desc, trans, box in ((TensorDescriptor.from_tensor(w.view(3, 2, 16, 64), [1, 2, 8, 8]), True,
                                  [1, 2, bn, bk]),
                                 (TensorDescriptor.from_tensor(w, [1, 8, 8]), True, [1, bn, bk]),
                                 (TensorDescriptor.from_tensor(w, [1, 8, 8]), False, [1, bk, bn])):
            config.pre_hook({"a_ptr": rows, "b_ptr": desc, "c_ptr": rows, "pre_ptr": rows, "TRANS_B": trans,
                             **config.kwargs})
            assert list(desc.block_shape) == box
        # A and C in expert order, through ragged descriptors.
        a, c = (create_ragged_descriptor(rows, [8, 8]) for _ in range(2))
        config.pre_hook({"a_ptr": a, "b_ptr": w, "c_ptr": c, "pre_ptr": rows, "TRANS_B": True, **config.kwargs})
        assert [list(a.block_shape), list(c.block_shape)] == [[1, 1, bm, bk], [1, 1, bm, bn]]


@pytest.mark.parametrize("dtype,recompute", [(torch.float32, "activation"), (torch.bfloat16, "activation"),
                                             (torch.bfloat16, "fc1")])
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_layer_with_descriptors_is_bitwise_the_pointer_form(monkeypatch, dtype, recompute, activation):
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
    launch = rg.launch_call
    monkeypatch.setattr(rg, "launch_call", lambda call: launched.append(
        tuple(call.constexprs.get(name) for name in ("TMA_B", "TMA_ROWS", "EPILOGUE", "GATHER_A")))
        or launch(call))
    monkeypatch.setattr(rg, "TMA_ROWS_MIN_FLOPS", 0)  # every plain GEMM in expert order, however small
    takes = cf.tma_takes
    for descriptors in (False, True):
        # The weight's check in gather_gemm and the ragged descriptors' (rows, weight gradients) in configs.
        for module in (rg, cf):
            monkeypatch.setattr(module, "tma_takes", takes if descriptors else lambda t: False)
        leaves = [t.clone().requires_grad_() for t in (x, probs, fc1, fc2)]
        y = moe_mlp(leaves[0], ids, leaves[1], leaves[2], leaves[3], activation, backend="triton",
                    recompute=recompute)
        y.backward(gy)
        results.append([y.detach()] + [t.grad for t in leaves])
    row_launches = [t for t in launched if t[0] is not None]
    half = len(row_launches) // 2
    assert all(not weight and not rows for weight, rows, _, _ in row_launches[:half])
    # The second time every weight through a descriptor, and fc2's and dX's rows.
    assert [(weight, rows) for weight, rows, _, _ in row_launches[half:]] == [
        (True, epilogue == rg.EPI_STORE and not gather) for _, _, epilogue, gather in row_launches[half:]]
    assert sum(rows for _, rows, _, _ in row_launches[half:]) == 2
    for plain, tma in zip(*results):
        assert torch.equal(plain, tma)
