"""Pure-PyTorch MoE expert MLP over a routing plan (its forward and backward passes, which
``passes.py`` runs for the reference backend): the CPU path and the kernels' test oracle.

It follows the same memory discipline as the fused kernels: it gathers each expert's rows of x
on the fly, saves for backward only the pre-activations (or nothing, with recompute="fc1"), the
plan and the probabilities, and never expands dY to (T*K, d). Expert outputs and input gradients
are produced in the plan's expert order and summed per token through ``token_index_map`` in slot
order k = 0..K-1, so the result is deterministic on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import dequantize_columns, dequantize_rows, quantize_rows



def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Float32 for 16-bit inputs (what the kernels accumulate in), the input's own dtype otherwise."""
    return torch.float32 if dtype.itemsize < 4 else dtype


def activation_forward(pre: torch.Tensor, activation: str) -> torch.Tensor:
    """act(pre) in compute precision; for SwiGLU ``pre`` is [gate | up] along the last dimension."""
    pre = pre.to(compute_dtype(pre.dtype))
    if activation == "swiglu":
        gate, up = pre.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "silu":
        return F.silu(pre)
    return F.gelu(pre)


def activation_backward(pre: torch.Tensor, grad_h: torch.Tensor, activation: str) -> torch.Tensor:
    """d act(pre) / d pre applied to ``grad_h``, recomputing silu/gelu from ``pre``."""
    pre = pre.to(compute_dtype(pre.dtype))
    grad_h = grad_h.to(pre.dtype)
    if activation == "swiglu":
        gate, up = pre.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        d_gate = grad_h * up * sig * (1 + gate * (1 - sig))
        return torch.cat([d_gate, grad_h * silu], dim=-1)
    if activation == "silu":
        sig = torch.sigmoid(pre)
        return grad_h * sig * (1 + pre * (1 - sig))
    cdf = 0.5 * (1 + torch.erf(pre * 0.7071067811865476))
    pdf = torch.exp(-0.5 * pre * pre) * 0.3989422804014327
    return grad_h * (cdf + pre * pdf)


def sum_slots(rows: torch.Tensor, slot: torch.Tensor, probs=None, out_dtype=None) -> torch.Tensor:
    """``out[t] = sum_j probs[t, j] * rows[slot[t, j]]`` over the slots >= 0, j ascending, in compute
    precision: the combine kernel's reference (a token's K expert rows through ``token_index_map``)
    and the expert-parallel per-token sum (a token's partials from each rank, in rank order)."""
    acc = compute_dtype(rows.dtype)
    out = torch.zeros((slot.shape[0], *rows.shape[1:]), dtype=acc, device=rows.device)
    if rows.shape[0] > 0:
        for j in range(slot.shape[1]):
            pos = slot[:, j].long()
            used = (pos >= 0).view(-1, *([1] * (rows.dim() - 1)))
            # where, not a multiply: an unused slot must not pick up a non-finite row 0.
            part = torch.where(used, rows[pos.clamp(min=0)].to(acc), 0)
            out += part if probs is None else part * probs[:, j, None].to(acc)
    return out.to(out_dtype or rows.dtype)


def _expert_ranges(offsets: torch.Tensor):
    bounds = offsets.tolist()
    return [(e, s, t) for e, (s, t) in enumerate(zip(bounds[:-1], bounds[1:])) if t > s]


def reference_forward(x, topk_probs, fc1_weight, fc2_weight, plan, activation, *, save_pre, out_dtype=None):
    """The forward pass: ``(y, pre)``, ``pre`` (the pre-activations in expert order) only with
    ``save_pre``; ``y`` in ``out_dtype`` (x's by default)."""
    rows_total = plan.expert_token_indices.shape[0]
    width = fc1_weight.shape[1]
    pre_all = x.new_empty(rows_total, width) if save_pre else None
    out_rows = x.new_empty(rows_total, x.shape[1])
    for e, s, t in _expert_ranges(plan.expert_token_offsets):
        pre = x[plan.expert_token_indices[s:t].long()] @ fc1_weight[e].t()
        if save_pre:
            pre_all[s:t] = pre
        out_rows[s:t] = activation_forward(pre, activation).to(x.dtype) @ fc2_weight[e].t()
    y = sum_slots(out_rows, plan.token_index_map, topk_probs, out_dtype=out_dtype or x.dtype)
    return y, pre_all


def reference_backward(grad_y, x, topk_probs, fc1_weight, fc2_weight, plan, activation, pre_all):
    """The backward pass: ``(grad_x, grad_probs, grad_fc1, grad_fc2)``; ``pre_all`` the saved
    pre-activations, or None to recompute them."""
    grad_y = grad_y.contiguous()
    probs_sorted = plan.permute_probs(topk_probs)
    rows_total = plan.expert_token_indices.shape[0]
    grad_x_rows = x.new_empty(rows_total, x.shape[1])
    acc = compute_dtype(x.dtype)
    grad_probs_sorted = torch.empty(rows_total, dtype=acc, device=x.device)
    grad_fc1 = torch.zeros_like(fc1_weight)
    grad_fc2 = torch.zeros_like(fc2_weight)
    for e, s, t in _expert_ranges(plan.expert_token_offsets):
        tokens = plan.expert_token_indices[s:t].long()
        x_e = x[tokens]
        grad_y_e = grad_y[tokens]
        pre = pre_all[s:t] if pre_all is not None else x_e @ fc1_weight[e].t()
        h = activation_forward(pre, activation)
        grad_h_unscaled = (grad_y_e @ fc2_weight[e]).to(acc)
        grad_probs_sorted[s:t] = (grad_h_unscaled * h).sum(dim=1)
        p = probs_sorted[s:t, None].to(acc)
        grad_fc2[e] = (grad_y_e.t() @ (h * p).to(x.dtype)).to(grad_fc2.dtype)
        grad_pre = activation_backward(pre, grad_h_unscaled * p, activation).to(x.dtype)
        grad_fc1[e] = (grad_pre.t() @ x_e).to(grad_fc1.dtype)
        grad_x_rows[s:t] = grad_pre @ fc1_weight[e]
    grad_x = sum_slots(grad_x_rows, plan.token_index_map, out_dtype=x.dtype)
    grad_probs = plan.unpermute_rows(grad_probs_sorted).to(topk_probs.dtype)
    return grad_x, grad_probs, grad_fc1, grad_fc2


def reference_fp8_forward(x, topk_probs, weights, plan, activation, fmts, *, save_pre, out_dtype=None):
    """The forward pass under the blockwise FP8 recipe (``fp8.py``): ``(y, pre)`` as
    ``reference_forward``'s. ``weights``: ``fp8.Fp8ExpertWeights``; ``fmts``: (forward, gradient)
    formats. Each GEMM multiplies the dequantized operands in float64; pre is stored in x's dtype
    and fc2's input is act(pre) quantized per 128 columns, as the kernels do."""
    fwd = fmts[0]
    x_q = dequantize_rows(*quantize_rows(x, fwd), fwd)
    fc1 = torch.cat([w.dequantized(weights.fmt) for w in weights.fc1], dim=1)
    fc2 = weights.fc2.dequantized(weights.fmt)
    rows_total = plan.expert_token_indices.shape[0]
    pre_all = x.new_empty(rows_total, fc1.shape[1]) if save_pre else None
    out_rows = x.new_empty(rows_total, x.shape[1])
    for e, s, t in _expert_ranges(plan.expert_token_offsets):
        pre = (x_q[plan.expert_token_indices[s:t].long()] @ fc1[e].t()).to(x.dtype)
        if save_pre:
            pre_all[s:t] = pre
        h = activation_forward(pre, activation)
        out_rows[s:t] = (dequantize_rows(*quantize_rows(h, fwd), fwd) @ fc2[e].t()).to(x.dtype)
    y = sum_slots(out_rows, plan.token_index_map, topk_probs, out_dtype=out_dtype or x.dtype)
    return y, pre_all


def reference_fp8_backward(grad_y, x, topk_probs, weights, plan, activation, fmts, pre_all):
    """The backward pass under the blockwise FP8 recipe: ``reference_backward``'s results. dY is
    quantized once per row; dX's operand d pre per 128 columns of each half; the weight
    gradients' operands per column over each 128 of an expert's rows."""
    fwd, bwd = fmts
    dy_q = dequantize_rows(*quantize_rows(grad_y.contiguous(), bwd), bwd)
    x_q = dequantize_rows(*quantize_rows(x, fwd), fwd) if pre_all is None else None
    fc1 = torch.cat([w.dequantized(weights.fmt) for w in weights.fc1], dim=1)
    fc2 = weights.fc2.dequantized(weights.fmt)
    parts = len(weights.fc1)
    probs_sorted = plan.permute_probs(topk_probs)
    rows_total = plan.expert_token_indices.shape[0]
    grad_x_rows = x.new_empty(rows_total, x.shape[1])
    acc = compute_dtype(x.dtype)
    grad_probs_sorted = torch.empty(rows_total, dtype=acc, device=x.device)
    grad_fc1 = torch.zeros(fc1.shape, dtype=torch.float64, device=x.device)
    grad_fc2 = torch.zeros(fc2.shape, dtype=torch.float64, device=x.device)
    for e, s, t in _expert_ranges(plan.expert_token_offsets):
        tokens = plan.expert_token_indices[s:t].long()
        pre = pre_all[s:t] if pre_all is not None else (x_q[tokens] @ fc1[e].t()).to(x.dtype)
        h = activation_forward(pre, activation)
        # dH rounded to x's dtype, as the kernels' epilogue takes it.
        grad_h = (dy_q[tokens] @ fc2[e]).to(x.dtype).to(acc)
        grad_probs_sorted[s:t] = (grad_h * h).sum(dim=1)
        p = probs_sorted[s:t, None].to(acc)
        h_scaled = (h * p).to(x.dtype)
        grad_fc2[e] = dequantize_columns(grad_y[tokens], bwd).t() @ dequantize_columns(h_scaled, fwd)
        grad_pre = activation_backward(pre, grad_h * p, activation).to(x.dtype)
        grad_fc1[e] = dequantize_columns(grad_pre, bwd).t() @ dequantize_columns(x[tokens], fwd)
        grad_pre_q = torch.cat([dequantize_rows(*quantize_rows(half.contiguous(), bwd), bwd)
                                for half in grad_pre.chunk(parts, dim=1)], dim=1)
        grad_x_rows[s:t] = (grad_pre_q @ fc1[e]).to(x.dtype)
    grad_x = sum_slots(grad_x_rows, plan.token_index_map, out_dtype=x.dtype)
    grad_probs = plan.unpermute_rows(grad_probs_sorted).to(topk_probs.dtype)
    return grad_x, grad_probs, grad_fc1, grad_fc2
