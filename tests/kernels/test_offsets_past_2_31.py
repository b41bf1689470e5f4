"""Element offsets past 2**31 from a tensor's start, under the interpreter and at a small cost.

Every kernel addresses its operands with 64-bit offsets (the weight gradients only where an operand
reaches 2**31 elements, 32-bit ones below), so rows and experts that lie past 2**31 elements must
give the bits the same launch gives on compact copies. The far operands are views
with huge strides over storage that is allocated but never touched between the rows used (the
operating system commits none of it), so a few dozen rows reach past 2**31 elements: an offset
computed in 32 bits would wrap onto another address. (tests/gpu/test_kernels_gpu.py runs whole
layers of that size on the GPU; the routing plan's dense map past 2**31 cells is
tests/core/test_routing.py's GPU case: its kernels write every cell.)"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from moe_testing import make_topk_ids
from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels.combine import combine
from moeblaze_megatron.kernels.gather_gemm import EPI_ACT_BWD, EPI_ACT_FWD, gather_gemm_ds_tiles
from moeblaze_megatron.kernels.tuning import gather_gemm_with, weight_grad_with
from moeblaze_megatron.kernels.weight_grad import weight_grad_call

CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, num_warps=4)
WGRAD_CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=4)
# Strides of the far views (16-byte aligned in every dtype): rows in expert order from 16 on,
# tokens from 8 on and the third expert start past 2**31 elements.
FAR_ROWS = 2**27 + 64
FAR_TOKENS = 2**28 + 64
FAR_EXPERTS = 2**30 + 64
T, E, K, D, H = 12, 3, 2, 24, 40  # T*K = 24 rows in expert order; d and h not multiples of the tile


def far(shape, dtype, stride, fill=float("nan")):
    """A tensor of ``shape`` whose leading index steps ``stride`` elements (the rest contiguous),
    filled with ``fill`` where it is viewed."""
    size = (shape[0] - 1) * stride + math.prod(shape[1:])
    try:
        base = torch.empty(size, dtype=dtype)
    except RuntimeError as exc:  # an operating system that commits memory as it is allocated
        pytest.skip(f"cannot reserve {size * dtype.itemsize / 2**30:.0f} GiB of address space for a far view: {exc}")
    return base.as_strided(shape, (stride, *torch.empty(shape[1:]).stride())).fill_(fill)


def far_copy(t, stride):
    return far(tuple(t.shape), t.dtype, stride).copy_(t)


def _problem(seed, activation, dtype):
    gen = torch.Generator().manual_seed(seed)
    ids = make_topk_ids("random", T, E, K, gen)
    ids[-1] = torch.tensor([E - 1, 0])  # the far expert has rows, among them the last (far) ones
    plan = build_routing_plan(ids, E)
    width = 2 * H if activation == "swiglu" else H
    x, dy = torch.randn(T, D, generator=gen).to(dtype), torch.randn(T, D, generator=gen).to(dtype)
    fc1 = torch.randn(E, width, D, generator=gen).to(dtype)
    fc2 = (torch.randn(E, D, H, generator=gen) / 4).to(dtype)
    probs = torch.rand(T * K, generator=gen).to(dtype)
    return plan, width, x, dy, fc1, fc2, probs


def _gather_gemms(plan, width, x, dy, fc1, fc2, probs, activation, tma, alloc):
    """fc1 with the activation, fc2, dH with the activation backward, dX; outputs from ``alloc``."""
    rows = T * K
    pre, hid, out2, hs, dx = (alloc((rows, w), x.dtype) for w in (width, H, D, H, D))
    ds = alloc((rows, gather_gemm_ds_tiles(H)), torch.float32)
    kw = dict(plan=plan, tma_weight=tma)
    gather_gemm_with(CONFIG, x, fc1, hid, transpose_weight=True, epilogue=EPI_ACT_FWD, activation=activation, pre=pre,
                  n=H, **kw)
    saved_pre = pre.clone()
    gather_gemm_with(CONFIG, hid, fc2, out2, transpose_weight=True, gather_a=False, n=D, tma_rows=tma, **kw)
    gather_gemm_with(CONFIG, dy, fc2, hs, transpose_weight=False, epilogue=EPI_ACT_BWD, activation=activation,
                  pre=pre, probs_sorted=probs, ds_partial=ds, n=H, **kw)
    gather_gemm_with(CONFIG, pre, fc1, dx, transpose_weight=False, gather_a=False, n=D, tma_rows=tma, **kw)
    return saved_pre, hid, out2, hs, pre, ds, dx


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("activation,dtype", [("swiglu", torch.bfloat16), ("gelu", torch.float32)])
def test_gather_gemms_reach_rows_and_experts_past_2_31(tma, activation, dtype):
    plan, width, x, dy, fc1, fc2, probs = _problem(hash((tma, activation)) % 2**31, activation, dtype)
    compact = _gather_gemms(plan, width, x, dy, fc1, fc2, probs, activation, tma,
                         lambda shape, dt: torch.full(shape, float("nan"), dtype=dt))
    assert (FAR_ROWS * (T * K - 1) > 2**31 and FAR_TOKENS * (T - 1) > 2**31
            and FAR_EXPERTS * (E - 1) > 2**31 and int(plan.expert_token_offsets[-2]) < T * K)
    far_ones = _gather_gemms(plan, width, far_copy(x, FAR_TOKENS), far_copy(dy, FAR_TOKENS),
                          far_copy(fc1, FAR_EXPERTS), far_copy(fc2, FAR_EXPERTS), probs, activation, tma,
                          lambda shape, dt: far(shape, dt, FAR_ROWS))
    for want, got in zip(compact, far_ones):
        assert not want.isnan().any()
        assert torch.equal(got, want)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
def test_weight_gradients_reach_rows_and_experts_past_2_31(tma):
    plan, width, x, dy, fc1, fc2, _ = _problem(7, "swiglu", torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    rows_h = torch.randn(T * K, H, generator=gen).to(torch.bfloat16)   # p * h, in expert order
    rows_pre = torch.randn(T * K, width, generator=gen).to(torch.bfloat16)  # d pre, in expert order

    def grads(dy, rows_h, rows_pre, x, alloc):
        dw2, dw1 = alloc(tuple(fc2.shape)), alloc(tuple(fc1.shape))
        # Compact operands take the 32-bit offsets, far ones the 64-bit ones: both give the same bits.
        far_operands = dy.stride(0) > D
        assert weight_grad_call(dy, rows_h, dw2, plan, gather_a=True, gather_b=False,
                                tma=tma).constexprs["OFFS_64"] == far_operands
        weight_grad_with(WGRAD_CONFIG, dy, rows_h, dw2, plan, gather_a=True, gather_b=False, tma=tma)
        weight_grad_with(WGRAD_CONFIG, rows_pre, x, dw1, plan, gather_a=False, gather_b=True, tma=tma)
        return dw2, dw1

    compact = grads(dy, rows_h, rows_pre, x, lambda shape: torch.full(shape, float("nan"), dtype=torch.bfloat16))
    far_ones = grads(far_copy(dy, FAR_TOKENS), far_copy(rows_h, FAR_ROWS), far_copy(rows_pre, FAR_ROWS),
                     far_copy(x, FAR_TOKENS), lambda shape: far(shape, torch.bfloat16, FAR_EXPERTS))
    for want, got in zip(compact, far_ones):
        assert not want.isnan().any()
        assert torch.equal(got, want)


def test_combine_reaches_rows_past_2_31():
    plan = _problem(9, "swiglu", torch.bfloat16)[0]
    gen = torch.Generator().manual_seed(10)
    rows = torch.randn(T * K, D, generator=gen).to(torch.bfloat16)
    probs = torch.rand(T, K, generator=gen).to(torch.bfloat16)
    ds = torch.randn(T * K, 3, generator=gen)

    def both(rows, ds):
        sorted_probs = torch.full((T * K,), float("nan"), dtype=torch.bfloat16)
        y = combine(rows, plan.token_index_map, probs, torch.bfloat16, probs_sorted=sorted_probs)
        grad_probs = torch.full((T, K), float("nan"))
        dx = combine(rows, plan.token_index_map, None, torch.bfloat16, ds_partial=ds, grad_probs=grad_probs)
        return y, sorted_probs, dx, grad_probs

    for want, got in zip(both(rows, ds), both(far_copy(rows, FAR_ROWS), far_copy(ds, FAR_ROWS))):
        assert not want.isnan().any()
        assert torch.equal(got, want)


def test_fp8_kernels_reach_rows_past_2_31():
    """The FP8 kernels (row quantization, the gather GEMM's four uses, the weight gradients) on
    tokens and rows in expert order past 2**31 elements: the compact launches' bits. The quantized
    weights are the kernels' own contiguous copies (expert offsets in 64 bits)."""
    from moeblaze_megatron.fp8 import expert_weights
    from moeblaze_megatron.kernels import fp8 as k8

    plan, width, x, dy, fc1, fc2, probs = _problem(11, "swiglu", torch.bfloat16)
    weights = expert_weights(fc1, fc2, 0)
    rows, blocks_d, blocks_h = T * K, math.ceil(D / 128), math.ceil(H / 128)

    def run(x, dy, alloc):
        xq, xs, dyq, dys = alloc((T, D), torch.uint8), alloc((T, blocks_d)), alloc((T, D), torch.uint8), \
            alloc((T, blocks_d))
        k8.quantize_rows(x, xq, xs, 0)
        k8.quantize_rows(dy, dyq, dys, 1)
        pre, hq, hs = alloc((rows, width), torch.bfloat16), alloc((rows, H), torch.uint8), alloc((rows, blocks_h))
        k8.fp8_gemm(xq, xs, tuple(w.pair for w in weights.fc1), hq, plan, epilogue=EPI_ACT_FWD, pre=pre,
                    out_scales=hs)
        saved_pre = pre.clone()
        out2 = alloc((rows, D), torch.bfloat16)
        k8.fp8_gemm(hq, hs, weights.fc2.pair, out2, plan, gather_a=False)
        h_scaled, ds = alloc((rows, H), torch.bfloat16), alloc((rows, blocks_h))
        k8.fp8_gemm(dyq, dys, weights.fc2_t.pair, h_scaled, plan, epilogue=EPI_ACT_BWD, a_fmt=1, pre=pre,
                    probs_sorted=probs, ds_partial=ds)
        dx = alloc((rows, D), torch.bfloat16)
        k8.fp8_gemm(pre, None, tuple(w.pair for w in weights.fc1_t), dx, plan, gather_a=False, a_fmt=1, split_k=True)
        dw2 = torch.full(tuple(fc2.shape), float("nan"))
        k8.fp8_weight_grad(dy, h_scaled, dw2, plan, gather_a=True, gather_b=False, a_fmt=1)
        return xq, xs, dyq, dys, saved_pre, hq, hs, out2, h_scaled, ds, pre, dx, dw2

    compact = run(x, dy, lambda shape, dt=torch.float32: torch.full(shape, 0x55 if dt == torch.uint8 else float("nan"),
                                                                     dtype=dt))
    far_ones = run(far_copy(x, FAR_TOKENS), far_copy(dy, FAR_TOKENS),
                   lambda shape, dt=torch.float32: far(shape, dt, FAR_TOKENS if shape[0] == T else FAR_ROWS,
                                                       fill=0x55 if dt == torch.uint8 else float("nan")))
    used = int(plan.expert_token_offsets[-1])
    for want, got in zip(compact, far_ones):
        if want.shape[0] == rows:
            want, got = want[:used], got[:used]
        assert not (want.isnan().any() if want.dtype.is_floating_point else False)
        assert torch.equal(got, want)
