"""The fused MoE expert MLP over the Triton kernels: its forward and backward passes
(``fused_forward``, ``fused_backward``), which ``passes.py`` runs for the Triton backend.

Forward: GEMM1 gathers x through the plan and applies the activation in its epilogue (saving the
pre-activations unless recompute="fc1"); GEMM2 multiplies by fc2 in expert order; the combine
kernel weights each slot by its router probability and sums a token's K rows (writing the
probabilities in expert order for backward on the way).
Backward: dH = gathered dY @ fc2 with the activation backward, the probability scaling and the
router-probability gradient <dH, h> in the epilogue (partial sums per 128 columns), writing d pre
over the saved pre-activations; dW2 and dW1 as per-expert reductions over gathered rows; dx as
d pre @ fc1 summed per token, the same launch summing the probability gradient's partials.
The only (T*K, d) tensors are transient: the expert-order outputs reduced right after their GEMM,
and, for experts at least as wide as the model, one buffer that holds dY, then x, gathered for
the weight gradients' grouped GEMMs.

fc1 is [E, 2F, D] (gate rows, then up rows) or, for SwiGLU, a (gate, up) pair of [E, F, D]
tensors, as torchtitan keeps them: the kernels read the two halves where they are, and the
gradient comes back as a pair too, so nothing of the weights' size is stacked or split.
"""

from __future__ import annotations

import torch

from .kernels.combine import combine
from .kernels.gather_gemm import EPI_ACT_BWD, EPI_ACT_FWD, expert_order_gemm, gather_gemm, gather_gemm_ds_tiles
from .kernels.fp8 import fp8_gemm, fp8_weight_grad, quantize_rows
from .kernels.fp8_formats import FP8_BLOCK
from .kernels.launch import cdiv
from .kernels.weight_grad import gathered_weight_grad, grouped_weight_grads_apply, weight_grad


def fc1_width(fc1_weight) -> int:
    """fc1's output width (2F for SwiGLU), stacked or as a (gate, up) pair."""
    if isinstance(fc1_weight, tuple):
        return 2 * fc1_weight[0].shape[1]
    return fc1_weight.shape[1]


def fused_forward(x, topk_probs, fc1_weight, fc2_weight, plan, activation, *, save_pre, out_dtype=None):
    """The forward pass over the kernels: ``(y, probs_sorted, pre)``; ``pre`` (the pre-activations,
    for backward) only with ``save_pre``; ``y`` in ``out_dtype`` (x's by default)."""
    x = x.contiguous()
    topk_probs = topk_probs.contiguous()  # the combine kernel indexes it as [T, K] row-major
    rows_total = plan.expert_token_indices.shape[0]
    hidden = x.shape[1]
    ffn = fc2_weight.shape[2]
    pre = x.new_empty(rows_total, fc1_width(fc1_weight)) if save_pre else None
    h = x.new_empty(rows_total, ffn)
    gather_gemm(x, fc1_weight, h, plan, transpose_weight=True, epilogue=EPI_ACT_FWD,
             activation=activation, gather_a=True, pre=pre, store_pre=save_pre, n=ffn)
    expert_out = expert_order_gemm(h, fc2_weight, plan, transpose_weight=True, n=hidden)
    del h
    # Only the plan's used rows are written (and read by backward's epilogue).
    probs_sorted = topk_probs.new_empty(rows_total)
    y = combine(expert_out, plan.token_index_map, topk_probs, out_dtype or x.dtype, probs_sorted=probs_sorted)
    return y, probs_sorted, pre


def fused_backward(grad_y, x, probs_sorted, fc1_weight, fc2_weight, plan, activation, pre, needs):
    """The backward pass over the kernels: ``(grad_x, grad_probs, grad_fc1, grad_fc2)``, each None
    where ``needs`` (four bools, in that order) says so; ``grad_fc1`` a (gate, up) pair where
    ``fc1_weight`` is one. ``probs_sorted``: the probabilities in the plan's expert order; ``pre``:
    the saved pre-activations, overwritten with their gradient, or None to recompute them (the
    first GEMM again)."""
    need_x, need_probs, need_fc1, need_fc2 = needs
    grad_y = grad_y.contiguous()
    rows_total = plan.expert_token_indices.shape[0]
    hidden = x.shape[1]
    ffn = fc2_weight.shape[2]
    halves = fc1_weight if isinstance(fc1_weight, tuple) else (fc1_weight,)
    if pre is None:
        pre = x.new_empty(rows_total, fc1_width(fc1_weight))
        # A pair: each half into its own columns of pre.
        width = pre.shape[1] // len(halves)
        for i, half in enumerate(halves):
            gather_gemm(x, half, pre[:, i * width:], plan, transpose_weight=True, gather_a=True, n=width)
    h_scaled = x.new_empty(rows_total, ffn)
    # The epilogue writes every used row's partials, the only ones read.
    ds_partial = torch.empty(rows_total, gather_gemm_ds_tiles(ffn), dtype=torch.float32, device=x.device)
    # After this launch `pre` holds d pre.
    gather_gemm(grad_y, fc2_weight, h_scaled, plan, transpose_weight=False, epilogue=EPI_ACT_BWD,
             activation=activation, gather_a=True, pre=pre, probs_sorted=probs_sorted,
             ds_partial=ds_partial, n=ffn)
    grad_pre = pre
    grad_x = grad_probs = grad_fc1 = grad_fc2 = None
    # Where the grouped GEMM wins, one transient [T*K, d] buffer takes dY, then x, in expert
    # order: it can raise the peak by its size, still below every peer's (benchmarks/notes/memory.md,
    # "The grouped weight gradients' [T*K, d] buffer raises the peak on coarse shapes").
    grouped = grouped_weight_grads_apply(x, ffn) and (need_fc1 or need_fc2)
    gathered = x.new_empty(rows_total, hidden) if grouped else None
    if need_fc2:
        grad_fc2 = _weight_gradient(fc2_weight, grad_y, h_scaled, plan, gather_a=True, gathered=gathered)
    del h_scaled
    if need_fc1:
        width = grad_pre.shape[1] // len(halves)
        grad_fc1 = tuple(_weight_gradient(half, grad_pre[:, i * width:(i + 1) * width], x, plan, gather_a=False,
                                          gathered=gathered) for i, half in enumerate(halves))
        if len(halves) == 1:
            (grad_fc1,) = grad_fc1
    del gathered
    # probs_sorted has the probabilities' dtype; their gradient comes with dx's combine.
    if need_x:
        if need_probs:
            grad_probs = torch.empty(plan.token_index_map.shape, dtype=probs_sorted.dtype, device=x.device)
        grad_rows = expert_order_gemm(grad_pre, fc1_weight, plan, transpose_weight=False, n=hidden)
        grad_x = combine(grad_rows, plan.token_index_map, None, x.dtype,
                         ds_partial=ds_partial if grad_probs is not None else None, grad_probs=grad_probs)
    elif need_probs:
        grad_probs = plan.unpermute_rows(ds_partial.sum(dim=1)).to(probs_sorted.dtype)
    return grad_x, grad_probs, grad_fc1, grad_fc2


def _weight_gradient(weight, a, b, plan, *, gather_a, gathered):
    """The gradient of ``weight`` from A^T @ B per expert (one operand gathered): through the
    grouped GEMM into ``gathered`` where given, the weight-gradient kernel otherwise."""
    if gathered is not None:
        return gathered_weight_grad(a, b, plan, gather_a=gather_a, buffer=gathered)
    out = weight.new_empty(weight.shape)  # contiguous (and no sympy import on meta stand-ins)
    weight_grad(a, b, out, plan, gather_a=gather_a, gather_b=not gather_a)
    return out


def fused_fp8_forward(x, topk_probs, weights, plan, activation, fmts, *, save_pre, out_dtype=None):
    """The forward pass under the blockwise FP8 recipe: ``fused_forward``'s results. x is quantized
    once ([T, d] codes and scales); fc1's epilogue writes fc2's input as FP8 codes with their scales."""
    fwd = fmts[0]
    x_codes, x_scales = _quantized_rows(x, fwd)
    rows_total = plan.expert_token_indices.shape[0]
    ffn = weights.fc2.codes.shape[2]
    pre = x.new_empty(rows_total, ffn * len(weights.fc1)) if save_pre else None
    h_codes = torch.empty(rows_total, ffn, dtype=torch.uint8, device=x.device)
    h_scales = torch.empty(rows_total, cdiv(ffn, FP8_BLOCK), dtype=torch.float32, device=x.device)
    fc1 = tuple(w.pair for w in weights.fc1)
    fp8_gemm(x_codes, x_scales, fc1 if len(fc1) == 2 else fc1[0], h_codes, plan, epilogue=EPI_ACT_FWD,
             activation=activation, gather_a=True, a_fmt=fwd, b_fmt=weights.fmt, out_scales=h_scales, out_fmt=fwd,
             pre=pre, pre_dtype=x.dtype, store_pre=save_pre)
    expert_out = x.new_empty(rows_total, x.shape[1])
    fp8_gemm(h_codes, h_scales, weights.fc2.pair, expert_out, plan, gather_a=False, a_fmt=fwd, b_fmt=weights.fmt)
    del h_codes, h_scales
    probs_sorted = topk_probs.new_empty(rows_total)
    y = combine(expert_out, plan.token_index_map, topk_probs.contiguous(), out_dtype or x.dtype,
                probs_sorted=probs_sorted)
    return y, probs_sorted, pre


def fused_fp8_backward(grad_y, x, probs_sorted, weights, plan, activation, fmts, pre, needs):
    """The backward pass under the blockwise FP8 recipe: ``fused_backward``'s results, the weight
    gradients in x's dtype as there (fc1's as its quantized parts are: a (gate, up) pair for SwiGLU). dY is quantized
    once; dX quantizes d pre as it loads it; the weight gradients quantize both operands along the
    tokens inside the kernel."""
    fwd, bwd = fmts
    need_x, need_probs, need_fc1, need_fc2 = needs
    grad_y = grad_y.contiguous()
    rows_total = plan.expert_token_indices.shape[0]
    ffn = weights.fc2.codes.shape[2]
    parts = len(weights.fc1)
    if pre is None:
        x_codes, x_scales = _quantized_rows(x, fwd)
        pre = x.new_empty(rows_total, ffn * parts)
        for i, part in enumerate(weights.fc1):
            fp8_gemm(x_codes, x_scales, part.pair, pre[:, i * ffn:], plan, gather_a=True, a_fmt=fwd, b_fmt=weights.fmt)
        del x_codes, x_scales
    dy_codes, dy_scales = _quantized_rows(grad_y, bwd)
    h_scaled = x.new_empty(rows_total, ffn)
    ds_partial = torch.empty(rows_total, cdiv(ffn, FP8_BLOCK), dtype=torch.float32, device=x.device)
    # After this launch `pre` holds d pre.
    fp8_gemm(dy_codes, dy_scales, weights.fc2_t.pair, h_scaled, plan, epilogue=EPI_ACT_BWD, activation=activation,
             gather_a=True, a_fmt=bwd, b_fmt=weights.fmt, pre=pre, probs_sorted=probs_sorted, ds_partial=ds_partial)
    del dy_codes, dy_scales
    grad_pre = pre
    grad_x = grad_probs = grad_fc1 = grad_fc2 = None
    if need_fc2:
        grad_fc2 = x.new_empty(weights.fc2.codes.shape)
        fp8_weight_grad(grad_y, h_scaled, grad_fc2, plan, gather_a=True, gather_b=False, a_fmt=bwd, b_fmt=fwd)
    del h_scaled
    if need_fc1:
        grad_fc1 = []
        for i in range(parts):
            out = x.new_empty(weights.fc1[i].codes.shape)
            fp8_weight_grad(grad_pre[:, i * ffn:(i + 1) * ffn], x, out, plan, gather_a=False, gather_b=True,
                            a_fmt=bwd, b_fmt=fwd)
            grad_fc1.append(out)
        grad_fc1 = tuple(grad_fc1) if parts == 2 else grad_fc1[0]
    if need_x:
        if need_probs:
            grad_probs = torch.empty(plan.token_index_map.shape, dtype=probs_sorted.dtype, device=x.device)
        grad_rows = x.new_empty(rows_total, x.shape[1])
        fc1_t = tuple(w.pair for w in weights.fc1_t)
        fp8_gemm(grad_pre, None, fc1_t if parts == 2 else fc1_t[0], grad_rows, plan, gather_a=False,
                 a_fmt=bwd, b_fmt=weights.fmt, split_k=parts == 2)
        grad_x = combine(grad_rows, plan.token_index_map, None, x.dtype,
                         ds_partial=ds_partial if grad_probs is not None else None, grad_probs=grad_probs)
    elif need_probs:
        grad_probs = plan.unpermute_rows(ds_partial.sum(dim=1)).to(probs_sorted.dtype)
    return grad_x, grad_probs, grad_fc1, grad_fc2


def _quantized_rows(x, fmt):
    """x [T, d] as FP8 codes and inverse scales (1x128 blocks), by the kernel."""
    x = x.contiguous()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(x.shape[0], cdiv(x.shape[1], FP8_BLOCK), dtype=torch.float32, device=x.device)
    quantize_rows(x, codes, scales, fmt)
    return codes, scales
