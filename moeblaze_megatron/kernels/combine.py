"""Per-token reduction of expert-order rows through ``token_index_map``.

``out[t] = sum_k p[t, k] * rows[token_index_map[t, k]]``, summed in k order in float32: the
forward's weighted combine of expert outputs and the backward's sum of input gradients, with no
atomics (deterministic). Unused slots (-1) add nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .numerics import dot_flags, to_storage

BLOCK_T = 32
BLOCK_D = 128


@triton.jit
def _combine_kernel(
    rows_ptr, token_index_map_ptr, probs_ptr, out_ptr, T, D, stride_rm, stride_om,
    K: tl.constexpr, HAS_PROBS: tl.constexpr, MEND_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
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
        v = tl.load(
            rows_ptr + pos.to(tl.int64)[:, None] * stride_rm + d[None, :],
            mask=used[:, None] & d_ok[None, :], other=0.0,
        ).to(tl.float32)
        if HAS_PROBS:
            v = v * tl.load(probs_ptr + slot, mask=used, other=0.0).to(tl.float32)[:, None]
        acc += v
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_om + d[None, :], to_storage(acc, out_ptr.dtype.element_ty, MEND_BF16),
             mask=t_ok[:, None] & d_ok[None, :])


def combine(rows: torch.Tensor, token_index_map: torch.Tensor, probs: torch.Tensor | None, out_dtype) -> torch.Tensor:
    """rows [T*K, D] in expert order -> [T, D]; ``probs`` [T, K] weights each slot (None: 1)."""
    num_tokens, topk = token_index_map.shape
    width = rows.shape[1]
    out = torch.empty(num_tokens, width, dtype=out_dtype, device=rows.device)
    grid = (triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(width, BLOCK_D))
    _combine_kernel[grid](
        rows, token_index_map, probs if probs is not None else rows, out, num_tokens, width,
        rows.stride(0), out.stride(0), K=topk, HAS_PROBS=probs is not None, MEND_BF16=dot_flags(out_dtype)[0],
        BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
    )
    return out
