"""The FP8 kernels one by one under the interpreter: the row quantization against PyTorch's
(bitwise, both formats, subnormal and saturating magnitudes, zero rows, widths off the 128
blocks), the FP8 gather GEMM with quantized A (gathered or in expert order) and with A quantized
as loaded (dX over two halves), and the weight gradient quantizing both operands along the tokens,
each against float64 over the dequantized operands; outputs poisoned first; experts with no rows,
unused slots, more than 128 rows per expert."""

from __future__ import annotations

import pytest
import torch

from moe_testing import TRITON_INTERPRETED, rel_error
from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.fp8 import (
    FP8_TORCH_DTYPES,
    dequantize_columns,
    dequantize_rows,
    expert_weights,
    quantize_rows,
)
from moeblaze_megatron.kernels import fp8 as kernels
from moeblaze_megatron.kernels.fp8_formats import FP8_E4M3, FP8_E5M2

pytestmark = pytest.mark.skipif(not TRITON_INTERPRETED, reason="the kernels run on CPU under TRITON_INTERPRET=1")
FORMATS = [FP8_E4M3, FP8_E5M2]
# fp32 accumulation of exact FP8 products against float64: rounding only.
FP32_TOL = 1e-6


def _ids(T, E, K, gen, kind="random"):
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    if kind == "empty_expert":
        ids = torch.rand(T, E - 1, generator=gen).topk(K, dim=1).indices
        ids = ids + (ids >= 1).long()
    ids[torch.rand(T, K, generator=gen) < 0.2] = -1
    return ids.int()


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_quantization_is_pytorchs(fmt):
    gen = torch.Generator().manual_seed(fmt)
    x = torch.randn(37, 300, generator=gen) * torch.exp2(torch.randint(-30, 30, (37, 1), generator=gen).float())
    x[4] = 0
    x[5, :128] = 0
    x[6, 7] = 3e38  # the block's scale clamps at 2^-126: its other values go subnormal or to zero
    x = x.bfloat16()
    codes = torch.full(x.shape, 0x7F, dtype=torch.uint8)
    scales = torch.full((37, 3), float("nan"))
    kernels.quantize_rows(x, codes, scales, fmt)
    want_codes, want_scales = quantize_rows(x, fmt)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)


def _quantized_a(rows, width, fmt, gen):
    a = torch.randn(rows, width, generator=gen) * torch.exp2(torch.randint(-4, 4, (rows, 1), generator=gen).float())
    codes, scales = quantize_rows(a, fmt)
    return codes, scales, dequantize_rows(codes, scales, fmt)


@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_gemm_with_quantized_rows(gather, fmt):
    gen = torch.Generator().manual_seed(10 + gather + 2 * fmt)
    T, E, K, k_dim, n = 90, 4, 2, 200, 136
    plan = build_routing_plan(_ids(T, E, K, gen, "empty_expert"), E)
    rows = T if gather else T * K
    a_codes, a_scales, a64 = _quantized_a(rows, k_dim, fmt, gen)
    weights = expert_weights(torch.randn(E, n, k_dim, generator=gen), torch.randn(E, k_dim, n, generator=gen), FP8_E4M3)
    b = weights.fc1[0]
    out = torch.full((T * K, n), float("nan"))
    kernels.fp8_gemm(a_codes, a_scales, b.pair, out, plan, gather_a=gather, a_fmt=fmt, b_fmt=FP8_E4M3)
    b64 = b.dequantized(FP8_E4M3)
    offsets = plan.expert_token_offsets.tolist()
    for e in range(E):
        s, t = offsets[e], offsets[e + 1]
        src = plan.expert_token_indices[s:t].long() if gather else torch.arange(s, t)
        want = a64[src] @ b64[e].t()
        assert rel_error(out[s:t], want) <= FP32_TOL, e
    assert torch.isnan(out[offsets[-1]:]).all()  # rows of unused slots are not written


def test_dx_quantizes_each_half_of_d_pre_as_it_loads_it():
    gen = torch.Generator().manual_seed(3)
    T, E, K, d, h = 70, 3, 2, 144, 200
    plan = build_routing_plan(_ids(T, E, K, gen), E)
    grad_pre = (torch.randn(T * K, 2 * h, generator=gen) * 0.1).bfloat16()
    weights = expert_weights(torch.randn(E, 2 * h, d, generator=gen), torch.randn(E, d, h, generator=gen), FP8_E4M3)
    out = torch.full((T * K, d), float("nan"))
    kernels.fp8_gemm(grad_pre, None, tuple(w.pair for w in weights.fc1_t), out, plan, gather_a=False,
                     a_fmt=FP8_E5M2, b_fmt=FP8_E4M3, split_k=True)
    a64 = torch.cat([dequantize_rows(*quantize_rows(half, FP8_E5M2), FP8_E5M2) for half in grad_pre.chunk(2, dim=1)],
                    dim=1)
    w64 = torch.cat([w.dequantized(FP8_E4M3) for w in weights.fc1], dim=1)
    used = plan.expert_token_offsets[-1].item()
    for e in range(E):
        s, t = plan.expert_token_offsets[e].item(), plan.expert_token_offsets[e + 1].item()
        assert rel_error(out[s:t], a64[s:t] @ w64[e]) <= FP32_TOL, e
    assert torch.isnan(out[used:]).all()


@pytest.mark.parametrize("gather_a", [True, False])
def test_weight_grad_quantizes_along_the_tokens(gather_a):
    gen = torch.Generator().manual_seed(7 + gather_a)
    T, E, K, m, n = 300, 3, 2, 40, 72  # one expert has more than 128 rows: two scaling blocks
    ids = _ids(T, E, K, gen)
    plan = build_routing_plan(ids, E)
    rows_a = T if gather_a else T * K
    a = torch.randn(rows_a, m, generator=gen).bfloat16()
    b = torch.randn(T * K if gather_a else T, n, generator=gen).bfloat16()
    out = torch.full((E, m, n), float("nan"))
    kernels.fp8_weight_grad(a, b, out, plan, gather_a=gather_a, gather_b=not gather_a, a_fmt=FP8_E5M2,
                            b_fmt=FP8_E4M3)
    offsets = plan.expert_token_offsets.tolist()
    assert max(t - s for s, t in zip(offsets[:-1], offsets[1:])) > 128
    for e in range(E):
        s, t = offsets[e], offsets[e + 1]
        tokens = plan.expert_token_indices[s:t].long()
        rows = torch.arange(s, t)
        a_e, b_e = (a[tokens], b[rows]) if gather_a else (a[rows], b[tokens])
        want = dequantize_columns(a_e, FP8_E5M2).t() @ dequantize_columns(b_e, FP8_E4M3)
        assert rel_error(out[e], want) <= FP32_TOL, e


def test_the_interpreters_codes_are_the_hardwares_rounding():
    """Every float32 rounding case of both formats (ties to even, carries into the exponent,
    subnormals, saturation): the interpreter's hand-made codes are torch's RNE cast's."""
    import triton
    import triton.language as tl

    @triton.jit
    def encode(x_ptr, q_ptr, N: tl.constexpr, FMT: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(q_ptr + i, kernels.quantize_fp8(tl.load(x_ptr + i), 1.0, FMT))

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-26, 20, (4096,), generator=gen).float())
    grid = torch.arange(256, dtype=torch.uint8)
    for fmt in FORMATS:
        exact = grid.view(FP8_TORCH_DTYPES[fmt]).float()
        exact = exact[torch.isfinite(exact)]
        ties = (exact[:-1] + exact[1:]) / 2  # halfway between neighbours (sorted within each sign)
        values = torch.cat([x, exact, ties, torch.tensor([0.0, -0.0, 1e30, -1e30])])
        values = torch.cat([values, values.new_zeros(8192 - values.numel())])  # arange's power of two
        codes = torch.empty(values.shape, dtype=torch.uint8)
        encode[(1,)](values, codes, N=values.numel(), FMT=fmt)
        bound = 448.0 if fmt == FP8_E4M3 else 57344.0
        want = values.clamp(-bound, bound).to(FP8_TORCH_DTYPES[fmt]).view(torch.uint8)
        assert torch.equal(codes, want), fmt


def test_layouts_the_kernels_cannot_step_are_refused():
    x = torch.randn(64, 256).bfloat16()
    with pytest.raises(ValueError, match=r"x must have unit column stride"):
        kernels.quantize_rows(x.t(), torch.empty(256, 64, dtype=torch.uint8), torch.empty(256, 1), FP8_E4M3)
    plan = build_routing_plan(torch.zeros(64, 1, dtype=torch.int32), 2)
    weights = expert_weights(torch.randn(2, 128, 256), torch.randn(2, 256, 128), FP8_E4M3)
    codes, scales = quantize_rows(x, FP8_E4M3)
    with pytest.raises(ValueError, match="codes must be contiguous"):
        kernels.fp8_gemm(codes, scales, (weights.fc1[0].codes.transpose(1, 2), weights.fc1[0].inv_scales),
                         torch.empty(64, 256), plan)
