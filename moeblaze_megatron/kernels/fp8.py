"""Blockwise FP8 expert GEMMs: Megatron's and Transformer Engine's ``blockwise`` recipe
(DeepSeek-V3's): E4M3 (or E5M2 for gradients under ``hybrid``) operands with one float32 scale per
1x128 block of an activation or gradient row, per 128x128 block of a weight, and per 128x1 block
along the tokens of a weight gradient's operands. Scales are powers of two (TE's default): the
largest 2^e with amax * 2^e <= the format's maximum, 1 for an all-zero block.

``quantize_rows_kernel``: x or dY [T, D] -> FP8 bytes and [T, cdiv(D, 128)] inverse scales, once per
layer (the gather GEMMs then read a token's FP8 row for each of its experts).
``fp8_gemm_kernel``: the gather GEMM of ``gather_gemm`` in FP8 for fc1 (the SwiGLU epilogue
writes fc2's input quantized, with its scales), fc2, dH (the activation backward, as in
``gather_gemm``) and dX (its A, the pre-activation gradient, quantized per 128 columns as it is
loaded). B is a quantized weight stored K-major, [E, N, K], with [E, cdiv(N, 128), cdiv(K, 128)]
inverse scales. Each 128-deep block's product is formed in float32 and scaled into the float32
accumulator: promotion every 128 of the reduction, as DeepSeek-V3's recipe.
``fp8_weight_grad_kernel``: dW[e] = A[rows(e)]^T @ B[rows(e)], both operands quantized in the
kernel along the tokens in blocks of 128 rows from the expert's first row (TE quantizes each
expert's split column-wise from high precision: the same blocks), each block promoted.

Bytes travel as uint8 views: the interpreter neither rounds a float32 -> FP8 cast whose rounding
carries into the exponent nor converts subnormals, so there the codes are formed by hand (round
to nearest even, as the GPU's cvt.rn.satfinite does).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .activations import act
from .calls import KernelCall
from .configs import ACTIVATION_IDS, EPI_ACT_FWD, EPI_STORE, fp8_gemm_configs, fp8_weight_grad_configs, prune_fp8_gemm
from .fp8_formats import FP8_BLOCK, FP8_E4M3, FP8_E5M2, FP8_MAX
from .gather_gemm import act_bwd_epilogue, grouped_tile, tile_rows_and_cols
from .launch import cdiv, launch_call, next_pow2
from .numerics import INTERPRETED, dot_flags, to_storage

__all__ = ["FP8_BLOCK", "FP8_E4M3", "FP8_E5M2", "FP8_MAX", "fp8_gemm", "fp8_gemm_call", "fp8_weight_grad",
           "fp8_weight_grad_call", "quantize_rows"]

_BLOCK = tl.constexpr(FP8_BLOCK)
_E4M3_MAX = tl.constexpr(FP8_MAX[FP8_E4M3])
_E5M2_MAX = tl.constexpr(FP8_MAX[FP8_E5M2])


@triton.jit
def block_scale(amax, FMT: tl.constexpr):
    """(scale, inverse scale) for blocks of absolute maximum ``amax``: scale = 2^e, the largest
    with amax * scale <= the format's maximum (e clamped to [-126, 126]), 1 where amax is 0."""
    MAXV: tl.constexpr = _E4M3_MAX if FMT == 0 else _E5M2_MAX
    ratio = tl.div_rn(tl.full(amax.shape, MAXV, tl.float32), tl.where(amax == 0, 1.0, amax))
    e = (ratio.to(tl.int32, bitcast=True) >> 23) & 255
    e = tl.where(amax == 0, 127, tl.minimum(tl.maximum(e, 1), 253))
    return (e << 23).to(tl.float32, bitcast=True), ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def quantize_fp8(v, scale, FMT: tl.constexpr):
    """The FP8 codes (uint8) of v * scale, saturated to the format's maximum, rounded to nearest even."""
    MAXV: tl.constexpr = _E4M3_MAX if FMT == 0 else _E5M2_MAX
    v = tl.minimum(tl.maximum(v * scale, -MAXV), MAXV)
    if INTERPRETED:
        return _encode_by_hand(v, FMT)
    elif FMT == 0:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return v.to(tl.float8e5).to(tl.uint8, bitcast=True)


@triton.jit
def fp8_operand(codes, FMT: tl.constexpr):
    """FP8 codes (uint8) as a dot operand: the FP8 values on the GPU, their float32 values (exact)
    under the interpreter."""
    if INTERPRETED:
        return _decode_by_hand(codes, FMT)
    elif FMT == 0:
        return codes.to(tl.float8e4nv, bitcast=True)
    else:
        return codes.to(tl.float8e5, bitcast=True)


@triton.jit
def _encode_by_hand(v, FMT: tl.constexpr):
    MANT: tl.constexpr = 3 if FMT == 0 else 2
    BIAS: tl.constexpr = 7 if FMT == 0 else 15
    SUB_UNIT: tl.constexpr = 0.001953125 if FMT == 0 else 1.52587890625e-05  # the least subnormal
    a = tl.abs(v)
    # Round to the format's grid: adding 2^23 quanta leaves exactly the rounded multiple.
    qexp = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - MANT, 128 - BIAS - MANT)
    magic = ((qexp + 23) << 23).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    bits = r.to(tl.int32, bitcast=True)
    exp = bits >> 23
    normal = (((exp - 127 + BIAS) << MANT) | ((bits >> (23 - MANT)) & ((1 << MANT) - 1)))
    subnormal = (tl.minimum(r, SUB_UNIT * (1 << MANT)) / SUB_UNIT).to(tl.int32)
    code = tl.where(exp >= 128 - BIAS, normal, subnormal)
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 128
    return (code | sign).to(tl.uint8)


@triton.jit
def _decode_by_hand(codes, FMT: tl.constexpr):
    MANT: tl.constexpr = 3 if FMT == 0 else 2
    BIAS: tl.constexpr = 7 if FMT == 0 else 15
    SUB_UNIT: tl.constexpr = 0.001953125 if FMT == 0 else 1.52587890625e-05
    c = codes.to(tl.int32)
    e = (c >> MANT) & ((1 << (7 - MANT)) - 1)
    m = c & ((1 << MANT) - 1)
    normal = (((e - BIAS + 127) << 23) | (m << (23 - MANT))).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, m.to(tl.float32) * SUB_UNIT, normal)
    return tl.where((c & 128) != 0, -val, val)


@triton.jit
def fp8_dot(a, b):
    """One block's product in float32 (the interpreter's in float64, rounded once)."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    else:
        return tl.dot(a, b)


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, T, D, stride_xm, stride_qm, stride_sm, FMT: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    """q, s = x's rows quantized per 128 columns: codes and inverse scales."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * _BLOCK + tl.arange(0, _BLOCK)
    row_ok = rows < T
    mask = row_ok[:, None] & (cols < D)[None, :]
    r64 = rows.to(tl.int64)
    v = tl.load(x_ptr + r64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale, inv = block_scale(tl.max(tl.abs(v), axis=1), FMT)
    tl.store(q_ptr + r64[:, None] * stride_qm + cols[None, :], quantize_fp8(v, scale[:, None], FMT), mask=mask)
    tl.store(s_ptr + r64 * stride_sm + tl.program_id(1), inv, mask=row_ok)


def _check_layout(**tensors) -> None:
    """The kernels step along a row by one element: each tensor named must have unit column stride."""
    for name, t in tensors.items():
        if t is not None and t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"fp8 kernels: {name} must have unit column stride, got strides {t.stride()}")


def quantize_rows(x, codes, inv_scales, fmt: int) -> None:
    """x [T, D] (unit column stride) into ``codes`` [T, D] uint8 and ``inv_scales`` [T, cdiv(D, 128)]
    float32: 1x128 blocks along the rows."""
    _check_layout(x=x, codes=codes)
    rows, width = x.shape
    block_m = 16
    grid = (cdiv(rows, block_m), cdiv(width, FP8_BLOCK))
    launch_call(KernelCall(quantize_rows_kernel, grid,
                           (x, codes, inv_scales, rows, width, x.stride(0), codes.stride(0), inv_scales.stride(0)),
                           dict(FMT=fmt, BLOCK_M=block_m)))


@triton.autotune(configs=fp8_gemm_configs(), key=["N", "K", "E", "rows_bucket", "EPILOGUE", "ACT", "A_FP8", "SPLIT_K"],
                 prune_configs_by={"early_config_prune": prune_fp8_gemm})
@triton.jit
def fp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, b2_ptr, b2_scale_ptr, c_ptr, c_scale_ptr, pre_ptr, probs_ptr, ds_ptr,
    token_idx_ptr, offsets_ptr,
    rows_total, rows_bucket, N, K, E,
    stride_am, stride_asm, stride_cm, stride_csm, stride_pm, stride_dsm,
    EPILOGUE: tl.constexpr, ACT: tl.constexpr, GATHER_A: tl.constexpr, STORE_PRE: tl.constexpr,
    A_FP8: tl.constexpr, A_FMT: tl.constexpr, B_FMT: tl.constexpr, C_FMT: tl.constexpr, SPLIT_K: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C = A[src] @ B[e]^T per expert row tile (B quantized, [E, N, K] K-major), then the epilogue.

    A: FP8 codes with [rows, cdiv(K_A, 128)] inverse scales (A_FP8), or high precision, quantized
    per 128 columns as loaded. SPLIT_K: A has 2K columns, the first K against b, the rest against b2
    (dX over the gate and up halves); otherwise, for the SwiGLU forward, b and b2 are the gate and
    the up halves, each into its own accumulator.
    EPI_STORE:   c = acc in c's dtype.
    EPI_ACT_FWD: pre = acc (gate | up, stored when STORE_PRE, in pre's dtype); c receives act(pre)
                 as FP8 codes (C_FMT) and c_scale its inverse scales, one per row and 128 columns.
    EPI_ACT_BWD: as ``gather_gemm_kernel``'s: d pre over pre, p * act(pre) into c, <dH, act(pre)>
                 per row into ds, one partial per 128 columns.
    """
    GLU: tl.constexpr = ACT == 0 and EPILOGUE != 0
    TWO_ACC: tl.constexpr = GLU and EPILOGUE == 1
    pid_n, e, row_lo, row0, row_end, exists = grouped_tile(tl.program_id(0), tl.cdiv(rows_total, BLOCK_M) + E,
                                                           tl.cdiv(N, BLOCK_N), offsets_ptr, E, BLOCK_M, GROUP_M,
                                                           E_POW2)
    if exists:
        rows, row_ok, src, cols, col_ok = tile_rows_and_cols(row0, row_end, pid_n, N, token_idx_ptr, GATHER_A,
                                                             BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N if TWO_ACC else 1), dtype=tl.float32)
        acc, acc2 = _fp8_k_loop(acc, acc2, a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, b2_ptr, b2_scale_ptr, e, src,
                                row_ok, cols, col_ok, 0, 0, N, K, stride_am, stride_asm, A_FP8, A_FMT, B_FMT, TWO_ACC)
        if SPLIT_K:
            acc, acc2 = _fp8_k_loop(acc, acc2, a_ptr, a_scale_ptr, b2_ptr, b2_scale_ptr, b2_ptr, b2_scale_ptr, e,
                                    src, row_ok, cols, col_ok, K, tl.cdiv(K, _BLOCK), N, K, stride_am, stride_asm,
                                    A_FP8, A_FMT, B_FMT, False)
        r64 = rows.to(tl.int64)
        mask = row_ok[:, None] & col_ok[None, :]
        if EPILOGUE == 0:
            tl.store(c_ptr + r64[:, None] * stride_cm + cols[None, :],
                     to_storage(acc, c_ptr.dtype.element_ty, ROUND_BF16_BY_HAND), mask=mask)
        elif EPILOGUE == 1:
            pre_dtype = pre_ptr.dtype.element_ty
            pre_ptrs = pre_ptr + r64[:, None] * stride_pm + cols[None, :]
            # Rounded to the storage dtype first: backward recomputes from the stored values.
            gate = to_storage(acc, pre_dtype, ROUND_BF16_BY_HAND)
            if STORE_PRE:
                tl.store(pre_ptrs, gate, mask=mask)
            if TWO_ACC:
                up = to_storage(acc2, pre_dtype, ROUND_BF16_BY_HAND)
                if STORE_PRE:
                    tl.store(pre_ptrs + N, up, mask=mask)
                h = act(gate.to(tl.float32), ACT) * up.to(tl.float32)
            else:
                h = act(gate.to(tl.float32), ACT)
            h = tl.where(mask, h, 0.0)
            scale, inv = block_scale(tl.max(tl.abs(h), axis=1), C_FMT)
            tl.store(c_ptr + r64[:, None] * stride_cm + cols[None, :], quantize_fp8(h, scale[:, None], C_FMT), mask=mask)
            tl.store(c_scale_ptr + r64 * stride_csm + pid_n, inv, mask=row_ok)
        else:
            p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            ds_lo, ds_hi = act_bwd_epilogue(to_storage(acc, c_ptr.dtype.element_ty, ROUND_BF16_BY_HAND), p, r64,
                                             row_ok, pid_n * BLOCK_N, N, c_ptr, pre_ptr, stride_cm, stride_pm, ACT,
                                             GLU, ROUND_BF16_BY_HAND, BLOCK_M, BLOCK_N)
            tl.store(ds_ptr + r64 * stride_dsm + pid_n, ds_lo + ds_hi, mask=row_ok)


@triton.jit
def _fp8_k_loop(acc, acc2, a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, b2_ptr, b2_scale_ptr, e, src, row_ok, cols, col_ok,
                a_col0, a_block0, N, K, stride_am, stride_asm, A_FP8: tl.constexpr, A_FMT: tl.constexpr,
                B_FMT: tl.constexpr, TWO_ACC: tl.constexpr):
    """acc += A[:, a_col0:a_col0 + K] @ B[e]^T over K in blocks of 128, each block's product scaled
    by A's row scales and B's block scale into acc (and with TWO_ACC acc2 += A @ B2[e]^T)."""
    ks = tl.arange(0, _BLOCK)
    k_blocks = tl.cdiv(K, _BLOCK)
    a_ptrs = a_ptr + src[:, None] * stride_am + (a_col0 + ks)[None, :]
    b_offsets = e.to(tl.int64) * N * K + cols[None, :].to(tl.int64) * K + ks[:, None]
    bs_offsets = (e.to(tl.int64) * tl.cdiv(N, _BLOCK) + cols // _BLOCK) * k_blocks
    for kb in range(0, k_blocks):
        k_ok = ks < K - kb * _BLOCK
        a_mask = row_ok[:, None] & k_ok[None, :]
        if A_FP8:
            a = fp8_operand(tl.load(a_ptrs, mask=a_mask, other=0), A_FMT)
            a_inv = tl.load(a_scale_ptr + src * stride_asm + a_block0 + kb, mask=row_ok, other=0.0)
        else:
            v = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)
            scale, a_inv = block_scale(tl.max(tl.abs(v), axis=1), A_FMT)
            a = fp8_operand(quantize_fp8(v, scale[:, None], A_FMT), A_FMT)
        b_mask = k_ok[:, None] & col_ok[None, :]
        b = fp8_operand(tl.load(b_ptr + b_offsets, mask=b_mask, other=0), B_FMT)
        b_inv = tl.load(b_scale_ptr + bs_offsets + kb, mask=col_ok, other=0.0)
        acc += fp8_dot(a, b) * (a_inv[:, None] * b_inv[None, :])
        if TWO_ACC:
            b2 = fp8_operand(tl.load(b2_ptr + b_offsets, mask=b_mask, other=0), B_FMT)
            b2_inv = tl.load(b2_scale_ptr + bs_offsets + kb, mask=col_ok, other=0.0)
            acc2 += fp8_dot(a, b2) * (a_inv[:, None] * b2_inv[None, :])
        a_ptrs += _BLOCK
        b_offsets += _BLOCK
    return acc, acc2


def fp8_gemm(a, a_scales, weight, out, plan, **kwargs) -> None:
    """Launch ``fp8_gemm_kernel`` (autotuned); the arguments are ``fp8_gemm_call``'s."""
    launch_call(fp8_gemm_call(a, a_scales, weight, out, plan, **kwargs))


def fp8_gemm_call(a, a_scales, weight, out, plan, *, epilogue=EPI_STORE, activation="swiglu", gather_a=True,
                  a_fmt=FP8_E4M3, b_fmt=FP8_E4M3, out_scales=None, out_fmt=FP8_E4M3, pre=None, pre_dtype=None, store_pre=True,
                  probs_sorted=None, ds_partial=None, split_k=False) -> KernelCall:
    """The launch of ``fp8_gemm_kernel``. ``a``: uint8 codes with ``a_scales`` (inverse, one per row
    and 128 columns), or a high-precision tensor with ``a_scales=None`` (quantized as loaded).
    ``weight``: a quantized weight (codes [E, N, K] uint8, inverse scales [E, cdiv(N, 128),
    cdiv(K, 128)]) or a pair of them: the SwiGLU forward's gate and up, or with ``split_k`` the two
    halves of the reduction (A's first K columns, then the rest). ``out``: [rows, N] (uint8 codes
    for the SwiGLU forward, with ``out_scales``). ``pre_dtype``: the pre-activations' storage dtype
    where the SwiGLU forward does not store them (``pre`` None)."""
    _check_layout(a=a, out=out, pre=pre)
    pair = isinstance(weight[0], tuple)
    (b, b_s), (b2, b2_s) = weight if pair else (weight, weight)
    if not (b.is_contiguous() and b2.is_contiguous()):
        raise ValueError("fp8_gemm: the quantized weight's codes must be contiguous [E, N, K] (fp8.Fp8Weight's)")
    num_experts, n, k_dim = b.shape
    rows_total = plan.expert_token_indices.shape[0]
    if pre is None and epilogue == EPI_ACT_FWD:
        pre = out.new_empty(0, dtype=pre_dtype)  # its dtype rounds pre; nothing is stored
    mend, _ = dot_flags(out.dtype if pre is None else pre.dtype)

    def grid(meta):
        return ((cdiv(rows_total, meta["BLOCK_M"]) + num_experts) * cdiv(n, meta["BLOCK_N"]),)

    args = (
        a, a_scales if a_scales is not None else out, b, b_s, b2, b2_s, out,
        out_scales if out_scales is not None else out, pre if pre is not None else out,
        probs_sorted if probs_sorted is not None else out, ds_partial if ds_partial is not None else out,
        plan.expert_token_indices, plan.expert_token_offsets,
        rows_total, next_pow2(rows_total), n, k_dim, num_experts,
        a.stride(0), a_scales.stride(0) if a_scales is not None else 0, out.stride(0),
        out_scales.stride(0) if out_scales is not None else 0, pre.stride(0) if pre is not None and pre.dim() == 2 else 0,
        ds_partial.stride(0) if ds_partial is not None else 0,
    )
    constexprs = dict(EPILOGUE=epilogue, ACT=ACTIVATION_IDS[activation], GATHER_A=gather_a, STORE_PRE=store_pre,
                      A_FP8=a_scales is not None, A_FMT=a_fmt, B_FMT=b_fmt, C_FMT=out_fmt, SPLIT_K=split_k,
                      ROUND_BF16_BY_HAND=mend, E_POW2=max(next_pow2(num_experts + 1), 16))
    return KernelCall(fp8_gemm_kernel, grid, args, constexprs)


@triton.autotune(configs=fp8_weight_grad_configs(), key=["M", "N", "E", "rows_bucket", "GATHER_A", "GATHER_B"])
@triton.jit
def fp8_weight_grad_kernel(
    a_ptr, b_ptr, c_ptr, token_idx_ptr, offsets_ptr, rows_bucket, M, N, E, stride_am, stride_bm, stride_ce, stride_cm,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, A_FMT: tl.constexpr, B_FMT: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """c[e, m, n] = sum over rows r of expert e of A[srcA(r), m] * B[srcB(r), n], each operand
    quantized per column over blocks of 128 rows from the expert's first (128x1 scaling)."""
    pid_mn = tl.program_id(0)
    e = tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    ms = (pid_mn // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = (pid_mn % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = ms < M
    n_ok = ns < N
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(lo, hi, _BLOCK):
        rows = r0 + tl.arange(0, _BLOCK)
        r_ok = rows < hi
        tok = tl.load(token_idx_ptr + rows, mask=r_ok, other=0).to(tl.int64)
        src_a = tok if GATHER_A else rows.to(tl.int64)
        src_b = tok if GATHER_B else rows.to(tl.int64)
        a = tl.load(a_ptr + src_a[None, :] * stride_am + ms[:, None], mask=m_ok[:, None] & r_ok[None, :],
                    other=0.0).to(tl.float32)
        b = tl.load(b_ptr + src_b[:, None] * stride_bm + ns[None, :], mask=r_ok[:, None] & n_ok[None, :],
                    other=0.0).to(tl.float32)
        a_scale, a_inv = block_scale(tl.max(tl.abs(a), axis=1), A_FMT)
        b_scale, b_inv = block_scale(tl.max(tl.abs(b), axis=0), B_FMT)
        qa = fp8_operand(quantize_fp8(a, a_scale[:, None], A_FMT), A_FMT)
        qb = fp8_operand(quantize_fp8(b, b_scale[None, :], B_FMT), B_FMT)
        acc += fp8_dot(qa, qb) * (a_inv[:, None] * b_inv[None, :])
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + ms[:, None].to(tl.int64) * stride_cm + ns[None, :]
    tl.store(c_ptrs, to_storage(acc, c_ptr.dtype.element_ty, ROUND_BF16_BY_HAND), mask=m_ok[:, None] & n_ok[None, :])


def fp8_weight_grad(a, b, out, plan, **kwargs) -> None:
    """Launch ``fp8_weight_grad_kernel`` (autotuned); the arguments are ``fp8_weight_grad_call``'s."""
    launch_call(fp8_weight_grad_call(a, b, out, plan, **kwargs))


def fp8_weight_grad_call(a, b, out, plan, *, gather_a, gather_b, a_fmt=FP8_E4M3, b_fmt=FP8_E4M3) -> KernelCall:
    """out[e] = A[rows(e)]^T @ B[rows(e)] for every expert (out [E, M, N]), A and B high precision
    with unit column stride, quantized in the kernel (128x1 blocks along the tokens)."""
    _check_layout(a=a, b=b)
    m_dim, n_dim = a.shape[1], b.shape[1]
    num_experts = plan.num_experts
    mend, _ = dot_flags(out.dtype)
    grid = lambda meta: (cdiv(m_dim, meta["BLOCK_M"]) * cdiv(n_dim, meta["BLOCK_N"]), num_experts)
    args = (a, b, out, plan.expert_token_indices, plan.expert_token_offsets,
            next_pow2(plan.expert_token_indices.shape[0]), m_dim, n_dim, num_experts,
            a.stride(0), b.stride(0), out.stride(0), out.stride(1))
    constexprs = dict(GATHER_A=gather_a, GATHER_B=gather_b, A_FMT=a_fmt, B_FMT=b_fmt, ROUND_BF16_BY_HAND=mend)
    return KernelCall(fp8_weight_grad_kernel, grid, args, constexprs)


# The helpers read constexpr globals (INTERPRETED, the formats' maxima): their cache keys computed
# at import, as numerics' are, so every process files a kernel under one key.
for _helper in (block_scale, quantize_fp8, fp8_operand, fp8_dot):
    getattr(_helper, "cache_key", None)
del _helper
