"""The fused MoE expert MLP over the Triton kernels: its forward and backward passes as functions
(``fused_forward``, ``fused_backward``) and the autograd Function over them (``TritonMoEMLP``).

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

import importlib
import sys

import torch

from .kernels import launch
from .kernels.combine import combine
from .kernels.launch import next_pow2, stand_in
from .kernels.gather_gemm import EPI_ACT_BWD, EPI_ACT_FWD, expert_order_gemm, gather_gemm, gather_gemm_ds_tiles
from .kernels.weight_grad import gathered_weight_grad, grouped_weight_grads_apply, weight_grad
from .routing import RoutingPlan


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
    # order: it can raise the peak by its size (still below every peer's; benchmarks/NOTES.md).
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


# The layers whose kernels were handed to the compile workers (``prefetch_layer_kernels``).
_prefetched: set = set()


# What torch's first backward imports (``autograd._make_grads``; sympy with it: seconds, once per
# process): imported while this process waits on the compile workers instead.
BACKWARD_IMPORT = "torch.fx.experimental.symbolic_shapes"


def prefetch_layer_kernels(x, topk_probs, fc1_weight, fc2_weight, plan, activation, recompute, needs) -> int:
    """At a layer's first call of its kind, hand every kernel its forward and backward will launch
    (``layer_launches``) to the compile workers at once, instead of one launch's configs after
    another as each comes, so that they compile side by side while this pass runs; returns how
    many compiles were submitted. The kind is what the kernels specialize on or tune by (dtypes,
    widths, experts, top-k, the rows' power-of-two bucket and 16-divisibility, the options): a
    token count that changes every step does not repeat it."""
    if not x.is_cuda or not launch.compile_workers.enabled():
        return 0
    rows = plan.expert_token_indices.shape[0]
    key = (x.device, x.dtype, topk_probs.dtype, isinstance(fc1_weight, tuple), activation, recompute, tuple(needs),
           x.shape[1], fc2_weight.shape[2], plan.num_experts, plan.topk, next_pow2(rows), rows % 16, x.shape[0] % 16)
    if key in _prefetched:
        return 0
    _prefetched.add(key)
    submitted = launch.prefetch(layer_launches(x, topk_probs, fc1_weight, fc2_weight, plan, activation, recompute,
                                               needs))
    if submitted and any(needs) and BACKWARD_IMPORT not in sys.modules:
        launch.compile_workers.run_while_waiting(lambda: importlib.import_module(BACKWARD_IMPORT))
    return submitted


def layer_launches(x, topk_probs, fc1_weight, fc2_weight, plan, activation, recompute, needs) -> list:
    """The ``KernelCall``s that ``TritonMoEMLP``'s forward, then backward (where ``needs`` asks for
    any gradient), launch for these arguments, in order: the same passes run on meta tensors
    standing for them inside ``launch.recording``, so nothing runs and nothing is allocated. A
    launcher that cannot follow meta tensors ends the list early."""
    fc1 = tuple(map(stand_in, fc1_weight)) if isinstance(fc1_weight, tuple) else stand_in(fc1_weight)
    xs, fc2, plan = stand_in(x), stand_in(fc2_weight), RoutingPlan(*map(stand_in, plan.tensors()))

    def passes():
        y, probs_sorted, pre = fused_forward(xs, stand_in(topk_probs), fc1, fc2, plan, activation,
                                             save_pre=recompute == "activation")
        if any(needs):
            # new_empty, not empty_like: on meta tensors the latter imports sympy (seconds).
            fused_backward(y.new_empty(y.shape), xs, probs_sorted, fc1, fc2, plan, activation, pre, needs)

    return launch.recorded_launches(x.device, passes)


class TritonMoEMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_probs, fc1_weight, fc2_weight, plan, activation, recompute):
        prefetch_layer_kernels(x, topk_probs, fc1_weight, fc2_weight, plan, activation, recompute,
                               ctx.needs_input_grad[:4])
        x = x.contiguous()
        y, probs_sorted, pre = fused_forward(x, topk_probs, fc1_weight, fc2_weight, plan, activation,
                                             save_pre=recompute == "activation")
        ctx.save_for_backward(x, probs_sorted, fc1_weight, fc2_weight, pre, *plan.tensors())
        ctx.activation = activation
        ctx.pre_overwritten = False
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, probs_sorted, fc1_weight, fc2_weight, pre, *plan_tensors = ctx.saved_tensors
        if ctx.pre_overwritten:
            # A second backward through the same graph (retain_graph=True, gradcheck): the first
            # one turned the saved pre-activations into their gradient, so recompute them.
            pre = None
        ctx.pre_overwritten = True
        grads = fused_backward(grad_y, x, probs_sorted, fc1_weight, fc2_weight, RoutingPlan(*plan_tensors),
                               ctx.activation, pre, ctx.needs_input_grad[:4])
        return (*grads, None, None, None)


def _weight_gradient(weight, a, b, plan, *, gather_a, gathered):
    """The gradient of ``weight`` from A^T @ B per expert (one operand gathered): through the
    grouped GEMM into ``gathered`` where given, the weight-gradient kernel otherwise."""
    if gathered is not None:
        return gathered_weight_grad(a, b, plan, gather_a=gather_a, buffer=gathered)
    out = weight.new_empty(weight.shape)  # contiguous (and no sympy import on meta stand-ins)
    weight_grad(a, b, out, plan, gather_a=gather_a, gather_b=not gather_a)
    return out
