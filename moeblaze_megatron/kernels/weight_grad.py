"""Expert weight gradients over a routing plan: ``dW[e] = A[rows(e)]^T @ B[rows(e)]``.

``weight_grad_kernel``: each program reduces one output tile over all rows of its expert in a
fixed order (no atomics, so deterministic); one operand is gathered through the plan, the other,
in expert order, comes through a ragged TMA descriptor on Hopper (the reduction runs down its rows,
so its tiles are MN-major), the gathered one through pointers. For experts at least as wide as the
model, ``gathered_weight_grad`` gathers into expert order and runs ``torch._grouped_mm`` instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.ragged_tma import create_ragged_descriptor, load_ragged

from .configs import capability, prune_weight_grad, ragged_tma_takes, weight_grad_configs
from .calls import KernelCall, gpu_of
from .launch import cdiv, launch_call, next_pow2, spans_past_int32
from .numerics import dot, dot_flags, to_storage

__all__ = ["gathered_weight_grad", "grouped_weight_grads_apply", "weight_grad", "weight_grad_call",
           "weight_grad_kernel"]



@triton.autotune(
    configs=weight_grad_configs(),
    key=["M", "N", "E", "rows_bucket", "GATHER_A", "GATHER_B", "TMA"],
    prune_configs_by={"early_config_prune": prune_weight_grad},
)
@triton.jit
def weight_grad_kernel(
    a_ptr, b_ptr, c_ptr, token_idx_ptr, offsets_ptr,
    rows_bucket, M, N, E,
    stride_am, stride_bm, stride_ce, stride_cm,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, TMA: tl.constexpr, OFFS_64: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[e, m, n] = sum over rows r of expert e of A[srcA(r), m] * B[srcB(r), n].

    A and B have unit column stride; ``src`` is the token id (GATHER_*) or r. Experts with no rows
    get zeros. ``TMA``: the operand that is not gathered is a ragged TMA descriptor (rows past the
    expert's read as zeros by the hardware) instead of a pointer. ``OFFS_64``: A's and B's element
    offsets in 64 bits (some reach 2**31); else in 32, which shortens the gathered rows' address
    arithmetic, redone at every step of the reduction.
    """
    pid_mn = tl.program_id(0)
    e = tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid_mn // n_tiles
    pid_n = pid_mn % n_tiles
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = ms < M
    n_ok = ns < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        r_ok = rows < hi
        src = rows.to(tl.int64) if OFFS_64 else rows
        if GATHER_A or GATHER_B:
            tok = tl.load(token_idx_ptr + rows, mask=r_ok, other=0)
            tok = tok.to(tl.int64) if OFFS_64 else tok
        if TMA and not GATHER_A:
            a = tl.trans(load_ragged(a_ptr, lo, hi - lo, [r0 - lo, pid_m * BLOCK_M]))
        else:
            src_a = tok if GATHER_A else src
            a = tl.load(a_ptr + src_a[None, :] * stride_am + ms[:, None], mask=m_ok[:, None] & r_ok[None, :],
                        other=0.0)
        if TMA and not GATHER_B:
            b = load_ragged(b_ptr, lo, hi - lo, [r0 - lo, pid_n * BLOCK_N])
        else:
            src_b = tok if GATHER_B else src
            b = tl.load(b_ptr + src_b[:, None] * stride_bm + ns[None, :], mask=r_ok[:, None] & n_ok[None, :],
                        other=0.0)
        acc = dot(a, b, acc, PRECISION)
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + ms[:, None].to(tl.int64) * stride_cm + ns[None, :]
    tl.store(c_ptrs, to_storage(acc, c_ptr.dtype.element_ty, ROUND_BF16_BY_HAND), mask=m_ok[:, None] & n_ok[None, :])


def grouped_weight_grads_apply(x, ffn: int) -> bool:
    """Whether the weight gradients run as ``gathered_weight_grad``: bfloat16 on a GPU of compute
    capability 9.0 or newer, experts at least as wide as x (``ffn >= hidden``), rows of both widths
    16 bytes apart (the strides torch._grouped_mm takes; the kernel runs any width)."""
    hidden, device = x.shape[1], gpu_of(x)
    return (ffn >= hidden and device is not None and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and (hidden * x.element_size()) % 16 == 0 and (ffn * x.element_size()) % 16 == 0
            and capability(device.index) >= (9, 0))


def gathered_weight_grad(a, b, plan, *, gather_a, buffer):
    """``weight_grad``'s result for exactly one gathered operand (A when ``gather_a``, else B) as a
    gather of that operand into expert order, into ``buffer`` [T*K, its width], and
    ``torch._grouped_mm`` with the reduction split at the expert offsets; returns [E, M, N].
    Rows of unused slots (past the plan's last offset) are outside every group: not read."""
    if a.is_meta:
        # A layer's launches recorded on meta stand-ins (warmup.layer_launches): no kernel of ours
        # here, only the result's shape; index_select's meta kernel imports sympy, seconds before
        # the layer's kernels go to the compile workers.
        return a.new_empty(plan.num_experts, a.shape[1], b.shape[1])
    # An unused slot's -1 would fail index_select; its row is never read.
    index = plan.expert_token_indices.clamp(min=0)
    if gather_a:
        a = torch.index_select(a, 0, index, out=buffer)
    else:
        b = torch.index_select(b, 0, index, out=buffer)
    return torch._grouped_mm(a.t(), b, offs=plan.expert_token_offsets[1:])


def weight_grad(a, b, out, plan, **kwargs) -> None:
    """Launch ``weight_grad_kernel`` (autotuned); the arguments are ``weight_grad_call``'s."""
    launch_call(weight_grad_call(a, b, out, plan, **kwargs))


def weight_grad_call(a, b, out, plan, *, gather_a, gather_b, tma=None) -> KernelCall:
    """The launch of out[e] = A[rows(e)]^T @ B[rows(e)] for every expert; out is [E, M, N].

    With exactly one gathered operand, the other (in expert order) is read through a ragged TMA
    descriptor where the hardware and the tensor allow it (``tma=None``), always (``True``: an error
    where it cannot) or never (``False``: pointer loads, as with two or no gathered operands)."""
    m_dim, n_dim = a.shape[1], b.shape[1]
    num_experts = plan.num_experts
    mend, precision = dot_flags(a.dtype)
    rows_total = plan.expert_token_indices.shape[0]
    grid = lambda meta: (cdiv(m_dim, meta["BLOCK_M"]) * cdiv(n_dim, meta["BLOCK_N"]), num_experts)
    strides = (a.stride(0), b.stride(0), out.stride(0), out.stride(1))
    offs_64 = spans_past_int32(a, b)
    name, ordered = ("a", a) if gather_b else ("b", b)
    if tma is None:
        tma = gather_a != gather_b and ragged_tma_takes(ordered, rows_total)
    elif tma:
        if gather_a == gather_b:
            raise ValueError("weight_grad(tma=True) needs exactly one gathered operand, got gather_a == gather_b")
        if not ragged_tma_takes(ordered, rows_total):
            raise ValueError(
                f"weight_grad(tma=True): {name} must be on a GPU of compute capability 9.0 or newer, have at "
                f"most 2**30 rows, unit column stride, rows a multiple of 16 bytes apart and a 16-byte aligned "
                f"start; got shape {tuple(ordered.shape)}, strides {ordered.stride()}, "
                f"{ordered.element_size()}-byte elements on {ordered.device}")
    if tma:
        # The box is the first config's tile; the configs' pre-hook resizes it to each one's.
        kw = weight_grad_kernel.configs[0].kwargs
        if gather_b:
            a = create_ragged_descriptor(a, [kw["BLOCK_K"], kw["BLOCK_M"]])
        else:
            b = create_ragged_descriptor(b, [kw["BLOCK_K"], kw["BLOCK_N"]])
    args = (
        a, b, out, plan.expert_token_indices, plan.expert_token_offsets,
        next_pow2(rows_total), m_dim, n_dim, num_experts, *strides,
    )
    constexprs = dict(GATHER_A=gather_a, GATHER_B=gather_b, TMA=tma, OFFS_64=offs_64,
                      ROUND_BF16_BY_HAND=mend, PRECISION=precision)
    return KernelCall(weight_grad_kernel, grid, args, constexprs)
