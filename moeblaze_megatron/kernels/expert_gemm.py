"""Grouped expert GEMMs over a routing plan, gathering their rows on the fly.

Two kernels serve the whole forward and backward pass:

* ``_row_gemm_kernel``: for every expert e and every row r of its slice of the plan,
  ``C[r] = A[src(r)] @ B[e]`` where ``src(r)`` is the token id (``GATHER_A``: rows of x or dY read
  in place through ``expert_token_indices``) or r itself (A already in expert order). Its epilogue
  is one of: store C; the activation forward (SwiGLU: the gate columns and the up columns form one
  weight tile twice as wide, so x is read once and silu(gate) * up is formed in registers from the
  two halves of one accumulator); the activation backward (silu
  recomputed from the saved pre-activations, the router-probability gradient as a row dot
  product, the probability scaling). The weight comes through a TMA descriptor on Hopper; so do
  A and C of the large plain GEMMs over rows in expert order (fc2, dX), through ragged ones.
* ``_weight_grad_kernel``: ``dW[e] = A[rows(e)]^T @ B[rows(e)]``, each program reducing one output
  tile over all rows of its expert in a fixed order (no atomics, so deterministic). The operand in
  expert order comes through a ragged TMA descriptor on Hopper (17-20% faster than pointer loads
  there: the reduction runs down its rows, so its tiles are MN-major), the gathered one through
  pointers.

Row tiles never straddle two experts: row-tile i is mapped to its expert inside the kernel from
``expert_token_offsets``, so no host synchronization is needed and the grid is an upper bound
(``cdiv(T*K, BLOCK_M) + E`` row tiles), or, for a persistent config, one program per
multiprocessor looping over the tiles that exist. All row and expert offsets are 64-bit.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.tools.ragged_tma import create_ragged_descriptor, load_ragged, to_ragged_indices
from triton.tools.tensor_descriptor import TensorDescriptor

from .launch import cdiv, launch, next_pow2
from .numerics import dot, dot_flags, interpreting, to_storage

ACT_SWIGLU, ACT_SILU, ACT_GELU = 0, 1, 2
ACTIVATION_IDS = {"swiglu": ACT_SWIGLU, "silu": ACT_SILU, "gelu": ACT_GELU}
EPI_STORE, EPI_ACT_FWD, EPI_ACT_BWD = 0, 1, 2


@triton.jit
def _silu_parts(g):
    sig = 1.0 / (1.0 + tl.exp(-g))
    return sig, g * sig


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 2:
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:
        sig, silu = _silu_parts(g)
        return silu


@triton.jit
def _act_grad(g, ACT: tl.constexpr):
    if ACT == 2:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        return cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:
        sig, silu = _silu_parts(g)
        return sig * (1.0 + g * (1.0 - sig))


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


def autotuning() -> bool:
    """MOEBLAZE_AUTOTUNE=0 runs every GEMM with one general config instead of timing the list
    on the first call of each shape (seconds per shape; the tuned configs are up to ~1.5x faster)."""
    value = os.environ.get("MOEBLAZE_AUTOTUNE", "1")
    if value not in ("0", "1"):
        raise ValueError(f"MOEBLAZE_AUTOTUNE must be 0 or 1, got {value!r}")
    return value == "1"


def _set_row_gemm_boxes(nargs):
    """Config pre-hook: each descriptor's box is the config's tile of its operand: the weight's,
    and, for rows in expert order (ragged, led by [1, 1]), A's [BLOCK_M, BLOCK_K] and C's
    [BLOCK_M, BLOCK_N]."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    b = nargs["b_ptr"]
    if isinstance(b, TensorDescriptor):
        b.block_shape = [1, 2, bn, bk] if len(b.shape) == 4 else [1, bn, bk] if nargs["TRANS_B"] else [1, bk, bn]
    if isinstance(nargs["a_ptr"], TensorDescriptor):
        nargs["a_ptr"].block_shape = [1, 1, bm, bk]
        nargs["c_ptr"].block_shape = [1, 1, bm, bn]


def _row_gemm_configs():
    configs = _row_gemm_tiles()
    for config in configs:
        config.pre_hook = _set_row_gemm_boxes
    return configs


def _row_gemm_tiles():
    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, num_warps=4)]
    if not autotuning():
        # BLOCK_K 32: four stages fit shared memory in float32 too. The first serves every
        # epilogue but the SwiGLU forward, which takes the second (see _prune_row_gemm).
        return [
            triton.Config({"BLOCK_M": 128, "BLOCK_N": n, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=4)
            for n in (ACT_BWD_BLOCK_N, 128)
        ]
    # From scripts/tune_kernels.py on the H200 (benchmarks/results/2026-11-29-h200-v2 and -v9):
    # 128x256 tiles won every plain GEMM (fc2, dX), 128x128 the SwiGLU forward (capped at 128
    # columns); 4-warp and 64-row tiles never won on those shapes, one is kept for experts with
    # few rows. Persistent programs (one per multiprocessor, looping over tiles: the next tile's
    # loads start during this one's epilogue) ran the plain GEMMs up to 16% faster (v9: 7B-like
    # fc2 0.478 -> 0.403 ms, qwen3-like 1.435 -> 1.352, conf6 dX 6.05 -> 5.75, conf4 dX even) and
    # fc1 0-3% faster; the activation backward 15-40% slower (its epilogue spills inside the tile
    # loop). The first config is the activation backward's only one (see ACT_BWD_BLOCK_N).
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8, "PERSISTENT": persistent},
                      num_warps=w, num_stages=s)
        for bm, bn, w, s, persistent in (
            (128, 256, 8, 4, False),
            (128, 256, 8, 4, True),
            (128, 256, 8, 3, True),
            (128, 128, 8, 4, True),
            (128, 128, 8, 3, True),
            (128, 128, 8, 4, False),
            (128, 128, 8, 3, False),
            (128, 64, 8, 4, False),
            (64, 128, 4, 4, False),
        )
    ]


# The activation backward writes one router-gradient partial per column tile, summed afterwards:
# its rounding depends on the tile width, so it runs one config (the router gradient is then
# bitwise the same run to run, whatever the autotuner's noise). 128x256x64 with four stages, its
# epilogue in four column chunks, was the fastest of the 128x128 and 128x256 configs on every shape
# measured (scripts/tune_kernels.py, H200, benchmarks/results/2026-11-29-h200-v8): conf4 12.23 ->
# 10.61 ms, conf5 2.29 -> 2.07, qwen3-like 2.22 -> 2.09, 7B-like 0.549 -> 0.532 against the
# 128x128 tiles it ran before (a 256-wide accumulator halves the weight tiles read per output).
# Two programs per multiprocessor (128x128, 4 warps, 32- or 16-column chunks) and a persistent
# loop were slower (v9: conf4 13.0 and 12.4 ms against 10.8).
ACT_BWD_BLOCK_N = 256

# A and C of a plain GEMM in expert order through ragged TMA descriptors ran fc2 and dX 1.5-15%
# faster on the H200 (scripts/tune_kernels.py, benchmarks/results/2026-11-30-h200-v11: conf4 fc2
# 5.95 vs 6.41 ms, dX 12.57 vs 12.76; qwen3-like 1.267 vs 1.351 and 2.313 vs 2.424; 7B-like 0.345
# vs 0.406 and 0.541 vs 0.594), but each descriptor costs the host tens of microseconds a launch
# (Triton encodes its tensor map at every launch): with descriptors on every fc1, fc2 and dX launch
# the host-bound small shapes' steps grew by as much (host time per step conf1 1.54 -> 1.97 ms,
# conf2 1.47 -> 2.13; back to back conf1 1.60 -> 2.04, conf2 1.80 -> 2.30; queued GPU time even).
# Below 2**38 FLOPs (~0.4 ms of GPU) a GEMM keeps its pointers.
TMA_ROWS_MIN_FLOPS = 2**38


def _prune_row_gemm(configs, named_args, **kwargs):
    # The SwiGLU forward holds the gate and up halves of its tile: it spills past 128 columns.
    # (Triton passes the constexprs in kwargs, the other arguments in named_args.)
    args = {**named_args, **kwargs}
    if args.get("TMA_ROWS"):
        # C's store buffer does not fit shared memory beside a persistent program's four pipeline
        # stages (sm_90a: 262 KB).
        configs = [c for c in configs if not (c.kwargs.get("PERSISTENT") and c.num_stages >= 4)]
    if args["EPILOGUE"] == EPI_ACT_BWD:
        keep = [c for c in configs if c.kwargs["BLOCK_N"] == ACT_BWD_BLOCK_N and not c.kwargs.get("PERSISTENT")][:1]
    elif args["ACT"] == ACT_SWIGLU and args["EPILOGUE"] == EPI_ACT_FWD:
        keep = [c for c in configs if c.kwargs["BLOCK_N"] <= 128]
    elif args["EPILOGUE"] == EPI_STORE:
        # 128x128 tiles, persistent or not, lost every plain GEMM to 128x256 (v9: 7B-like fc2 0.51
        # against 0.40 ms, conf6 dX 7.3 against 5.7): timing them only lengthened a shape's first call.
        keep = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) != (128, 128)]
    else:
        keep = configs
    if not autotuning():
        keep = keep[:1]
    return keep or configs[-1:]


@triton.autotune(
    configs=_row_gemm_configs(),
    key=["N", "K", "E", "rows_bucket", "EPILOGUE", "ACT", "GATHER_A", "TMA_B", "TMA_ROWS"],
    prune_configs_by={"early_config_prune": _prune_row_gemm},
    # The activation backward rewrites pre in place and fills one ds column per column tile.
    restore_value=["pre_ptr"],
    reset_to_zero=["ds_ptr"],
)
@triton.jit
def _row_gemm_kernel(
    a_ptr, b_ptr, c_ptr, pre_ptr, probs_ptr, ds_ptr,
    token_idx_ptr, offsets_ptr,
    rows_total, rows_bucket, N, K, E,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn,
    stride_cm, stride_pm, stride_dsm,
    EPILOGUE: tl.constexpr, ACT: tl.constexpr, GATHER_A: tl.constexpr, STORE_PRE: tl.constexpr,
    MEND_BF16: tl.constexpr, PRECISION: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA_B: tl.constexpr = False, TRANS_B: tl.constexpr = False, TMA_ROWS: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False,
):
    """C = A[src] @ B[e] per expert row tile, then the epilogue.

    EPI_STORE:   c[r, n] = acc.
    EPI_ACT_FWD: pre = acc (gate | up for SwiGLU, stored when STORE_PRE), c = act(pre).
    EPI_ACT_BWD: acc is dH (unscaled); pre holds the saved pre-activations and receives
                 d pre in place; c receives p * act(pre) (for dW2); ds receives
                 <dH, act(pre)> summed over this program's columns (one partial per column tile).
    For SwiGLU, N is the width h of one half; the up half sits N columns after the gate half.
    TMA_B: B is a TMA descriptor over the weight, [E, N, K] (TRANS_B), [E, 2, N, K] (the SwiGLU
    forward's gate and up halves) or [E, K, N]; the hardware zero-fills past N and K.
    TMA_ROWS (EPI_STORE, A in expert order): A and C are ragged TMA descriptors over the rows; the
    hardware reads zeros and drops writes past the tile's expert, as the masks do for pointers.
    """
    n_tiles = tl.cdiv(N, BLOCK_N)
    # (One call per branch: a one-trip loop around the per-tile launch's call compiles to other
    # code, with up to 50 more registers.)
    if PERSISTENT:
        m_tiles = _row_tiles(offsets_ptr, E, BLOCK_M, E_POW2)
        for pid in tl.range(tl.program_id(0), m_tiles * n_tiles, tl.num_programs(0), flatten=True):
            _row_gemm_tile(pid, m_tiles, n_tiles, a_ptr, b_ptr, c_ptr, pre_ptr, probs_ptr, ds_ptr, token_idx_ptr,
                           offsets_ptr, N, K, E, stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                           stride_cm, stride_pm, stride_dsm, EPILOGUE, ACT, GATHER_A, STORE_PRE, MEND_BF16,
                           PRECISION, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA_B, TRANS_B, TMA_ROWS,
                           PERSISTENT)
    else:
        _row_gemm_tile(tl.program_id(0), tl.cdiv(rows_total, BLOCK_M) + E, n_tiles, a_ptr, b_ptr, c_ptr, pre_ptr,
                       probs_ptr, ds_ptr, token_idx_ptr, offsets_ptr, N, K, E, stride_am, stride_ak,
                       stride_be, stride_bk, stride_bn, stride_cm, stride_pm, stride_dsm, EPILOGUE, ACT, GATHER_A,
                       STORE_PRE, MEND_BF16, PRECISION, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA_B, TRANS_B,
                       TMA_ROWS, PERSISTENT)


@triton.jit
def _row_gemm_tile(
    pid, m_tiles, n_tiles, a_ptr, b_ptr, c_ptr, pre_ptr, probs_ptr, ds_ptr, token_idx_ptr, offsets_ptr,
    N, K, E, stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_pm, stride_dsm,
    EPILOGUE: tl.constexpr, ACT: tl.constexpr, GATHER_A: tl.constexpr, STORE_PRE: tl.constexpr,
    MEND_BF16: tl.constexpr, PRECISION: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA_B: tl.constexpr, TRANS_B: tl.constexpr, TMA_ROWS: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """Output tile ``pid`` of ``m_tiles`` x ``n_tiles`` (row tiles grouped by GROUP_M)."""
    GLU: tl.constexpr = ACT == 0 and EPILOGUE != 0
    in_group = GROUP_M * n_tiles
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    e, row_lo, row0, row_end, exists = _expert_of_row_tile(pid_m, offsets_ptr, E, BLOCK_M, E_POW2)
    # A persistent kernel visits existing tiles only; an if around the main loop would keep the
    # compiler from pipelining across tiles.
    if PERSISTENT or exists:
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        if GATHER_A:
            src = tl.load(token_idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        # The SwiGLU forward multiplies by the gate columns and the up columns N further on as one
        # [BLOCK_K, 2 * BLOCK_N] tile: one matrix-instruction chain twice as wide, x read once.
        B_COLS: tl.constexpr = 2 * BLOCK_N if GLU and EPILOGUE == 1 else BLOCK_N
        if GLU and EPILOGUE == 1:
            j = tl.arange(0, B_COLS)
            b_cols = pid_n * BLOCK_N + j + (j // BLOCK_N) * (N - BLOCK_N)
            b_col_ok = pid_n * BLOCK_N + j % BLOCK_N < N
        else:
            b_cols = cols
            b_col_ok = col_ok
        ks = tl.arange(0, BLOCK_K)
        if not TMA_ROWS:
            a_ptrs = a_ptr + src[:, None] * stride_am + ks[None, :] * stride_ak
        if not TMA_B:
            b_ptrs = b_ptr + e.to(tl.int64) * stride_be + ks[:, None] * stride_bk + b_cols[None, :].to(tl.int64) * stride_bn
        acc = tl.zeros((BLOCK_M, B_COLS), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            if TMA_ROWS:
                a = load_ragged(a_ptr, row_lo, row_end - row_lo, [row0 - row_lo, k0])
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
            acc = dot(a, b, acc, MEND_BF16, PRECISION)
            if not TMA_ROWS:
                a_ptrs += BLOCK_K * stride_ak
            if not TMA_B:
                b_ptrs += BLOCK_K * stride_bk

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
                        tl.reshape(to_storage(acc, out_dtype, MEND_BF16), [1, 1, BLOCK_M, BLOCK_N]))
        elif EPILOGUE == 0:
            tl.store(c_ptrs, to_storage(acc, out_dtype, MEND_BF16), mask=mask)
        elif EPILOGUE == 1:
            # Round to the storage dtype first: backward recomputes from the stored values.
            if GLU:
                acc_gate, acc_up = _column_halves(acc, BLOCK_M, 2 * BLOCK_N)
                gate = to_storage(acc_gate, out_dtype, MEND_BF16)
                up = to_storage(acc_up, out_dtype, MEND_BF16)
                if STORE_PRE:
                    tl.store(pre_ptrs, gate, mask=mask)
                    tl.store(pre_ptrs + N, up, mask=mask)
                h = _act(gate.to(tl.float32), ACT) * up.to(tl.float32)
            else:
                gate = to_storage(acc, out_dtype, MEND_BF16)
                if STORE_PRE:
                    tl.store(pre_ptrs, gate, mask=mask)
                h = _act(gate.to(tl.float32), ACT)
            tl.store(c_ptrs, to_storage(h, out_dtype, MEND_BF16), mask=mask)
        else:
            # dH is rounded to the storage dtype first (as a stored dH would be), which halves the
            # registers it holds; the epilogue then runs on four column chunks one after the other
            # (a whole 256-wide tile's saved pre-activations at once would spill), each chunk's
            # loads issued before the previous chunk's stores.
            p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            ds = _act_bwd_epilogue(to_storage(acc, out_dtype, MEND_BF16), p, r64, row_ok, pid_n * BLOCK_N, N,
                                   c_ptr, pre_ptr, stride_cm, stride_pm, ACT, GLU, MEND_BF16, BLOCK_M, BLOCK_N)
            tl.store(ds_ptr + r64 * stride_dsm + pid_n, ds, mask=row_ok)


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
                   ACT: tl.constexpr, GLU: tl.constexpr, MEND_BF16: tl.constexpr):
    """The activation backward on the columns from col0 of dH = acc (unscaled), given their saved
    pre-activations: d pre over pre (for SwiGLU d gate, and d up N columns further), p * act(pre)
    into c; returns the rows' partial <dH, h>."""
    out_dtype = c_ptr.dtype.element_ty
    acc = acc.to(tl.float32)
    g = g.to(tl.float32)
    cols = col0 + tl.arange(0, acc.shape[1])
    mask = row_ok[:, None] & (cols < N)[None, :]
    pre_ptrs = pre_ptr + r64[:, None] * stride_pm + cols[None, :]
    dh = acc * p[:, None]
    if GLU:
        up = up.to(tl.float32)
        sig, silu = _silu_parts(g)
        h = silu * up
        tl.store(pre_ptrs + N, to_storage(dh * silu, out_dtype, MEND_BF16), mask=mask)
        d_pre = dh * up * sig * (1.0 + g * (1.0 - sig))
    else:
        h = _act(g, ACT)
        d_pre = dh * _act_grad(g, ACT)
    tl.store(pre_ptrs, to_storage(d_pre, out_dtype, MEND_BF16), mask=mask)
    tl.store(c_ptr + r64[:, None] * stride_cm + cols[None, :], to_storage(h * p[:, None], out_dtype, MEND_BF16),
             mask=mask)
    return tl.sum(tl.where(mask, acc * h, 0.0), axis=1)


@triton.jit
def _act_bwd_epilogue(dh, p, r64, row_ok, col0, N, c_ptr, pre_ptr, stride_cm, stride_pm,
                      ACT: tl.constexpr, GLU: tl.constexpr, MEND_BF16: tl.constexpr,
                      ROWS: tl.constexpr, COLS: tl.constexpr):
    """The activation backward on COLS columns of dH from col0, in four chunks. Returns the rows'
    partial <dH, h>.

    Each chunk's loads are issued before the previous chunk's stores: d pre is written over pre,
    so the compiler may not move a load above a store, and a chunk's loads would otherwise wait
    out a whole memory round trip after the previous chunk's stores."""
    Q: tl.constexpr = COLS // 4
    lo, hi = _column_halves(dh, ROWS, COLS)
    c0, c1 = _column_halves(lo, ROWS, COLS // 2)
    c2, c3 = _column_halves(hi, ROWS, COLS // 2)
    g0, u0 = _load_pre(r64, row_ok, col0, N, pre_ptr, stride_pm, Q, GLU)
    g1, u1 = _load_pre(r64, row_ok, col0 + Q, N, pre_ptr, stride_pm, Q, GLU)
    ds = _act_bwd_chunk(c0, g0, u0, p, r64, row_ok, col0, N, c_ptr, pre_ptr, stride_cm, stride_pm, ACT, GLU, MEND_BF16)
    g2, u2 = _load_pre(r64, row_ok, col0 + 2 * Q, N, pre_ptr, stride_pm, Q, GLU)
    ds += _act_bwd_chunk(c1, g1, u1, p, r64, row_ok, col0 + Q, N, c_ptr, pre_ptr, stride_cm, stride_pm, ACT, GLU,
                         MEND_BF16)
    g3, u3 = _load_pre(r64, row_ok, col0 + 3 * Q, N, pre_ptr, stride_pm, Q, GLU)
    ds += _act_bwd_chunk(c2, g2, u2, p, r64, row_ok, col0 + 2 * Q, N, c_ptr, pre_ptr, stride_cm, stride_pm, ACT, GLU,
                         MEND_BF16)
    ds += _act_bwd_chunk(c3, g3, u3, p, r64, row_ok, col0 + 3 * Q, N, c_ptr, pre_ptr, stride_cm, stride_pm, ACT, GLU,
                         MEND_BF16)
    return ds


def _set_tma_box(nargs):
    """Config pre-hook: a ragged descriptor's box is the config's tile, [1, 1, BLOCK_K, width]."""
    for name, width in (("a_ptr", "BLOCK_M"), ("b_ptr", "BLOCK_N")):
        if isinstance(nargs[name], TensorDescriptor):
            nargs[name].block_shape = [1, 1, nargs["BLOCK_K"], nargs[width]]


def _weight_grad_configs():
    if interpreting():
        configs = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=4)]
    elif not autotuning():
        configs = [triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=8, num_stages=5)]
    else:
        # The row ids are loaded inside the loop and take a pipeline stage of their own, so these
        # need one stage more than the row GEMM for the same depth (5 stages: 3 buffers). From
        # scripts/tune_kernels.py on the H200 (benchmarks/results/2026-11-29-h200-v5): with the
        # TMA operand, 256x128x32 at 8 stages won dW1 and 128x256x64 at 5 dW2 on qwen3, 7B and
        # conf4 (17-35% faster than pointer loads); the pointer form's best, 256x128x64 at 5
        # stages, stays for operands a descriptor cannot take.
        configs = [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in (
                (256, 128, 32, 8, 8),
                (128, 256, 64, 8, 5),
                (256, 128, 64, 8, 5),
                (128, 256, 32, 8, 8),
                (128, 128, 64, 8, 5),
            )
        ]
    for config in configs:
        config.pre_hook = _set_tma_box
    return configs


def _prune_weight_grad(configs, named_args, **kwargs):
    # Every measured shape ran fastest with the tile's long side on the operand in expert order
    # (dW1: A, 256 x 128; dW2: B, 128 x 256; either way by 10-50%): only those are timed, so the
    # autotuner's noise cannot pick a config of the other orientation.
    args = {**named_args, **kwargs}
    if args["GATHER_A"] == args["GATHER_B"]:
        return configs
    long_side, short_side = ("BLOCK_N", "BLOCK_M") if args["GATHER_A"] else ("BLOCK_M", "BLOCK_N")
    return [c for c in configs if c.kwargs[long_side] >= c.kwargs[short_side]] or configs


@triton.autotune(
    configs=_weight_grad_configs(),
    key=["M", "N", "E", "rows_bucket", "GATHER_A", "GATHER_B", "TMA"],
    prune_configs_by={"early_config_prune": _prune_weight_grad},
)
@triton.jit
def _weight_grad_kernel(
    a_ptr, b_ptr, c_ptr, token_idx_ptr, offsets_ptr,
    rows_bucket, M, N, E,
    stride_am, stride_bm, stride_ce, stride_cm,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, TMA: tl.constexpr, MEND_BF16: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[e, m, n] = sum over rows r of expert e of A[srcA(r), m] * B[srcB(r), n].

    A and B have unit column stride; ``src`` is the token id (GATHER_*) or r. Experts with no rows
    get zeros. ``TMA``: the operand that is not gathered is a ragged TMA descriptor (rows past the
    expert's read as zeros by the hardware) instead of a pointer.
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
        if GATHER_A or GATHER_B:
            tok = tl.load(token_idx_ptr + rows, mask=r_ok, other=0).to(tl.int64)
        if TMA and not GATHER_A:
            a = tl.trans(load_ragged(a_ptr, lo, hi - lo, [r0 - lo, pid_m * BLOCK_M]))
        else:
            src_a = tok if GATHER_A else rows.to(tl.int64)
            a = tl.load(a_ptr + src_a[None, :] * stride_am + ms[:, None], mask=m_ok[:, None] & r_ok[None, :],
                        other=0.0)
        if TMA and not GATHER_B:
            b = load_ragged(b_ptr, lo, hi - lo, [r0 - lo, pid_n * BLOCK_N])
        else:
            src_b = tok if GATHER_B else rows.to(tl.int64)
            b = tl.load(b_ptr + src_b[:, None] * stride_bm + ns[None, :], mask=r_ok[:, None] & n_ok[None, :],
                        other=0.0)
        acc = dot(a, b, acc, MEND_BF16, PRECISION)
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + ms[:, None].to(tl.int64) * stride_cm + ns[None, :]
    tl.store(c_ptrs, to_storage(acc, c_ptr.dtype.element_ty, MEND_BF16), mask=m_ok[:, None] & n_ok[None, :])


def config_label(config) -> str:
    """``BLOCK_MxBLOCK_NxBLOCK_K/gGROUP_M/wWARPS/sSTAGES[/p]`` of a tile config (``g-``: no grouping,
    ``/p``: persistent)."""
    kw = config.kwargs
    return (f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}/g{kw.get('GROUP_M', '-')}"
            f"/w{config.num_warps}/s{config.num_stages}{'/p' if kw.get('PERSISTENT') else ''}")


def autotune_picks() -> dict[str, str]:
    """The config the autotuner chose for every shape key tuned so far in this process, by
    ``kernel(key)``: which tiles a benchmark actually ran."""
    return {f"{kernel.base_fn.__name__}{key}": config_label(config)
            for kernel in (_row_gemm_kernel, _weight_grad_kernel) for key, config in kernel.cache.items()}


def _launch(kernel, grid, args, constexprs, config):
    """Launch through the autotuner, or with one fixed ``triton.Config`` (scripts/tune_kernels.py
    times configs one by one this way)."""
    if config is None:
        launch(kernel, grid, args, constexprs)
    else:
        kernel.fn[grid](*args, **constexprs, **config.all_kwargs())


@functools.cache
def _capability(index):
    return torch.cuda.get_device_capability(index)


@functools.cache
def _sm_count(device) -> int:
    """A persistent launch's programs: one per multiprocessor (the interpreter: 4)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _tma_takes(t) -> bool:
    """Whether a TMA descriptor can take ``t``: Hopper or newer (or the interpreter), unit last
    stride, the other strides and the start 16-byte aligned."""
    if t.is_cuda and _capability(t.device.index) < (9, 0):
        return False
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((stride * t.element_size()) % 16 == 0 for stride in t.stride()[:-1]))


def row_gemm(a, weight, out, plan, *, transpose_weight, epilogue=EPI_STORE, activation="swiglu",
             gather_a=True, pre=None, store_pre=True, probs_sorted=None, ds_partial=None, n=None,
             config=None, tma_weight=None, tma_rows=None):
    """Launch ``_row_gemm_kernel`` over ``n`` output columns; ``weight`` is [E, out, in]
    (``transpose_weight``: multiply by its transpose, as nn.Linear does) or [E, in, out].
    ``ds_partial`` (activation backward): float32, ``row_gemm_ds_tiles(n)`` wide; every used row's
    partials are written (the rows of unused slots, past the plan's last offset, are not).
    ``tma_weight``: read the weight through a TMA descriptor where the hardware and the tensor
    allow it (None, the default: Hopper or newer, an aligned weight), always (True: an error where
    it cannot) or never (False: pointer loads). Either gives the same bits.
    ``tma_rows``: the same choice for A and the output of a plain GEMM over rows in expert order
    (``EPI_STORE``, not ``gather_a``: fc2, dX) through ragged TMA descriptors; None takes them
    from ``TMA_ROWS_MIN_FLOPS`` on."""
    rows_total = plan.expert_token_indices.shape[0]
    num_experts = plan.num_experts
    k_dim = a.shape[1]
    b = weight
    if tma_weight is None:
        tma_weight = _tma_takes(weight)
    elif tma_weight and not _tma_takes(weight):
        raise ValueError(f"row_gemm(tma_weight=True): weight must be on a GPU of compute capability 9.0 or newer, "
                         f"have unit last stride and 16-byte aligned strides and start; got strides "
                         f"{weight.stride()} on {weight.device}")
    if tma_weight:
        # The box is the first config's weight tile; the configs' pre-hook resizes it to each one's.
        kw = (config or _row_gemm_kernel.configs[0]).kwargs
        if epilogue == EPI_ACT_FWD and activation == "swiglu":
            b = TensorDescriptor.from_tensor(weight.view(num_experts, 2, n, k_dim), [1, 2, kw["BLOCK_N"], kw["BLOCK_K"]])
        elif transpose_weight:
            b = TensorDescriptor.from_tensor(weight, [1, kw["BLOCK_N"], kw["BLOCK_K"]])
        else:
            b = TensorDescriptor.from_tensor(weight, [1, kw["BLOCK_K"], kw["BLOCK_N"]])
    if transpose_weight:
        stride_bk, stride_bn = weight.stride(2), weight.stride(1)
    else:
        stride_bk, stride_bn = weight.stride(1), weight.stride(2)
    # The descriptor's bounds stand in for the column mask: only the n columns the kernel writes.
    c_rows = out[:, :n]
    rows_take = (epilogue == EPI_STORE and not gather_a and rows_total > 0
                 and _ragged_tma_takes(a, rows_total) and _ragged_tma_takes(c_rows, rows_total))
    if tma_rows is None:
        tma_rows = rows_take and 2 * rows_total * n * k_dim >= TMA_ROWS_MIN_FLOPS
    elif tma_rows and not rows_take:
        raise ValueError(
            f"row_gemm(tma_rows=True): needs a plain GEMM (epilogue EPI_STORE, got {epilogue}) over A in expert "
            f"order (gather_a=False, got {gather_a}), and A and out on a GPU of compute capability 9.0 or newer "
            f"with 1 to 2**30 rows (got {rows_total}), unit last stride, 16-byte aligned strides and start; got "
            f"strides {a.stride()} and {out.stride()} on {out.device}")
    a_arg, c_arg = a, out
    if tma_rows:
        # The boxes are the first config's tiles; the configs' pre-hook resizes them to each one's.
        kw = (config or _row_gemm_kernel.configs[0]).kwargs
        a_arg = create_ragged_descriptor(a, [kw["BLOCK_M"], kw["BLOCK_K"]])
        c_arg = create_ragged_descriptor(c_rows, [kw["BLOCK_M"], kw["BLOCK_N"]])
    mend, precision = dot_flags(a.dtype)
    device = a.device

    def grid(meta):
        tiles = (cdiv(rows_total, meta["BLOCK_M"]) + num_experts) * cdiv(n, meta["BLOCK_N"])
        return (min(tiles, _sm_count(device)),) if meta.get("PERSISTENT") else (tiles,)

    args = (
        a_arg, b, c_arg, pre if pre is not None else out,
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
        MEND_BF16=mend, PRECISION=precision, E_POW2=max(next_pow2(num_experts + 1), 16),
        TMA_B=tma_weight, TRANS_B=tma_weight and transpose_weight, TMA_ROWS=tma_rows,
    )
    _launch(_row_gemm_kernel, grid, args, constexprs, config)


# fc2 and dX ran through torch._grouped_mm at short reductions until A and C went through ragged
# TMA descriptors; since then the kernel ties or wins on every shape measured (H200,
# scripts/tune_kernels.py, benchmarks/results/2026-11-30-h200-v11; ms, kernel vs grouped_mm):
# 7B-like fc2 (K = 256, below TMA_ROWS_MIN_FLOPS: pointers) 0.406 vs 0.402, dX (K = 512) 0.541 vs
# 0.586; qwen3-like fc2 (K = 768) 1.267 vs 1.350, dX (K = 1536) 2.313 vs 2.389; from K = 2048 on
# the kernel won with pointers too (v9).
def expert_order_gemm(a, weight, plan, *, transpose_weight, n):
    """``out[r] = A[r] @ B[e(r)]`` for A already in expert order (fc2 and dX: nothing to gather,
    no epilogue); ``weight`` as in ``row_gemm``. Rows of unused slots (past the plan's last
    offset) are left unwritten."""
    out = a.new_empty(a.shape[0], n)
    row_gemm(a, weight, out, plan, transpose_weight=transpose_weight, gather_a=False, n=n)
    return out


def row_gemm_ds_tiles(n: int) -> int:
    """The column tiles of the activation-backward epilogue (its ds width), for every config it
    may run."""
    kept = _prune_row_gemm(_row_gemm_kernel.configs, {}, EPILOGUE=EPI_ACT_BWD)
    return cdiv(n, min(c.kwargs["BLOCK_N"] for c in kept))


# A gather into expert order plus torch._grouped_mm (the reduction split at the expert offsets)
# against the weight-gradient kernel on the H200 (scripts/tune_kernels.py dw1_grouped_mm /
# dw2_grouped_mm, gather included; benchmarks/results/2026-11-29-h200-v7): faster on every shape
# with experts at least as wide as the model (dW1 / dW2 in ms: conf3 2.11 -> 1.62 / 1.12 -> 0.83,
# conf4 16.7 -> 15.0 / 8.6 -> 6.9, conf5 2.11 -> 1.58 / 1.08 -> 0.90, conf6 7.87 -> 6.81 /
# 4.34 -> 3.71, conf7 1.85 -> 1.67 / 0.89 -> 0.94), even or slower on the fine-grained ones
# (qwen3-like 2.93 -> 2.95 / 1.63 -> 1.81, 7B-like 0.59 -> 0.80 / 0.29 -> 0.57).
def grouped_weight_grads_apply(x, ffn: int) -> bool:
    """Whether the weight gradients run as ``gathered_weight_grad``: bfloat16 on a GPU of compute
    capability 9.0 or newer, experts at least as wide as x (``ffn >= hidden``), rows of both widths
    16 bytes apart (the strides torch._grouped_mm takes; the kernel runs any width)."""
    hidden = x.shape[1]
    return (ffn >= hidden and x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and (hidden * x.element_size()) % 16 == 0 and (ffn * x.element_size()) % 16 == 0
            and _capability(x.device.index) >= (9, 0))


def gathered_weight_grad(a, b, plan, *, gather_a, buffer):
    """``weight_grad``'s result for exactly one gathered operand (A when ``gather_a``, else B) as a
    gather of that operand into expert order, into ``buffer`` [T*K, its width], and
    ``torch._grouped_mm`` with the reduction split at the expert offsets; returns [E, M, N].
    Rows of unused slots (past the plan's last offset) are outside every group: not read."""
    # An unused slot's -1 would fail index_select; its row is never read.
    index = plan.expert_token_indices.clamp(min=0)
    if gather_a:
        a = torch.index_select(a, 0, index, out=buffer)
    else:
        b = torch.index_select(b, 0, index, out=buffer)
    return torch._grouped_mm(a.t(), b, offs=plan.expert_token_offsets[1:])


def _ragged_tma_takes(ordered, rows_total: int) -> bool:
    """Whether a ragged TMA descriptor can take ``ordered``: as ``_tma_takes``, and at most 2**30
    rows (the ragged descriptor's row coordinates)."""
    return rows_total <= 2**30 and _tma_takes(ordered)


def weight_grad(a, b, out, plan, *, gather_a, gather_b, config=None, tma=None):
    """out[e] = A[rows(e)]^T @ B[rows(e)] for every expert; out is [E, M, N].

    With exactly one gathered operand, the other (in expert order) is read through a ragged TMA
    descriptor where the hardware and the tensor allow it (``tma=None``), always (``True``: an error
    where it cannot) or never (``False``: pointer loads, as with two or no gathered operands)."""
    m_dim, n_dim = a.shape[1], b.shape[1]
    num_experts = plan.num_experts
    mend, precision = dot_flags(a.dtype)
    rows_total = plan.expert_token_indices.shape[0]
    grid = lambda meta: (cdiv(m_dim, meta["BLOCK_M"]) * cdiv(n_dim, meta["BLOCK_N"]), num_experts)
    strides = (a.stride(0), b.stride(0), out.stride(0), out.stride(1))
    name, ordered = ("a", a) if gather_b else ("b", b)
    if tma is None:
        tma = gather_a != gather_b and _ragged_tma_takes(ordered, rows_total)
    elif tma:
        if gather_a == gather_b:
            raise ValueError("weight_grad(tma=True) needs exactly one gathered operand, got gather_a == gather_b")
        if not _ragged_tma_takes(ordered, rows_total):
            raise ValueError(
                f"weight_grad(tma=True): {name} must be on a GPU of compute capability 9.0 or newer, have at "
                f"most 2**30 rows, unit column stride, rows a multiple of 16 bytes apart and a 16-byte aligned "
                f"start; got shape {tuple(ordered.shape)}, strides {ordered.stride()}, "
                f"{ordered.element_size()}-byte elements on {ordered.device}")
    if tma:
        # The box is the first config's tile; the configs' pre-hook resizes it to each one's.
        kw = (config or _weight_grad_kernel.configs[0]).kwargs
        if gather_b:
            a = create_ragged_descriptor(a, [kw["BLOCK_K"], kw["BLOCK_M"]])
        else:
            b = create_ragged_descriptor(b, [kw["BLOCK_K"], kw["BLOCK_N"]])
    args = (
        a, b, out, plan.expert_token_indices, plan.expert_token_offsets,
        next_pow2(rows_total), m_dim, n_dim, num_experts, *strides,
    )
    constexprs = dict(GATHER_A=gather_a, GATHER_B=gather_b, TMA=tma, MEND_BF16=mend, PRECISION=precision)
    _launch(_weight_grad_kernel, grid, args, constexprs, config)
