"""``moe_mlp``: the MoE expert MLP over a routing plan, the op's one entry.

It checks its arguments, derives the options the passes take (``passes.PassOptions``) and runs
the passes (``passes.py``: the Triton kernels or the PyTorch reference) through one autograd
Function, or, under torch.compile, through the op's custom ops (``compiled_op.py``). Megatron's
experts, the torchtitan override and the expert-parallel front all call it.
"""

from __future__ import annotations

import torch

from . import passes
from .compiled_op import compiled_moe_mlp
from .config import ACTIVATIONS, option_problem
from .kernels.settings import SETTINGS
from .passes import TRITON_DTYPES, PassOptions
from .routing import RoutingPlan, check_topk_ids

__all__ = ["check_moe_mlp_args", "moe_mlp"]


def moe_mlp(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_probs: torch.Tensor,
    fc1_weight,
    fc2_weight: torch.Tensor,
    activation: str = "swiglu",
    plan: RoutingPlan | None = None,
    *,
    recompute: str = "activation",
    backend: str = "auto",
    routing_method: str = "auto",
    validate: bool = True,
    used_slots=None,
    fp8: str | None = None,
) -> torch.Tensor:
    """``y[t] = sum_k topk_probs[t, k] * fc2[e] @ act(fc1[e] @ x[t])`` with ``e = topk_ids[t, k]``.

    Shapes: x [T, d]; topk_ids [T, K] integer (-1 marks an unused slot: the token has fewer
    than K experts there); topk_probs [T, K] floating point;
    fc1_weight [E, 2h, d] for ``activation="swiglu"`` (gate rows, then up rows: Megatron's GLU
    layout, ``silu(gate) * up``) or [E, h, d] for ``"silu"`` and ``"gelu"``; for SwiGLU also the
    (gate, up) pair of [E, h, d] tensors (torchtitan's w1 and w3), whose gradient comes back as a
    pair; fc2_weight [E, d, h]. The weights may be in another floating dtype than x: they are cast
    to x's dtype inside each pass (only the weights themselves are kept for backward) and their
    gradients come back in their own dtype. Differentiable in x, topk_probs and the weights.

    ``plan``: a RoutingPlan already built for ``topk_ids`` (built here when None, by
    ``routing_method``: ``build_routing_plan``'s methods).
    ``recompute``: ``"activation"`` saves the pre-activations for backward; ``"fc1"`` saves only
    x, the plan and the probabilities and recomputes the first GEMM in backward.
    ``backend``: ``"triton"`` (fused kernels for float16, bfloat16 and float32; CUDA, or CPU
    under TRITON_INTERPRET=1), ``"reference"`` (pure PyTorch, any floating dtype) or ``"auto"``
    (Triton on CUDA for those dtypes, the reference otherwise).
    ``validate``: with no ``plan``, check that the ids are in range and distinct per row (one
    device-to-host synchronization); ``False`` skips it, as the adapters do with the router's
    top-k ids (invalid ids then give undefined results).
    ``used_slots``: how many of the ids are used, where the caller knows it (an int, or a 0-d
    int64 CPU tensor: the rows an expert-parallel exchange received, -1 padded): the plan's
    expert-order buffers (the saved pre-activations among them) are cut to it instead of T * K.
    It must be exact and is not checked (a check would synchronize with the host).
    ``fp8``: None, or ``"e4m3"`` / ``"hybrid"``: the six GEMMs in FP8 under the blockwise recipe
    (``fp8.py``; hybrid: E5M2 gradients), x and the output gradient quantized once per call, the
    weights once per optimizer step; the output and the gradients stay in x's and the weights' dtypes.
    Eager and under torch.compile alike.

    Under torch.compile the op runs as two custom ops (forward, backward) that the graph keeps
    whole; the plan is then built inside them (``plan`` must be None) and the ids' values are not
    checked (as with ``validate=False``).
    """
    compiling = torch.compiler.is_compiling()
    # A check of the ids' values reads them on the host: not inside a compiled graph.
    num_experts = check_moe_mlp_args(x, topk_ids, topk_probs, fc1_weight, fc2_weight, activation, plan, recompute,
                                     backend, routing_method, validate and not compiling, used_slots, fp8)
    options = passes.pass_options(x, activation, recompute, backend, routing_method, fp8)
    if compiling:
        if plan is not None:
            raise ValueError("moe_mlp under torch.compile builds the routing plan inside its custom op: pass plan=None")
        if isinstance(used_slots, int):
            used_slots = torch.tensor(used_slots, dtype=torch.int64)
        return compiled_moe_mlp(x, topk_ids, topk_probs, fc1_weight, fc2_weight, options, used_slots)
    if isinstance(used_slots, torch.Tensor):
        used_slots = int(used_slots)
    gate, up = fc1_weight if isinstance(fc1_weight, tuple) else (fc1_weight, None)
    return MoEMLPFunction.apply(x, topk_probs, gate, up, fc2_weight, topk_ids, plan, used_slots, num_experts, options)


class MoEMLPFunction(torch.autograd.Function):
    """The op's autograd over the passes: saves x, the probabilities (for the kernels in expert
    order instead), the weights as given, the plan and, with ``options.save_pre``, the
    pre-activations."""

    @staticmethod
    def forward(ctx, x, topk_probs, gate, up, fc2_weight, topk_ids, plan, used_slots, num_experts,
                options: PassOptions):
        fc1 = gate if up is None else (gate, up)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2] or ctx.needs_input_grad[3],
                 ctx.needs_input_grad[4])
        weights = passes.compute_weights(fc1, fc2_weight, x.dtype, options.backend, options.fp8)
        if options.backend == "triton":
            x = x.contiguous()
        if plan is None:
            plan = passes.build_plan(x, topk_ids, topk_probs, *weights, num_experts, options, needs, used_slots)
        y, probs_sorted, pre = passes.forward(x, topk_probs, *weights, plan, options)
        # The kernels' backward reads the probabilities in expert order only; an empty order
        # (nothing routed) still needs topk_probs for the zero gradient's shape.
        kept_probs = topk_probs if probs_sorted is None or probs_sorted.numel() == 0 else None
        ctx.save_for_backward(x, kept_probs, probs_sorted, gate, up, fc2_weight, pre, *plan.tensors())
        ctx.options = options
        ctx.pre_overwritten = False
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, topk_probs, probs_sorted, gate, up, fc2_weight, pre, *plan_tensors = ctx.saved_tensors
        if ctx.pre_overwritten:
            # A second backward through the same graph (retain_graph=True, gradcheck): the first
            # one turned the saved pre-activations into their gradient, so recompute them.
            pre = None
        options = ctx.options
        # Only the kernels turn the saved pre-activations into their gradient in place.
        ctx.pre_overwritten = pre is not None and options.backend == "triton"
        fc1 = gate if up is None else (gate, up)
        need = ctx.needs_input_grad
        needs = (need[0], need[1], need[2] or need[3], need[4])
        weights = passes.compute_weights(fc1, fc2_weight, x.dtype, options.backend, options.fp8)
        grad_x, grad_probs, grad_fc1, grad_fc2 = passes.backward(
            grad_y, x, topk_probs, probs_sorted, *weights, RoutingPlan(*plan_tensors), pre, options, needs)
        grad_fc1 = passes.as_fc1_form(grad_fc1, fc1)
        grad_gate, grad_up = grad_fc1 if isinstance(grad_fc1, tuple) else (grad_fc1, None)
        return (grad_x, grad_probs, _in_dtype(grad_gate, gate, need[2]), _in_dtype(grad_up, up, need[3]),
                _in_dtype(grad_fc2, fc2_weight, need[4]), None, None, None, None, None)


def _in_dtype(grad, weight, needed):
    """A weight's gradient in the weight's dtype, or None where it is not needed."""
    return grad.to(weight.dtype) if needed and grad is not None else None


def _describe(t):
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"a {t.dim()}-d {t.dtype} tensor on {t.device}"


def check_moe_mlp_args(x, topk_ids, topk_probs, fc1_weight, fc2_weight, activation, plan, recompute, backend,
                       routing_method="auto", validate=True, used_slots=None, fp8=None) -> int:
    """Raise a clear error naming the offending argument; returns the number of experts."""
    halves = fc1_weight if isinstance(fc1_weight, tuple) else None
    if halves is not None and (len(halves) != 2 or activation != "swiglu"):
        raise ValueError(f"fc1_weight as a tuple is the (gate, up) pair of a SwiGLU expert MLP; got a tuple of "
                         f"{len(halves)} with activation={activation!r}")
    named = [("x", x), ("topk_probs", topk_probs)]
    named += [("fc1_weight[0] (gate)", halves[0]), ("fc1_weight[1] (up)", halves[1])] if halves else [
        ("fc1_weight", fc1_weight)]
    named.append(("fc2_weight", fc2_weight))
    for name, value in named:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name} must have a floating-point dtype, got {value.dtype}")
    weight_dtypes = [value.dtype for name, value in named[2:]]
    if len(set(weight_dtypes)) > 1:
        names = " and ".join(name for name, _ in named[2:])
        raise TypeError(f"{names} must share a dtype, got {', '.join(map(str, weight_dtypes))}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for option, value in (("recompute", recompute), ("backend", backend), ("routing_method", routing_method),
                          ("fp8", fp8)):
        problem = option_problem(option, value)
        if problem is not None:
            # A plain ValueError: torch.compile traces this check and cannot build OptionError.
            raise ValueError(problem)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    if halves:
        if halves[0].dim() != 3 or halves[1].shape != halves[0].shape:
            raise ValueError(f"fc1_weight's (gate, up) halves must be 3-D [experts, ffn, in] of one shape, got "
                             f"{tuple(halves[0].shape)} and {tuple(halves[1].shape)}")
        fc1_shape = (halves[0].shape[0], 2 * halves[0].shape[1], halves[0].shape[2])
    else:
        fc1_shape = tuple(fc1_weight.shape)
    if len(fc1_shape) != 3 or fc2_weight.dim() != 3:
        raise ValueError(
            f"fc1_weight and fc2_weight must be 3-D [experts, out, in], got shapes "
            f"{fc1_shape} and {tuple(fc2_weight.shape)}"
        )
    num_tokens, hidden = x.shape
    num_experts, fc1_out, fc1_in = fc1_shape
    ffn = fc2_weight.shape[2]
    expected_fc1_out = 2 * ffn if activation == "swiglu" else ffn
    if fc1_in != hidden or fc1_out != expected_fc1_out:
        raise ValueError(
            f"fc1_weight has shape {fc1_shape}; expected [{num_experts}, "
            f"{expected_fc1_out}, {hidden}] for activation={activation!r} with x of width {hidden} "
            f"and fc2_weight of shape {tuple(fc2_weight.shape)}"
        )
    if tuple(fc2_weight.shape) != (num_experts, hidden, ffn):
        raise ValueError(
            f"fc2_weight has shape {tuple(fc2_weight.shape)}; expected [{num_experts}, {hidden}, {ffn}]"
        )
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    tensors = [("x", x), ("topk_ids", topk_ids), ("topk_probs", topk_probs), *named[2:]]
    devices = {name: t.device for name, t in tensors}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {', '.join(f'{k}: {v}' for k, v in devices.items())}")
    check_topk_ids(topk_ids, num_experts, check_values=validate and plan is None)
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows; expected one per token of x ({num_tokens})")
    if tuple(topk_probs.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_probs has shape {tuple(topk_probs.shape)}; expected the shape of topk_ids {tuple(topk_ids.shape)}"
        )
    if plan is not None:
        if not isinstance(plan, RoutingPlan):
            raise TypeError(f"plan must be a RoutingPlan, got {type(plan).__name__}")
        if plan.num_experts != num_experts or tuple(plan.token_index_map.shape) != tuple(topk_ids.shape):
            raise ValueError(
                f"plan was built for {plan.num_tokens} tokens, topk {plan.topk}, {plan.num_experts} experts; "
                f"the call has {num_tokens} tokens, topk {topk_ids.shape[1]}, {num_experts} experts"
            )
        if plan.token_index_map.device != x.device:
            raise ValueError(f"plan is on {plan.token_index_map.device}; expected x's device {x.device}")
        if used_slots is not None:
            raise ValueError("used_slots is for a plan built here: with plan given, cut it yourself (plan.trimmed)")
    if used_slots is not None and not isinstance(used_slots, int) and not (
            isinstance(used_slots, torch.Tensor) and used_slots.dim() == 0 and used_slots.dtype == torch.int64
            and used_slots.device.type == "cpu"):
        raise TypeError(f"used_slots must be an int or a 0-d int64 CPU tensor (or None), got {_describe(used_slots)}")
    if backend == "triton" and x.dtype not in TRITON_DTYPES:
        raise ValueError(
            f"backend='triton' takes float16, bfloat16 or float32 tensors, got x of {x.dtype}; "
            f"use backend='reference' (what 'auto' picks for {x.dtype})"
        )
    if backend == "triton" and not x.is_cuda and not SETTINGS.interpret:
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    return num_experts
