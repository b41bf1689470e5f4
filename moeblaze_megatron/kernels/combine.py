"""Per-token reduction of expert-order rows through ``token_index_map``.

``out[t] = sum_k p[t, k] * rows[token_index_map[t, k]]``, summed in k order in float32: the
forward's weighted combine of expert outputs and the backward's sum of input gradients, with no
atomics (deterministic). Unused slots (-1) add nothing.

Each launch also does the router probabilities' O(T*K) bookkeeping, which would otherwise cost a
handful of small torch launches (host time the GPU waits on at small shapes): the forward writes
the probabilities in expert order for the backward's epilogue (``probs_sorted``), the backward
sums the activation backward's per-tile partials into the probability gradient (``ds_partial``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch, next_pow2
from .numerics import dot_flags, to_storage

BLOCK_T = 32
BLOCK_D = 128


@triton.jit
def _combine_kernel(
    rows_ptr, token_index_map_ptr, probs_ptr, out_ptr, side_ptr, ds_ptr, T, D, n_ds, stride_rm, stride_om, stride_dsm,
    K: tl.constexpr, HAS_PROBS: tl.constexpr, SCATTER_PROBS: tl.constexpr, GATHER_DS: tl.constexpr,
    DS_BLOCK: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr, MEND_SIDE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = t < T
    d_ok = d < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
        slot = t.to(tl.int64) * K + k
        pos = tl.load(token_index_map_ptr + slot, mask=t_ok, other=-1)
        used = pos >= 0
        v = tl.load(rows_ptr + pos.to(tl.int64)[:, None] * stride_rm + d[None, :], mask=used[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        if HAS_PROBS:
            v = v * tl.load(probs_ptr + slot, mask=used, other=0.0).to(tl.float32)[:, None]
        acc += v
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_om + d[None, :], to_storage(acc, out_ptr.dtype.element_ty, ROUND_BF16_BY_HAND),
             mask=t_ok[:, None] & d_ok[None, :])
    if SCATTER_PROBS or GATHER_DS:
        # Once per token, by the first column of programs, after the sum and in a loop of its own:
        # predicated side stores inside the main loop made the kernel half again slower.
        if tl.program_id(1) == 0:
            for k in tl.static_range(K):
                slot = t.to(tl.int64) * K + k
                pos = tl.load(token_index_map_ptr + slot, mask=t_ok, other=-1)
                used = pos >= 0
                if SCATTER_PROBS:
                    tl.store(side_ptr + pos.to(tl.int64), tl.load(probs_ptr + slot, mask=used), mask=used)
                if GATHER_DS:
                    j = tl.arange(0, DS_BLOCK)
                    ds = tl.load(ds_ptr + pos.to(tl.int64)[:, None] * stride_dsm + j[None, :],
                                 mask=used[:, None] & (j < n_ds)[None, :], other=0.0)
                    tl.store(side_ptr + slot, to_storage(tl.sum(ds, axis=1), side_ptr.dtype.element_ty, MEND_SIDE),
                             mask=t_ok)


def combine(rows: torch.Tensor, token_index_map: torch.Tensor, probs: torch.Tensor | None, out_dtype, *,
            probs_sorted: torch.Tensor | None = None, ds_partial: torch.Tensor | None = None,
            grad_probs: torch.Tensor | None = None) -> torch.Tensor:
    """rows [T*K, D] in expert order -> [T, D]; ``probs`` [T, K] weights each slot (None: 1).

    ``probs_sorted`` [T*K] (with ``probs``): also receives ``probs`` in expert order (the rows of
    unused slots, past the plan's last expert, are left as they are).
    ``ds_partial`` [T*K, n] float32 with ``grad_probs`` [T, K]: also writes
    ``grad_probs[t, k] = sum_j ds_partial[token_index_map[t, k], j]`` (0 for unused slots).
    """
    num_tokens, topk = token_index_map.shape
    width = rows.shape[1]
    if probs_sorted is not None and probs is None:
        raise ValueError("combine: probs_sorted needs probs")
    if (ds_partial is None) != (grad_probs is None):
        raise ValueError("combine: ds_partial and grad_probs come together")
    if probs_sorted is not None and grad_probs is not None:
        raise ValueError("combine: one of probs_sorted and grad_probs per launch")
    side = probs_sorted if probs_sorted is not None else grad_probs
    out = torch.empty(num_tokens, width, dtype=out_dtype, device=rows.device)
    grid = (cdiv(num_tokens, BLOCK_T), cdiv(width, BLOCK_D))
    n_ds = ds_partial.shape[1] if ds_partial is not None else 1
    args = (rows, token_index_map, probs if probs is not None else rows, out, side if side is not None else out,
            ds_partial if ds_partial is not None else rows, num_tokens, width, n_ds,
            rows.stride(0), out.stride(0), ds_partial.stride(0) if ds_partial is not None else 0)
    launch(_combine_kernel, grid, args, dict(
        K=topk, HAS_PROBS=probs is not None, SCATTER_PROBS=probs_sorted is not None,
        GATHER_DS=ds_partial is not None, DS_BLOCK=next_pow2(n_ds),
        ROUND_BF16_BY_HAND=dot_flags(out_dtype)[0], MEND_SIDE=side is not None and dot_flags(side.dtype)[0],
        BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
    ))
    return out
