"""The gather GEMM over a routing plan, gathering its rows on the fly: fc1 (with the activation),
fc2, dH (with the activation backward) and dX.

``gather_gemm_kernel``: for every expert e and every row r of its slice of the plan,
``C[r] = A[src(r)] @ B[e]`` where ``src(r)`` is the token id (``GATHER_A``: rows of x or dY read
in place through ``expert_token_indices``) or r itself (A already in expert order). Its epilogue
is one of: store C; the activation forward (SwiGLU: the gate columns and the up columns form one
weight tile twice as wide, so x is read once and silu(gate) * up is formed in registers from the
two halves of one accumulator); the activation backward (silu recomputed from the saved
pre-activations, the router-probability gradient as a row dot product, the probability scaling).
The weight comes through a TMA descriptor on Hopper; so do A and C of the large plain GEMMs over
rows in expert order (fc2, dX), through ragged ones. fc1 may come as two tensors, gate and up
(torchtitan's w1 and w3; ``SPLIT_B``), read where they are: no stacked copy.

Row tiles never straddle two experts: row-tile i is mapped to its expert inside the kernel from
``expert_token_offsets``, so no host synchronization is needed and the grid is an upper bound
(``cdiv(T*K, BLOCK_M) + E`` row tiles), or, for a persistent config, one program per
multiprocessor looping over the tiles that exist. All row and expert offsets are 64-bit.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.tools.ragged_tma import create_ragged_descriptor, load_ragged, to_ragged_indices

from .activations import act, act_bwd
from .configs import (
    ACT_GELU,
    ACT_SILU,
    ACT_SWIGLU,
    ACTIVATION_IDS,
    DS_COLS,
    EPI_ACT_BWD,
    EPI_ACT_FWD,
    EPI_STORE,
    TMA_ROWS_MIN_FLOPS,
    WS_EPILOGUES,
    capability,
    prune_gather_gemm,
    ragged_tma_takes,
    gather_gemm_configs,
    sm_count,
    tma_descriptor,
    tma_takes,
)
from .settings import SETTINGS
from .calls import KernelCall, gpu_of
from .launch import cdiv, launch_call, next_pow2
from .numerics import dot, dot_flags, to_storage

__all__ = [
    "ACTIVATION_IDS", "ACT_GELU", "ACT_SILU", "ACT_SWIGLU", "EPI_ACT_BWD", "EPI_ACT_FWD", "EPI_STORE",
    "expert_order_gemm", "gather_gemm", "gather_gemm_call", "gather_gemm_ds_tiles", "gather_gemm_kernel",
]


@triton.jit
def _row_tiles(offsets_ptr, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """The number of row tiles over all experts' rows."""
    e_idx = tl.arange(0, E_POW2)
    lo = tl.load(offsets_ptr + e_idx, mask=e_idx < E, other=0)
    hi = tl.load(offsets_ptr + e_idx + 1, mask=e_idx < E, other=0)
    return tl.sum((hi - lo + BLOCK_M - 1) // BLOCK_M, axis=0)


@triton.jit
def _expert_of_row_tile(pid_m, offsets_ptr, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Row tile ``pid_m`` -> (expert, the expert's first row, the tile's first row, end of the
    expert's rows, tile exists)."""
    e_idx = tl.arange(0, E_POW2)
    lo = tl.load(offsets_ptr + e_idx, mask=e_idx < E, other=0)
    hi = tl.load(offsets_ptr + e_idx + 1, mask=e_idx < E, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, axis=0)
    e = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
    this = e_idx == e
    first_tile = tl.sum(tl.where(this, ends - tiles, 0), axis=0)
    row_lo = tl.sum(tl.where(this, lo, 0), axis=0)
    row_end = tl.sum(tl.where(this, hi, 0), axis=0)
    return e, row_lo, row_lo + (pid_m - first_tile) * BLOCK_M, row_end, pid_m < tl.sum(tiles, axis=0)


@triton.jit
def grouped_tile(pid, m_tiles, n_tiles, offsets_ptr, E, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
                 E_POW2: tl.constexpr):
    """Output tile ``pid`` of ``m_tiles`` x ``n_tiles``, row tiles grouped by GROUP_M: (column tile,
    expert, the expert's first row, the tile's first row, end of the expert's rows, tile exists)."""
    in_group = GROUP_M * n_tiles
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    e, row_lo, row0, row_end, exists = _expert_of_row_tile(pid_m, offsets_ptr, E, BLOCK_M, E_POW2)
    return pid_n, e, row_lo, row0, row_end, exists


@triton.jit
def tile_rows_and_cols(row0, row_end, pid_n, N, token_idx_ptr, GATHER_A: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """A tile's rows (in expert order), which are the expert's, the rows of A they read (the
    tokens with GATHER_A, else themselves, 64-bit), its columns and which are inside N."""
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    if GATHER_A:
        src = tl.load(token_idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, row_ok, src, cols, cols < N


# (A constexpr: the kernel reads it as a global.)
_DS_COLS = tl.constexpr(DS_COLS)


@triton.autotune(
    configs=gather_gemm_configs(),
    key=["N", "K", "E", "rows_bucket", "EPILOGUE", "ACT", "GATHER_A", "TMA_B", "TMA_ROWS"],
    prune_configs_by={"early_config_prune": prune_gather_gemm},
    # No restore_value: the one epilogue that rewrites an input (the activation backward, pre)
    # prunes to one config, which launch.py runs without timing it.
)
@triton.jit
def gather_gemm_kernel(
    a_ptr, b_ptr, b2_ptr, c_ptr, pre_ptr, probs_ptr, ds_ptr,
    token_idx_ptr, offsets_ptr,
    rows_total, rows_bucket, N, K, E,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn,
    stride_cm, stride_pm, stride_dsm,
    EPILOGUE: tl.constexpr, ACT: tl.constexpr, GATHER_A: tl.constexpr, STORE_PRE: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr, PRECISION: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA_B: tl.constexpr = False, TRANS_B: tl.constexpr = False, TMA_ROWS: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False, SPLIT_B: tl.constexpr = False,
):
    """C = A[src] @ B[e] per expert row tile, then the epilogue.

    EPI_STORE:   c[r, n] = acc.
    EPI_ACT_FWD: pre = acc (gate | up for SwiGLU, stored when STORE_PRE), c = act(pre).
    EPI_ACT_BWD: acc is dH (unscaled); pre holds the saved pre-activations and receives
                 d pre in place; c receives p * act(pre) (for dW2); ds receives
                 <dH, act(pre)> summed over each DS_COLS columns of the tile (gather_gemm_ds_tiles).
    For SwiGLU, N is the width h of one half; the up half sits N columns after the gate half.
    TMA_B: B is a TMA descriptor over the weight, [E, N, K] (TRANS_B), [E, 2, N, K] (the SwiGLU
    forward's gate and up halves) or [E, K, N]; the hardware zero-fills past N and K.
    TMA_ROWS (EPI_STORE, A in expert order): A and C are ragged TMA descriptors over the rows; the
    hardware reads zeros and drops writes past the tile's expert, as the masks do for pointers.
    SPLIT_B: the weight comes as two halves of the same shape and strides, b (gate) and b2 (up),
    as torchtitan keeps them: the SwiGLU forward multiplies by each into its own accumulator; a
    plain GEMM (dX) reduces over A's first K/2 columns against b, then the rest against b2.
    """
    n_tiles = tl.cdiv(N, BLOCK_N)
    # (One call per branch: a one-trip loop around the per-tile launch's call compiles to other
    # code, with up to 50 more registers.)
    if PERSISTENT:
        m_tiles = _row_tiles(offsets_ptr, E, BLOCK_M, E_POW2)
        for pid in tl.range(tl.program_id(0), m_tiles * n_tiles, tl.num_programs(0), flatten=True):
            _gather_gemm_tile(pid, m_tiles, n_tiles, a_ptr, b_ptr, b2_ptr, c_ptr, pre_ptr, probs_ptr, ds_ptr,
                           token_idx_ptr, offsets_ptr, N, K, E, stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                           stride_cm, stride_pm, stride_dsm, EPILOGUE, ACT, GATHER_A, STORE_PRE, ROUND_BF16_BY_HAND,
                           PRECISION, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA_B, TRANS_B, TMA_ROWS,
                           PERSISTENT, SPLIT_B)
    else:
        _gather_gemm_tile(tl.program_id(0), tl.cdiv(rows_total, BLOCK_M) + E, n_tiles, a_ptr, b_ptr, b2_ptr, c_ptr,
                       pre_ptr, probs_ptr, ds_ptr, token_idx_ptr, offsets_ptr, N, K, E, stride_am, stride_ak,
                       stride_be, stride_bk, stride_bn, stride_cm, stride_pm, stride_dsm, EPILOGUE, ACT, GATHER_A,
                       STORE_PRE, ROUND_BF16_BY_HAND, PRECISION, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA_B, TRANS_B,
                       TMA_ROWS, PERSISTENT, SPLIT_B)


@triton.jit
def _gather_gemm_tile(
    pid, m_tiles, n_tiles, a_ptr, b_ptr, b2_ptr, c_ptr, pre_ptr, probs_ptr, ds_ptr, token_idx_ptr, offsets_ptr,
    N, K, E, stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_pm, stride_dsm,
    EPILOGUE: tl.constexpr, ACT: tl.constexpr, GATHER_A: tl.constexpr, STORE_PRE: tl.constexpr,
    ROUND_BF16_BY_HAND: tl.constexpr, PRECISION: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA_B: tl.constexpr, TRANS_B: tl.constexpr, TMA_ROWS: tl.constexpr, PERSISTENT: tl.constexpr,
    SPLIT_B: tl.constexpr,
):
    """Output tile ``pid`` of ``m_tiles`` x ``n_tiles`` (row tiles grouped by GROUP_M)."""
    GLU: tl.constexpr = ACT == 0 and EPILOGUE != 0
    pid_n, e, row_lo, row0, row_end, exists = grouped_tile(pid, m_tiles, n_tiles, offsets_ptr, E, BLOCK_M, GROUP_M,
                                                           E_POW2)
    # A persistent kernel visits existing tiles only; an if around the main loop would keep the
    # compiler from pipelining across tiles.
    if PERSISTENT or exists:
        rows, row_ok, src, cols, col_ok = tile_rows_and_cols(row0, row_end, pid_n, N, token_idx_ptr, GATHER_A,
                                                             BLOCK_M, BLOCK_N)
        # The SwiGLU forward multiplies by the gate columns and the up columns N further on as one
        # [BLOCK_K, 2 * BLOCK_N] tile: one matrix-instruction chain twice as wide, x read once.
        # Halves in two tensors (SPLIT_B) take one chain each, into two accumulators.
        TWO_ACC: tl.constexpr = SPLIT_B and GLU and EPILOGUE == 1
        B_COLS: tl.constexpr = 2 * BLOCK_N if GLU and EPILOGUE == 1 and not SPLIT_B else BLOCK_N
        if GLU and EPILOGUE == 1 and not SPLIT_B:
            j = tl.arange(0, B_COLS)
            b_cols = pid_n * BLOCK_N + j + (j // BLOCK_N) * (N - BLOCK_N)
            b_col_ok = pid_n * BLOCK_N + j % BLOCK_N < N
        else:
            b_cols = cols
            b_col_ok = col_ok
        acc = tl.zeros((BLOCK_M, B_COLS), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N if TWO_ACC else 1), dtype=tl.float32)
        if SPLIT_B and not TWO_ACC:
            # A's first K/2 columns against b, the rest against b2.
            acc, acc2 = _k_loop(acc, acc2, a_ptr, b_ptr, b_ptr, e, src, row_lo, row0, row_end, row_ok, b_cols,
                                b_col_ok, pid_n, 0, K // 2, stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                                PRECISION, BLOCK_N, BLOCK_K, B_COLS, TMA_B, TRANS_B, TMA_ROWS, False)
            acc, acc2 = _k_loop(acc, acc2, a_ptr, b2_ptr, b2_ptr, e, src, row_lo, row0, row_end, row_ok, b_cols,
                                b_col_ok, pid_n, K // 2, K // 2, stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                                PRECISION, BLOCK_N, BLOCK_K, B_COLS, TMA_B, TRANS_B, TMA_ROWS, False)
        else:
            acc, acc2 = _k_loop(acc, acc2, a_ptr, b_ptr, b2_ptr, e, src, row_lo, row0, row_end, row_ok, b_cols,
                                b_col_ok, pid_n, 0, K, stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                                PRECISION, BLOCK_N, BLOCK_K, B_COLS, TMA_B, TRANS_B, TMA_ROWS, TWO_ACC)

        out_dtype = c_ptr.dtype if TMA_ROWS else c_ptr.dtype.element_ty
        r64 = rows.to(tl.int64)
        if not TMA_ROWS:
            mask = row_ok[:, None] & col_ok[None, :]
            c_ptrs = c_ptr + r64[:, None] * stride_cm + cols[None, :]
            pre_ptrs = pre_ptr + r64[:, None] * stride_pm + cols[None, :]
        if TMA_ROWS:
            # ragged_tma.store_ragged's own reshape fails under the interpreter (a tuple shape).
            c0, c1, c2 = to_ragged_indices(row_lo, row_end - row_lo, row0 - row_lo)
            c_ptr.store([c0, c1, c2, pid_n * BLOCK_N],
                        tl.reshape(to_storage(acc, out_dtype, ROUND_BF16_BY_HAND), [1, 1, BLOCK_M, BLOCK_N]))
        elif EPILOGUE == 0:
            tl.store(c_ptrs, to_storage(acc, out_dtype, ROUND_BF16_BY_HAND), mask=mask)
        elif EPILOGUE == 1:
            # Round to the storage dtype first: backward recomputes from the stored values.
            if GLU:
                if TWO_ACC:
                    acc_gate, acc_up = acc, acc2
                else:
                    acc_gate, acc_up = _column_halves(acc, BLOCK_M, 2 * BLOCK_N)
                gate = to_storage(acc_gate, out_dtype, ROUND_BF16_BY_HAND)
                up = to_storage(acc_up, out_dtype, ROUND_BF16_BY_HAND)
                if STORE_PRE:
                    tl.store(pre_ptrs, gate, mask=mask)
                    tl.store(pre_ptrs + N, up, mask=mask)
                h = act(gate.to(tl.float32), ACT) * up.to(tl.float32)
            else:
                gate = to_storage(acc, out_dtype, ROUND_BF16_BY_HAND)
                if STORE_PRE:
                    tl.store(pre_ptrs, gate, mask=mask)
                h = act(gate.to(tl.float32), ACT)
            tl.store(c_ptrs, to_storage(h, out_dtype, ROUND_BF16_BY_HAND), mask=mask)
        else:
            # dH is rounded to the storage dtype first (as a stored dH would be), which halves the
            # registers it holds; the epilogue then runs on four column chunks one after the other
            # (a whole 256-wide tile's saved pre-activations at once would spill), each chunk's
            # loads issued before the previous chunk's stores.
            p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            ds_lo, ds_hi = act_bwd_epilogue(to_storage(acc, out_dtype, ROUND_BF16_BY_HAND), p, r64, row_ok, pid_n * BLOCK_N,
                                             N, c_ptr, pre_ptr, stride_cm, stride_pm, ACT, GLU, ROUND_BF16_BY_HAND, BLOCK_M,
                                             BLOCK_N)
            # One partial per _DS_COLS columns, as the warp-specialized dH writes them; a narrower
            # tile (the interpreter's) one per tile (gather_gemm_ds_tiles).
            ds_row = ds_ptr + r64 * stride_dsm
            if BLOCK_N == 2 * _DS_COLS:
                tl.store(ds_row + 2 * pid_n, ds_lo, mask=row_ok)
                tl.store(ds_row + 2 * pid_n + 1, ds_hi, mask=row_ok & (pid_n * BLOCK_N + _DS_COLS < N))
            else:
                tl.static_assert(BLOCK_N <= _DS_COLS)
                tl.store(ds_row + pid_n, ds_lo + ds_hi, mask=row_ok)


@triton.jit
def _k_loop(acc, acc2, a_ptr, b_ptr, b2_ptr, e, src, row_lo, row0, row_end, row_ok, b_cols, b_col_ok, pid_n,
            a_col0, k_len, stride_am, stride_ak, stride_be, stride_bk, stride_bn,
            PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_COLS: tl.constexpr,
            TMA_B: tl.constexpr, TRANS_B: tl.constexpr, TMA_ROWS: tl.constexpr, TWO_ACC: tl.constexpr):
    """The main loop over k_len columns of A from a_col0 (rows of B from 0): acc += A @ B, and with
    TWO_ACC acc2 += A @ B2 (the same A tile)."""
    ks = tl.arange(0, BLOCK_K)
    if not TMA_ROWS:
        a_ptrs = a_ptr + src[:, None] * stride_am + (a_col0 + ks)[None, :] * stride_ak
    if not TMA_B:
        b_offsets = e.to(tl.int64) * stride_be + ks[:, None] * stride_bk + b_cols[None, :].to(tl.int64) * stride_bn
        b_ptrs = b_ptr + b_offsets
        if TWO_ACC:
            b2_ptrs = b2_ptr + b_offsets
    for k0 in range(0, k_len, BLOCK_K):
        k_ok = ks < k_len - k0
        if TMA_ROWS:
            a = load_ragged(a_ptr, row_lo, row_end - row_lo, [row0 - row_lo, a_col0 + k0])
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if TMA_B and B_COLS != BLOCK_N:
            b = tl.trans(tl.reshape(b_ptr.load([e, 0, pid_n * BLOCK_N, k0]), (B_COLS, BLOCK_K)))
        elif TMA_B and TRANS_B:
            b = tl.trans(tl.reshape(b_ptr.load([e, pid_n * BLOCK_N, k0]), (BLOCK_N, BLOCK_K)))
        elif TMA_B:
            b = tl.reshape(b_ptr.load([e, k0, pid_n * BLOCK_N]), (BLOCK_K, BLOCK_N))
        else:
            b = tl.load(b_ptrs, mask=k_ok[:, None] & b_col_ok[None, :], other=0.0)
        acc = dot(a, b, acc, PRECISION)
        if TWO_ACC:
            if TMA_B:
                b2 = tl.trans(tl.reshape(b2_ptr.load([e, pid_n * BLOCK_N, k0]), (BLOCK_N, BLOCK_K)))
            else:
                b2 = tl.load(b2_ptrs, mask=k_ok[:, None] & b_col_ok[None, :], other=0.0)
            acc2 = dot(a, b2, acc2, PRECISION)
        if not TMA_ROWS:
            a_ptrs += BLOCK_K * stride_ak
        if not TMA_B:
            b_ptrs += BLOCK_K * stride_bk
            if TWO_ACC:
                b2_ptrs += BLOCK_K * stride_bk
    return acc, acc2


@triton.jit
def _column_halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, COLS // 2)), (0, 2, 1)))


@triton.jit
def _load_pre(r64, row_ok, col0, N, pre_ptr, stride_pm, COLS: tl.constexpr, GLU: tl.constexpr):
    """The saved pre-activations of COLS columns from col0: (gate, up) for SwiGLU, else (pre, pre)."""
    cols = col0 + tl.arange(0, COLS)
    mask = row_ok[:, None] & (cols < N)[None, :]
    pre_ptrs = pre_ptr + r64[:, None] * stride_pm + cols[None, :]
    g = tl.load(pre_ptrs, mask=mask, other=0.0)
    if GLU:
        up = tl.load(pre_ptrs + N, mask=mask, other=0.0)
    else:
        up = g
    return g, up


@triton.jit
def _act_bwd_chunk(acc, g, up, p, r64, row_ok, col0, N, c_ptr, pre_ptr, stride_cm, stride_pm,
                   ACT: tl.constexpr, GLU: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr):
    """The activation backward on the columns from col0 of dH = acc (unscaled), given their saved
    pre-activations: d pre over pre (for SwiGLU d gate, and d up N columns further), p * act(pre)
    into c; returns the rows' partial <dH, h>."""
    out_dtype = c_ptr.dtype.element_ty
    acc = acc.to(tl.float32)
    g = g.to(tl.float32)
    cols = col0 + tl.arange(0, acc.shape[1])
    mask = row_ok[:, None] & (cols < N)[None, :]
    pre_ptrs = pre_ptr + r64[:, None] * stride_pm + cols[None, :]
    h, d_pre, d_up = act_bwd(acc * p[:, None], g, up.to(tl.float32), ACT, GLU)
    if GLU:
        tl.store(pre_ptrs + N, to_storage(d_up, out_dtype, ROUND_BF16_BY_HAND), mask=mask)
    tl.store(pre_ptrs, to_storage(d_pre, out_dtype, ROUND_BF16_BY_HAND), mask=mask)
    tl.store(c_ptr + r64[:, None] * stride_cm + cols[None, :], to_storage(h * p[:, None], out_dtype, ROUND_BF16_BY_HAND),
             mask=mask)
    return tl.sum(tl.where(mask, acc * h, 0.0), axis=1)


@triton.jit
def act_bwd_epilogue(dh, p, r64, row_ok, col0, N, c_ptr, pre_ptr, stride_cm, stride_pm,
                      ACT: tl.constexpr, GLU: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr,
                      ROWS: tl.constexpr, COLS: tl.constexpr):
    """The activation backward on COLS columns of dH from col0, in four chunks. Returns the rows'
    partial <dH, h> over each half of the columns.

    Each chunk's loads are issued before the previous chunk's stores: d pre is written over pre,
    so the compiler may not move a load above a store, and a chunk's loads would otherwise wait
    out a whole memory round trip after the previous chunk's stores."""
    Q: tl.constexpr = COLS // 4
    lo, hi = _column_halves(dh, ROWS, COLS)
    c0, c1 = _column_halves(lo, ROWS, COLS // 2)
    c2, c3 = _column_halves(hi, ROWS, COLS // 2)
    g0, u0 = _load_pre(r64, row_ok, col0, N, pre_ptr, stride_pm, Q, GLU)
    g1, u1 = _load_pre(r64, row_ok, col0 + Q, N, pre_ptr, stride_pm, Q, GLU)
    ds_lo = _act_bwd_chunk(c0, g0, u0, p, r64, row_ok, col0, N, c_ptr, pre_ptr, stride_cm, stride_pm, ACT, GLU,
                           ROUND_BF16_BY_HAND)
    g2, u2 = _load_pre(r64, row_ok, col0 + 2 * Q, N, pre_ptr, stride_pm, Q, GLU)
    ds_lo += _act_bwd_chunk(c1, g1, u1, p, r64, row_ok, col0 + Q, N, c_ptr, pre_ptr, stride_cm, stride_pm, ACT, GLU,
                         ROUND_BF16_BY_HAND)
    g3, u3 = _load_pre(r64, row_ok, col0 + 3 * Q, N, pre_ptr, stride_pm, Q, GLU)
    ds_hi = _act_bwd_chunk(c2, g2, u2, p, r64, row_ok, col0 + 2 * Q, N, c_ptr, pre_ptr, stride_cm, stride_pm, ACT,
                           GLU, ROUND_BF16_BY_HAND)
    ds_hi += _act_bwd_chunk(c3, g3, u3, p, r64, row_ok, col0 + 3 * Q, N, c_ptr, pre_ptr, stride_cm, stride_pm, ACT,
                            GLU, ROUND_BF16_BY_HAND)
    return ds_lo, ds_hi


def gather_gemm(a, weight, out, plan, **kwargs) -> None:
    """Launch ``gather_gemm_kernel`` (autotuned); the arguments are ``gather_gemm_call``'s."""
    launch_call(gather_gemm_call(a, weight, out, plan, **kwargs))


def gather_gemm_call(a, weight, out, plan, *, transpose_weight, epilogue=EPI_STORE, activation="swiglu",
                  gather_a=True, pre=None, store_pre=True, probs_sorted=None, ds_partial=None, n=None,
                  tma_weight=None, tma_rows=None, warp_specialize=None) -> KernelCall:
    """The launch of ``gather_gemm_kernel`` over ``n`` output columns; ``weight`` is [E, out, in]
    (``transpose_weight``: multiply by its transpose, as nn.Linear does) or [E, in, out], or a
    (gate, up) pair of halves of one shape and strides (``split_halves`` says which launches take
    it) standing for the two stacked along the halved dimension.
    ``ds_partial`` (activation backward): float32, ``gather_gemm_ds_tiles(n)`` wide; every used row's
    partials are written (the rows of unused slots, past the plan's last offset, are not).
    ``tma_weight``: read the weight through a TMA descriptor where the hardware and the tensor
    allow it (None, the default: Hopper or newer, an aligned weight), always (True: an error where
    it cannot) or never (False: pointer loads). Either gives the same bits.
    ``tma_rows``: the same choice for A and the output of a plain GEMM over rows in expert order
    (``EPI_STORE``, not ``gather_a``: fc2, dX) through ragged TMA descriptors; None takes them
    from ``TMA_ROWS_MIN_FLOPS`` on.
    ``warp_specialize``: run the fused epilogues (the activation forward and backward) in
    ``gather_gemm_ws_kernel`` (Gluon, Hopper: the epilogue in warps of its own) where it takes the
    launch (None, the default: for the epilogues ``SETTINGS.warp_specialize`` names, from
    ``WS_MIN_COLUMNS[epilogue]`` columns on), always (True: an error where it cannot) or never (False)."""
    if epilogue in (EPI_ACT_FWD, EPI_ACT_BWD) and warp_specialize is not False:
        call = _warp_specialized(a, weight, out, plan, epilogue, activation, gather_a, transpose_weight, pre,
                                 store_pre, probs_sorted, ds_partial, n, required=warp_specialize is True)
        if call is not None:
            return call
    rows_total = plan.expert_token_indices.shape[0]
    num_experts = plan.num_experts
    k_dim = a.shape[1]
    split = isinstance(weight, tuple)
    if split:
        weight, up = split_halves(weight, epilogue, activation, transpose_weight)
        # The SwiGLU forward: n columns of each half over k_dim; a plain GEMM: k_dim = both halves' rows.
        expected = (n, k_dim) if transpose_weight else (k_dim // 2, n)
        if tuple(weight.shape[1:]) != expected or (not transpose_weight and k_dim % 2):
            raise ValueError(f"gather_gemm: each half of the weight pair must be [E, {expected[0]}, {expected[1]}] "
                             f"for A of width {k_dim} and n={n}, got {tuple(weight.shape)}")
    b, b2 = weight, (up if split else weight)
    if tma_weight is None:
        tma_weight = tma_takes(weight) and (not split or tma_takes(up))
    elif tma_weight and not (tma_takes(weight) and (not split or tma_takes(up))):
        raise ValueError(f"gather_gemm(tma_weight=True): weight must be on a GPU of compute capability 9.0 or newer, "
                         f"have unit last stride and 16-byte aligned strides and start; got strides "
                         f"{weight.stride()} on {weight.device}")
    if tma_weight:
        # The box is the first config's weight tile; the configs' pre-hook resizes it to each one's.
        kw = gather_gemm_kernel.configs[0].kwargs
        if epilogue == EPI_ACT_FWD and activation == "swiglu" and not split:
            b = tma_descriptor(weight.view(num_experts, 2, n, k_dim), (1, 2, kw["BLOCK_N"], kw["BLOCK_K"]))
        else:
            box = (1, kw["BLOCK_N"], kw["BLOCK_K"]) if transpose_weight else (1, kw["BLOCK_K"], kw["BLOCK_N"])
            b = tma_descriptor(weight, box)
            b2 = tma_descriptor(up, box) if split else b
    if transpose_weight:
        stride_bk, stride_bn = weight.stride(2), weight.stride(1)
    else:
        stride_bk, stride_bn = weight.stride(1), weight.stride(2)
    # The descriptor's bounds stand in for the column mask: only the n columns the kernel writes.
    c_rows = out[:, :n] if epilogue == EPI_STORE and not gather_a else None
    rows_take = (c_rows is not None and rows_total > 0
                 and ragged_tma_takes(a, rows_total) and ragged_tma_takes(c_rows, rows_total))
    if tma_rows is None:
        tma_rows = rows_take and 2 * rows_total * n * k_dim >= TMA_ROWS_MIN_FLOPS
    elif tma_rows and not rows_take:
        raise ValueError(
            f"gather_gemm(tma_rows=True): needs a plain GEMM (epilogue EPI_STORE, got {epilogue}) over A in expert "
            f"order (gather_a=False, got {gather_a}), and A and out on a GPU of compute capability 9.0 or newer "
            f"with 1 to 2**30 rows (got {rows_total}), unit last stride, 16-byte aligned strides and start; got "
            f"strides {a.stride()} and {out.stride()} on {out.device}")
    a_arg, c_arg = a, out
    if tma_rows:
        # The boxes are the first config's tiles; the configs' pre-hook resizes them to each one's.
        kw = gather_gemm_kernel.configs[0].kwargs
        a_arg = create_ragged_descriptor(a, [kw["BLOCK_M"], kw["BLOCK_K"]])
        c_arg = create_ragged_descriptor(c_rows, [kw["BLOCK_M"], kw["BLOCK_N"]])
    mend, precision = dot_flags(a.dtype)
    device = a.device

    def grid(meta):
        tiles = (cdiv(rows_total, meta["BLOCK_M"]) + num_experts) * cdiv(n, meta["BLOCK_N"])
        return (min(tiles, sm_count(device)),) if meta.get("PERSISTENT") else (tiles,)

    args = (
        a_arg, b, b2, c_arg, pre if pre is not None else out,
        probs_sorted if probs_sorted is not None else out,
        ds_partial if ds_partial is not None else out,
        plan.expert_token_indices, plan.expert_token_offsets,
        rows_total, next_pow2(rows_total), n, k_dim, num_experts,
        a.stride(0), a.stride(1), weight.stride(0), stride_bk, stride_bn,
        out.stride(0), pre.stride(0) if pre is not None else 0,
        ds_partial.stride(0) if ds_partial is not None else 0,
    )
    constexprs = dict(
        EPILOGUE=epilogue, ACT=ACTIVATION_IDS[activation], GATHER_A=gather_a, STORE_PRE=store_pre,
        ROUND_BF16_BY_HAND=mend, PRECISION=precision, E_POW2=max(next_pow2(num_experts + 1), 16),
        TMA_B=tma_weight, TRANS_B=tma_weight and transpose_weight, TMA_ROWS=tma_rows, SPLIT_B=split,
    )
    return KernelCall(gather_gemm_kernel, grid, args, constexprs)


# The knob's launches go to the warp-specialized kernel from this many output columns (the layer's
# width) on, per fused epilogue: fc1's from 1024 (below, its faster fc1 did not shorten the
# layer's step: benchmarks/notes/kernels.md,
# "WS_MIN_COLUMNS: the warp-specialized fc1 from 1024 columns"); dH's wherever the knob names it
# (it is slower than the Triton kernel at every width measured: same file,
# "The warp-specialized dH stays off by default").
WS_MIN_COLUMNS = {EPI_ACT_FWD: 1024, EPI_ACT_BWD: 0}


def _warp_specialized(a, weight, out, plan, epilogue, activation, gather_a, transpose_weight, pre, store_pre,
                      probs_sorted, ds_partial, n, *, required):
    """``gather_gemm_ws_kernel``'s call for a fused-epilogue launch it takes (where the knob names the
    epilogue and ``n`` is at least its WS_MIN_COLUMNS, or ``required``), else None; ``required``: a
    ValueError where it cannot take it."""
    device = gpu_of(a)
    chosen = WS_EPILOGUES[epilogue] in SETTINGS.warp_specialize and n >= WS_MIN_COLUMNS[epilogue]
    if device is None or SETTINGS.interpret or not (required or chosen):
        if required:
            raise ValueError("gather_gemm(warp_specialize=True): the warp-specialized fused epilogues run on a GPU, "
                             f"not under the interpreter (A on {a.device})")
        return None
    # Gluon is imported only where a GPU would run its kernel.
    from .gather_gemm_ws import WS_REQUIREMENTS, ws_call, ws_takes

    cap = capability(device.index)
    if not (gather_a and ws_takes(a, weight, out, pre, epilogue, transpose_weight, cap)):
        if required:
            raise ValueError(f"gather_gemm(warp_specialize=True): {WS_REQUIREMENTS} (compute capability {cap}, "
                             f"gather_a={gather_a}, {a.dtype} A of shape {tuple(a.shape)})")
        return None
    return ws_call(a, weight, out, plan, epilogue=epilogue, act_id=ACTIVATION_IDS[activation],
                   glu=activation == "swiglu", pre=pre, store_pre=store_pre, probs_sorted=probs_sorted,
                   ds_partial=ds_partial, n=n, sm_count=sm_count(device))


def split_halves(halves, epilogue, activation, transpose_weight):
    """The (gate, up) halves of a weight given in two tensors, checked: the launches that take
    them are the SwiGLU forward (``transpose_weight``, [E, F, D] each: F output columns of gate
    and of up) and a plain GEMM reducing over both halves (not ``transpose_weight``, [E, F, D]
    each: A's 2F columns, gate's first)."""
    takes = (epilogue == EPI_ACT_FWD and activation == "swiglu" and transpose_weight) or (
        epilogue == EPI_STORE and not transpose_weight)
    if not takes:
        raise ValueError(f"gather_gemm: a (gate, up) weight pair serves the SwiGLU forward (transpose_weight=True) and "
                         f"a plain GEMM over both halves (transpose_weight=False), got epilogue {epilogue}, "
                         f"activation {activation!r}, transpose_weight={transpose_weight}")
    gate, up = halves
    if gate.shape != up.shape or gate.stride() != up.stride() or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gather_gemm: the gate and up halves must match in shape, strides, dtype and device; got "
                         f"{tuple(gate.shape)}/{gate.stride()}/{gate.dtype}/{gate.device} and "
                         f"{tuple(up.shape)}/{up.stride()}/{up.dtype}/{up.device}")
    return gate, up


def expert_order_gemm(a, weight, plan, *, transpose_weight, n):
    """``out[r] = A[r] @ B[e(r)]`` for A already in expert order (fc2 and dX: nothing to gather,
    no epilogue); ``weight`` as in ``gather_gemm``. Rows of unused slots (past the plan's last
    offset) are left unwritten."""
    out = a.new_empty(a.shape[0], n)
    gather_gemm(a, weight, out, plan, transpose_weight=transpose_weight, gather_a=False, n=n)
    return out


def gather_gemm_ds_tiles(n: int, block_n: int | None = None) -> int:
    """The activation backward's router-gradient partials per row (ds_partial's width): one per
    DS_COLS columns, whichever kernel (Triton's or the warp-specialized one) runs it, or one per
    tile where the Triton kernel's tile (``block_n``; by default its config's) is narrower (the
    interpreter's)."""
    if block_n is None:
        block_n = min(c.kwargs["BLOCK_N"] for c in prune_gather_gemm(gather_gemm_kernel.configs, {}, EPILOGUE=EPI_ACT_BWD))
    return cdiv(n, min(DS_COLS, block_n))
