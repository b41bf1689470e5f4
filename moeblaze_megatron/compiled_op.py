"""The MoE expert MLP as two ``torch.library`` custom ops, which ``moe_mlp`` runs under
``torch.compile``.

torch.compile cannot trace the op's eager path: the routing plan's per-expert row ranges are
data-dependent and the kernels launch through our own launcher. torchtitan compiles each
transformer block with ``fullgraph=True``, where any graph break is an error. Here the forward and
the backward are one opaque op each. Their outputs have shapes fixed by the inputs' (the plan's
index maps, the pre-activations, the probabilities in expert order), so the compiled graph holds
them like any other op. The ops run the same passes as the eager autograd Function
(``passes.build_plan``, ``passes.forward``, ``passes.backward``), so a compiled model computes
what the eager one does.

fc1 is ``w1`` alone ([E, 2F, D] for SwiGLU, [E, F, D] otherwise) or, for SwiGLU, the (gate, up)
pair ``w1``, ``w3`` [E, F, D]; fc2 is ``w2`` [E, D, F]. The weights are cast to x's dtype inside
the ops, in forward and again in backward, so only the parameters are kept between them.
``used_slots``: a 0-d int64 CPU tensor holding how many of the ids are used (rows received in an
expert-parallel exchange), which cuts the expert-order buffers; their size is then data-dependent
under compile.
"""

from __future__ import annotations

import torch

from . import passes
from .passes import PassOptions
from .routing import RoutingPlan

__all__ = ["compiled_moe_mlp"]


def compiled_moe_mlp(x, topk_ids, topk_probs, fc1, fc2, options: PassOptions, used_slots=None):
    """``moe_mlp``'s result through the custom ops (arguments checked by ``moe_mlp``)."""
    w1, w3 = fc1 if isinstance(fc1, tuple) else (fc1, None)
    y, *_ = torch.ops.moeblaze.moe_mlp_forward(x, topk_ids, topk_probs, w1, w3, fc2, options.activation,
                                                options.save_pre, options.backend, options.routing_method,
                                                used_slots, options.fp8)
    return y


def _fc1_width(w1, w3):
    return w1.shape[1] * (2 if w3 is not None else 1)


def _fc1(w1, w3):
    return w1 if w3 is None else (w1, w3)


def _maps(plan, topk_ids):
    """The plan's index maps with the fake implementation's (contiguous) strides: the PyTorch
    build keeps the strides of column-major ids, which a compiled graph may pass. A custom op's
    output may not alias an input: int32 ids are the plan's token_expert_indices themselves."""
    ids = topk_ids.untyped_storage()._cdata
    return tuple(t.clone() if t.untyped_storage()._cdata == ids else t.contiguous() for t in plan.tensors())


def _empty(x):
    return x.new_empty(0)


@torch.library.custom_op("moeblaze::moe_mlp_forward", mutates_args=())
def _forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_probs: torch.Tensor, w1: torch.Tensor,
             w3: torch.Tensor | None, w2: torch.Tensor, activation: str, save_pre: bool, backend: str,
             routing_method: str, used_slots: torch.Tensor | None, fp8: str | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, probs in expert order (empty for the reference), pre-activations or an empty tensor,
    the plan's four maps); the expert-order ones cut to ``used_slots`` where given. ``fp8``: the
    passes' FP8 format (None: the GEMMs in x's dtype)."""
    options = PassOptions(activation, save_pre, backend, routing_method, fp8)
    fc1, fc2 = passes.compute_weights(_fc1(w1, w3), w2, x.dtype, backend, fp8)
    x, topk_probs = x.contiguous(), topk_probs.contiguous()
    plan = passes.build_plan(x, topk_ids, topk_probs, fc1, fc2, w1.shape[0], options, (True,) * 4,
                             None if used_slots is None else int(used_slots))
    y, probs_sorted, pre = passes.forward(x, topk_probs, fc1, fc2, plan, options)
    return (y, probs_sorted if probs_sorted is not None else _empty(topk_probs), pre if pre is not None else _empty(x),
            *_maps(plan, topk_ids))


@_forward.register_fake
def _forward_fake(x, topk_ids, topk_probs, w1, w3, w2, activation, save_pre, backend, routing_method, used_slots,
                  fp8=None):
    slots = topk_ids.numel() if used_slots is None else torch.library.get_ctx().new_dynamic_size()
    index = dict(dtype=torch.int32, device=topk_ids.device)
    sorted_slots = slots if backend == "triton" else 0
    pre = x.new_empty(slots, _fc1_width(w1, w3)) if save_pre else _empty(x)
    return (x.new_empty(x.shape), topk_probs.new_empty(sorted_slots), pre, torch.empty(slots, **index),
            torch.empty(w1.shape[0] + 1, **index), torch.empty(topk_ids.shape, **index),
            torch.empty(topk_ids.shape, **index))


@torch.library.custom_op("moeblaze::moe_mlp_backward", mutates_args=("pre",))
def _backward(grad_y: torch.Tensor, x: torch.Tensor, topk_probs: torch.Tensor, probs_sorted: torch.Tensor,
              w1: torch.Tensor, w3: torch.Tensor | None, w2: torch.Tensor, pre: torch.Tensor,
              plan_tensors: list[torch.Tensor], activation: str, save_pre: bool, backend: str,
              needs: list[bool], fp8: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor]:
    """(grad x, grad probs, grad w1, grad w3, grad w2), an empty tensor for each one ``needs``
    (x, probs, w1, w3, w2) does not ask for. The kernels turn ``pre`` (when saved) into its
    gradient in place: it is declared mutated."""
    options = PassOptions(activation, save_pre, backend, fp8=fp8)
    plan = RoutingPlan(*plan_tensors)
    fc1, fc2 = passes.compute_weights(_fc1(w1, w3), w2, x.dtype, backend, fp8)
    need_x, need_probs, need_w1, need_w3, need_w2 = needs
    grads = passes.backward(grad_y, x, topk_probs.contiguous(), probs_sorted if backend == "triton" else None, fc1,
                            fc2, plan, pre if save_pre else None, options,
                            (need_x, need_probs, need_w1 or need_w3, need_w2))
    grad_x, grad_probs, grad_fc1, grad_fc2 = grads
    grad_fc1 = passes.as_fc1_form(grad_fc1, _fc1(w1, w3))
    grad_w1, grad_w3 = grad_fc1 if isinstance(grad_fc1, tuple) else (grad_fc1, None)
    out = []
    for grad, like, need in ((grad_x, x, need_x), (grad_probs, topk_probs, need_probs), (grad_w1, w1, need_w1),
                             (grad_w3, w3, need_w3), (grad_fc2, w2, need_w2)):
        out.append(grad.to(like.dtype).contiguous() if need else _empty(x))
    return tuple(out)


@_backward.register_fake
def _backward_fake(grad_y, x, topk_probs, probs_sorted, w1, w3, w2, pre, plan_tensors, activation, save_pre, backend,
                   needs, fp8=None):
    likes = (x, topk_probs, w1, w3, w2)
    return tuple(like.new_empty(like.shape) if need else _empty(x) for like, need in zip(likes, needs))


def _setup_context(ctx, inputs, output):
    x, _, topk_probs, w1, w3, w2, activation, save_pre, backend, _, _, fp8 = inputs
    _, probs_sorted, pre, *plan_tensors = output
    ctx.save_for_backward(x, topk_probs, probs_sorted, w1, w3, w2, pre, *plan_tensors)
    ctx.options = (activation, save_pre, backend)
    ctx.fp8 = fp8
    ctx.mark_non_differentiable(*output[1:])


def _backward_of_forward(ctx, grad_y, *_):
    x, topk_probs, probs_sorted, w1, w3, w2, pre, *plan_tensors = ctx.saved_tensors
    need = ctx.needs_input_grad
    needs = [need[0], need[2], need[3], w3 is not None and need[4], need[5]]
    if grad_y is None:
        grad_y = torch.zeros_like(x)
    grads = torch.ops.moeblaze.moe_mlp_backward(grad_y, x, topk_probs, probs_sorted, w1, w3, w2, pre, plan_tensors,
                                                *ctx.options, needs, ctx.fp8)
    grad_x, grad_probs, grad_w1, grad_w3, grad_w2 = (g if n else None for g, n in zip(grads, needs))
    return grad_x, None, grad_probs, grad_w1, grad_w3, grad_w2, None, None, None, None, None, None


_forward.register_autograd(_backward_of_forward, setup_context=_setup_context)
