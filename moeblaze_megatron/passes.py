"""The expert MLP's forward and backward passes over a backend: the fused Triton kernels
(``fused.py``) or the pure-PyTorch reference (``reference.py``).

Every path that runs the experts runs these: the op's autograd Function (``moe_mlp.py``), its
``torch.library`` custom ops for torch.compile (``compiled_op.py``) and the ring's hops
(``parallel/ring.py``). So a compiled model, an eager one and a ring hop compute the same bits.

The options arrive derived and typed (``PassOptions``): the backend resolved for the tensors'
device and dtype, and whether the pre-activations are kept, derived once from ``recompute``.
fc1 is [E, 2F, D] ([gate | up] rows for SwiGLU) or, for SwiGLU, the (gate, up) pair of [E, F, D]
tensors (torchtitan's w1 and w3): the kernels read the two halves where they are; the reference
takes them stacked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import warmup
from .config import saves_pre_activations
from .fp8 import expert_weights, format_ids
from .reference import reference_backward, reference_forward, reference_fp8_backward, reference_fp8_forward
from .routing import RoutingPlan, build_routing_plan

__all__ = ["PassOptions", "TRITON_DTYPES", "as_fc1_form", "backward", "build_plan", "compute_weights", "forward",
           "pass_options", "resolved_backend"]

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PassOptions:
    """What the passes need of the options: the activation ('swiglu', 'silu', 'gelu'), whether the
    forward keeps the pre-activations for backward, the backend that runs ('triton' or
    'reference') and how routing plans are built (``routing.ROUTING_METHODS``)."""

    activation: str
    save_pre: bool
    backend: str
    routing_method: str = "auto"
    fp8: str | None = None


def resolved_backend(x: torch.Tensor, backend: str) -> str:
    """The backend that runs for ``backend`` on ``x``: "auto" is "triton" for CUDA tensors of a
    dtype the kernels take, "reference" otherwise."""
    if backend == "auto":
        return "triton" if x.is_cuda and x.dtype in TRITON_DTYPES else "reference"
    return backend


def pass_options(x, activation: str, recompute: str, backend: str, routing_method: str = "auto",
                 fp8: str | None = None) -> PassOptions:
    """The options (already checked) as the passes take them, for tensors like ``x``."""
    return PassOptions(activation, saves_pre_activations(recompute), resolved_backend(x, backend), routing_method, fp8)


def compute_weights(fc1, fc2, dtype, backend: str, fp8: str | None = None):
    """(fc1, fc2) in ``dtype`` as ``backend`` takes them: a (gate, up) pair stays a pair for the
    kernels and is stacked [gate | up] for the reference. A weight already in ``dtype`` is used
    as it is (no copy). Under ``fp8``: (the quantized weights, ``fp8.Fp8ExpertWeights``, cached
    until the next optimizer step; None)."""
    if fp8 is not None:
        return expert_weights(fc1, fc2, format_ids(fp8)[0]), None
    if isinstance(fc1, tuple):
        fc1 = tuple(w.to(dtype) for w in fc1) if backend == "triton" else torch.cat(fc1, dim=1).to(dtype)
    else:
        fc1 = fc1.to(dtype)
    return fc1, fc2.to(dtype)


def as_fc1_form(grad_fc1, fc1):
    """fc1's gradient in fc1's form: split into (gate, up) where fc1 is a pair and the backend
    gave it stacked, stacked where fc1 is one tensor and the backend gave a pair."""
    if grad_fc1 is None or isinstance(fc1, tuple) == isinstance(grad_fc1, tuple):
        return grad_fc1
    if isinstance(grad_fc1, tuple):
        return torch.cat(grad_fc1, dim=1)
    return tuple(grad_fc1.split(fc1[0].shape[1], dim=1))


def build_plan(x, topk_ids, topk_probs, fc1, fc2, num_experts: int, options: PassOptions, needs,
               used_slots: int | None = None) -> RoutingPlan:
    """The routing plan of ``topk_ids`` (values not checked), its expert-order entries cut to
    ``used_slots`` where the caller knows how many are used; at a layer's first call of its kind
    the kernels it will launch go to the compile workers first (``warmup.prepare``)."""
    rows = topk_ids.numel() if used_slots is None else used_slots
    method = warmup.prepare(x, topk_ids, topk_probs, fc1, fc2, num_experts, rows, options, needs)
    plan = build_routing_plan(topk_ids, num_experts, method=method, validate=False)
    return plan if used_slots is None else plan.trimmed(used_slots)


def _nothing_routed(x, plan) -> bool:
    # The kernels take no empty grid: no rows, or a plan cut to no used slots.
    return x.shape[0] == 0 or plan.expert_token_indices.shape[0] == 0


def _ffn(fc1, fc2) -> int:
    return (fc2 if fc2 is not None else fc1).shape[2]


def forward(x, topk_probs, fc1, fc2, plan, options: PassOptions, out_dtype=None):
    """The forward pass: ``(y, probs in the plan's expert order, pre)``, ``pre`` (the
    pre-activations, for backward) only with ``options.save_pre``; ``y`` in ``out_dtype`` (x's by
    default). Weights in x's dtype, in the backend's form (``compute_weights``)."""
    if _nothing_routed(x, plan):
        width = 2 * _ffn(fc1, fc2) if options.activation == "swiglu" else _ffn(fc1, fc2)
        pre = x.new_empty(0, width) if options.save_pre else None
        return x.new_zeros(x.shape, dtype=out_dtype or x.dtype), topk_probs.new_empty(0), pre
    if options.fp8 is not None:
        fmts = format_ids(options.fp8)
        if options.backend == "triton":
            from .fused import fused_fp8_forward

            return fused_fp8_forward(x, topk_probs, fc1, plan, options.activation, fmts, save_pre=options.save_pre,
                                     out_dtype=out_dtype)
        y, pre = reference_fp8_forward(x, topk_probs, fc1, plan, options.activation, fmts,
                                       save_pre=options.save_pre, out_dtype=out_dtype)
        return y, None, pre
    if options.backend == "triton":
        from .fused import fused_forward  # imports Triton: only when the kernels run

        return fused_forward(x, topk_probs, fc1, fc2, plan, options.activation, save_pre=options.save_pre,
                             out_dtype=out_dtype)
    y, pre = reference_forward(x, topk_probs, fc1, fc2, plan, options.activation, save_pre=options.save_pre,
                               out_dtype=out_dtype)
    return y, None, pre


def backward(grad_y, x, topk_probs, probs_sorted, fc1, fc2, plan, pre, options: PassOptions, needs):
    """The backward pass: ``(grad_x, grad_probs, grad_fc1, grad_fc2)``, None where ``needs`` (four
    bools, in that order) says so. ``probs_sorted``: what the forward gave (None: computed from
    ``topk_probs``); ``pre``: the saved pre-activations, overwritten by the kernels with their
    gradient, or None to recompute them (the first GEMM again)."""
    if _nothing_routed(x, plan):
        if options.fp8 is not None:
            zeros = lambda w: x.new_zeros(w.codes.shape)  # noqa: E731
            weight_grads = tuple(map(zeros, fc1.fc1)), zeros(fc1.fc2)
        else:
            weight_grads = (tuple(map(torch.zeros_like, fc1)) if isinstance(fc1, tuple) else torch.zeros_like(fc1),
                            torch.zeros_like(fc2))
        grads = (torch.zeros_like(x), torch.zeros_like(topk_probs), *weight_grads)
    elif options.fp8 is not None:
        fmts = format_ids(options.fp8)
        if options.backend == "triton":
            from .fused import fused_fp8_backward

            if probs_sorted is None:
                probs_sorted = plan.permute_probs(topk_probs.contiguous())
            grads = fused_fp8_backward(grad_y, x.contiguous(), probs_sorted, fc1, plan, options.activation, fmts, pre,
                                       needs)
        else:
            grads = reference_fp8_backward(grad_y, x, topk_probs, fc1, plan, options.activation, fmts, pre)
    elif options.backend == "triton":
        from .fused import fused_backward

        if probs_sorted is None:
            probs_sorted = plan.permute_probs(topk_probs.contiguous())
        grads = fused_backward(grad_y, x.contiguous(), probs_sorted, fc1, fc2, plan, options.activation, pre, needs)
    else:
        grads = reference_backward(grad_y, x, topk_probs, fc1, fc2, plan, options.activation, pre)
    return tuple(g if need else None for g, need in zip(grads, needs))
