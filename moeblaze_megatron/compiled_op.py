"""The MoE expert MLP as two ``torch.library`` custom ops, for models under ``torch.compile``.

torch.compile cannot trace the op's autograd Functions (``TritonMoEMLP``, ``ReferenceMoEMLP``):
the routing plan's per-expert row ranges are data-dependent and the kernels launch through our own
launcher. torchtitan compiles each transformer block with ``fullgraph=True``, where any graph
break is an error. Here the forward and the backward are one opaque op each. Their outputs have
shapes fixed by the inputs' (the plan's index maps, the pre-activations, the probabilities in
expert order), so the compiled graph holds them like any other op. The ops call the same passes as
the autograd Functions (``fused_forward`` / ``fused_backward``, ``reference_forward`` /
``reference_backward``), so a compiled model computes what the eager one does. The torchtitan
override calls them only while compiling; eager it keeps the autograd Functions, which skip the
dispatcher and save nothing for a weight cast.

``expert_mlp(x, topk_ids, topk_probs, w1, w3, w2, ...)``: fc1 is ``w1`` alone ([E, 2F, D] for
SwiGLU, [E, F, D] otherwise) or, for SwiGLU, the (gate, up) pair ``w1``, ``w3`` [E, F, D]
(torchtitan's ``GroupedExperts``); fc2 is ``w2`` [E, D, F]. The weights are cast to x's dtype
inside the op, in forward and again in backward, so only the parameters are kept between them.
"""

from __future__ import annotations

import torch

from .moe_mlp import check_split_moe_mlp_args, resolved_backend, split_fc1
from .reference import reference_backward, reference_forward
from .routing import RoutingPlan, build_routing_plan

__all__ = ["checked_expert_mlp", "expert_mlp"]

_FORWARD = "moeblaze::expert_mlp_forward"
_BACKWARD = "moeblaze::expert_mlp_backward"


def expert_mlp(x, topk_ids, topk_probs, w1, w3, w2, activation="swiglu", *, recompute="activation",
               routing_method="auto", backend="auto", used_slots=None):
    """``y[t] = sum_k topk_probs[t, k] * fc2[e] @ act(fc1[e] @ x[t])``, ``e = topk_ids[t, k]`` (-1:
    an unused slot; the ids' values are not checked, as moe_mlp's with validate=False), as one op
    that torch.compile keeps whole. Differentiable in x, topk_probs, w1, w3 and w2; the weights'
    gradients come back in their own dtype.

    ``used_slots``: a 0-d int64 CPU tensor holding how many of the ids are used, where the caller
    knows it (rows received in an expert-parallel exchange, -1 padded): the expert-order buffers
    (the saved pre-activations among them) are cut to it instead of T * K. Their size is then
    data-dependent under compile. It must be exact and is not checked (a check would synchronize
    with the host), as the ring's per-hop counts."""
    check_split_moe_mlp_args(x, topk_ids, topk_probs, w1, w3, w2, activation, None, recompute, backend)
    if used_slots is not None and (not isinstance(used_slots, torch.Tensor) or used_slots.dim() != 0
                                   or used_slots.dtype != torch.int64 or used_slots.device.type != "cpu"):
        raise TypeError("used_slots must be a 0-d int64 CPU tensor (or None), got "
                        f"{_describe(used_slots)}")
    return checked_expert_mlp(x, topk_ids, topk_probs, w1, w3, w2, activation, recompute, routing_method, backend,
                              used_slots)


def checked_expert_mlp(x, topk_ids, topk_probs, w1, w3, w2, activation, recompute, routing_method, backend,
                       used_slots=None):
    """``expert_mlp`` on arguments already checked: rows an expert-parallel exchange received,
    whose data-dependent count the argument checks could not guard on under compile."""
    y, *_ = torch.ops.moeblaze.expert_mlp_forward(x, topk_ids, topk_probs, w1, w3, w2, activation, recompute,
                                                   routing_method, backend, used_slots)
    return y


def _describe(t):
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"a {t.dim()}-d {t.dtype} tensor on {t.device}"


def _fc1_width(w1, w3):
    return w1.shape[1] * (2 if w3 is not None else 1)


def _maps(plan, topk_ids):
    """The plan's index maps with the fake implementation's (contiguous) strides: the PyTorch
    build keeps the strides of column-major ids, which a compiled graph may pass. A custom op's
    output may not alias an input: int32 ids are the plan's token_expert_indices themselves."""
    ids = topk_ids.untyped_storage()._cdata
    return tuple(t.clone() if t.untyped_storage()._cdata == ids else t.contiguous() for t in plan.tensors())


def _empty(x):
    return x.new_empty(0)


@torch.library.custom_op(_FORWARD, mutates_args=())
def _forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_probs: torch.Tensor, w1: torch.Tensor,
             w3: torch.Tensor | None, w2: torch.Tensor, activation: str, recompute: str, routing_method: str,
             backend: str, used_slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor]:
    """(y, probs in expert order, pre-activations or an empty tensor, the plan's four maps); the
    expert-order ones cut to ``used_slots`` where given."""
    backend = resolved_backend(x, backend)
    plan = build_routing_plan(topk_ids, w1.shape[0], method=routing_method, validate=False)
    if used_slots is not None:
        plan = plan.trimmed(int(used_slots))
    fc1, fc2 = split_fc1(w1, w3, x.dtype, backend), w2.to(x.dtype)
    save_pre = recompute == "activation"
    x, topk_probs = x.contiguous(), topk_probs.contiguous()
    if plan.expert_token_indices.shape[0] == 0:
        # Nothing routed here (the kernels take no empty grid).
        pre = x.new_empty(0, _fc1_width(w1, w3)) if save_pre else None
        return (x.new_zeros(x.shape), topk_probs.new_empty(0), pre if pre is not None else _empty(x),
                *_maps(plan, topk_ids))
    if backend == "triton":
        from .fused import fused_forward, prefetch_layer_kernels  # imports Triton: only when the kernels run

        prefetch_layer_kernels(x, topk_probs, fc1, fc2, plan, activation, recompute, (True,) * 4)
        y, probs_sorted, pre = fused_forward(x, topk_probs, fc1, fc2, plan, activation, save_pre=save_pre)
    else:
        y, pre = reference_forward(x, topk_probs, fc1, fc2, plan, activation, save_pre=save_pre)
        probs_sorted = plan.permute_probs(topk_probs)[:plan.expert_token_indices.shape[0]]
    return (y, probs_sorted, pre if pre is not None else _empty(x), *_maps(plan, topk_ids))


@_forward.register_fake
def _forward_fake(x, topk_ids, topk_probs, w1, w3, w2, activation, recompute, routing_method, backend, used_slots):
    slots = topk_ids.numel() if used_slots is None else torch.library.get_ctx().new_dynamic_size()
    index = dict(dtype=torch.int32, device=topk_ids.device)
    pre = x.new_empty(slots, _fc1_width(w1, w3)) if recompute == "activation" else _empty(x)
    return (x.new_empty(x.shape), topk_probs.new_empty(slots), pre, torch.empty(slots, **index),
            torch.empty(w1.shape[0] + 1, **index), torch.empty(topk_ids.shape, **index),
            torch.empty(topk_ids.shape, **index))


@torch.library.custom_op(_BACKWARD, mutates_args=("pre",))
def _backward(grad_y: torch.Tensor, x: torch.Tensor, topk_probs: torch.Tensor, probs_sorted: torch.Tensor,
              w1: torch.Tensor, w3: torch.Tensor | None, w2: torch.Tensor, pre: torch.Tensor,
              plan_tensors: list[torch.Tensor], activation: str, backend: str,
              needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad probs, grad w1, grad w3, grad w2), an empty tensor for each one ``needs``
    (x, probs, w1, w3, w2) does not ask for. The kernels turn ``pre`` (when saved) into its
    gradient in place: it is declared mutated."""
    backend = resolved_backend(x, backend)
    plan = RoutingPlan(*plan_tensors)
    fc1, fc2 = split_fc1(w1, w3, x.dtype, backend), w2.to(x.dtype)
    pre = pre if pre.dim() == 2 else None
    need_x, need_probs, need_w1, need_w3, need_w2 = needs
    wants = (need_x, need_probs, need_w1 or need_w3, need_w2)
    if plan.expert_token_indices.shape[0] == 0:
        grad_x, grad_probs, grad_fc2 = torch.zeros_like(x), torch.zeros_like(topk_probs), torch.zeros_like(fc2)
        grad_fc1 = tuple(map(torch.zeros_like, fc1)) if isinstance(fc1, tuple) else torch.zeros_like(fc1)
    elif backend == "triton":
        from .fused import fused_backward

        grad_x, grad_probs, grad_fc1, grad_fc2 = fused_backward(grad_y, x.contiguous(), probs_sorted, fc1, fc2, plan,
                                                                activation, pre, wants)
    else:
        grad_x, grad_probs, grad_fc1, grad_fc2 = reference_backward(grad_y, x, topk_probs.contiguous(), fc1, fc2, plan,
                                                                    activation, pre)
    if w3 is None:
        grad_w1, grad_w3 = grad_fc1, None
    elif isinstance(grad_fc1, tuple):
        grad_w1, grad_w3 = grad_fc1
    else:
        grad_w1, grad_w3 = grad_fc1.split(w1.shape[1], dim=1) if grad_fc1 is not None else (None, None)
    out = []
    for grad, like, need in ((grad_x, x, need_x), (grad_probs, topk_probs, need_probs), (grad_w1, w1, need_w1),
                             (grad_w3, w3, need_w3), (grad_fc2, w2, need_w2)):
        out.append(grad.to(like.dtype).contiguous() if need else _empty(x))
    return tuple(out)


@_backward.register_fake
def _backward_fake(grad_y, x, topk_probs, probs_sorted, w1, w3, w2, pre, plan_tensors, activation, backend, needs):
    likes = (x, topk_probs, w1, w3, w2)
    return tuple(like.new_empty(like.shape) if need else _empty(x) for like, need in zip(likes, needs))


def _setup_context(ctx, inputs, output):
    x, _, topk_probs, w1, w3, w2, activation, _, _, backend, _ = inputs
    _, probs_sorted, pre, *plan_tensors = output
    ctx.save_for_backward(x, topk_probs, probs_sorted, w1, w3, w2, pre, *plan_tensors)
    ctx.options = (activation, backend)
    ctx.mark_non_differentiable(*output[1:])


def _backward_of_forward(ctx, grad_y, *_):
    x, topk_probs, probs_sorted, w1, w3, w2, pre, *plan_tensors = ctx.saved_tensors
    activation, backend = ctx.options
    need = ctx.needs_input_grad
    needs = [need[0], need[2], need[3], w3 is not None and need[4], need[5]]
    if grad_y is None:
        grad_y = torch.zeros_like(x)
    grads = torch.ops.moeblaze.expert_mlp_backward(grad_y, x, topk_probs, probs_sorted, w1, w3, w2, pre,
                                                   plan_tensors, activation, backend, needs)
    grad_x, grad_probs, grad_w1, grad_w3, grad_w2 = (g if n else None for g, n in zip(grads, needs))
    return grad_x, None, grad_probs, grad_w1, grad_w3, grad_w2, None, None, None, None, None


_forward.register_autograd(_backward_of_forward, setup_context=_setup_context)
