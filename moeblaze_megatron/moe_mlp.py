"""``moe_mlp``: the MoE expert MLP over a routing plan, with argument checks and backend choice."""

from __future__ import annotations

import torch

from .config import ACTIVATIONS, BACKENDS, RECOMPUTE_MODES
from .kernels.settings import SETTINGS
from .reference import ReferenceMoEMLP, reference_backward, reference_forward
from .routing import RoutingPlan, build_routing_plan, check_topk_ids

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def moe_mlp(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_probs: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    activation: str = "swiglu",
    plan: RoutingPlan | None = None,
    *,
    recompute: str = "activation",
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """``y[t] = sum_k topk_probs[t, k] * fc2[e] @ act(fc1[e] @ x[t])`` with ``e = topk_ids[t, k]``.

    Shapes: x [T, d]; topk_ids [T, K] integer (-1 marks an unused slot: the token has fewer
    than K experts there); topk_probs [T, K] floating point;
    fc1_weight [E, 2h, d] for ``activation="swiglu"`` (gate rows, then up rows: Megatron's GLU
    layout, ``silu(gate) * up``) or [E, h, d] for ``"silu"`` and ``"gelu"``; fc2_weight [E, d, h].
    Differentiable in x, topk_probs, fc1_weight and fc2_weight.

    ``plan``: a RoutingPlan already built for ``topk_ids`` (built here when None).
    ``recompute``: ``"activation"`` saves the pre-activations for backward; ``"fc1"`` saves only
    x, the plan and the probabilities and recomputes the first GEMM in backward.
    ``backend``: ``"triton"`` (fused kernels for float16, bfloat16 and float32; CUDA, or CPU
    under TRITON_INTERPRET=1), ``"reference"`` (pure PyTorch, any floating dtype) or ``"auto"``
    (Triton on CUDA for those dtypes, the reference otherwise).
    ``validate``: with no ``plan``, check that the ids are in range and distinct per row (one
    device-to-host synchronization); ``False`` skips it, as the Megatron dispatcher does with
    the router's top-k ids (invalid ids then give undefined results).
    """
    num_experts = check_moe_mlp_args(
        x, topk_ids, topk_probs, fc1_weight, fc2_weight, activation, plan, recompute, backend, validate
    )
    if plan is None:
        # The ids were checked above (one synchronization); not a second time.
        plan = build_routing_plan(topk_ids, num_experts, validate=False)
    if x.shape[0] == 0:
        # Nothing routed; keep the graph connected so every input still gets a (zero) gradient.
        return x * 0 + 0 * (topk_probs.sum() + fc1_weight.sum() + fc2_weight.sum()).to(x.dtype)
    if resolved_backend(x, backend) == "triton":
        from .fused import TritonMoEMLP  # imports Triton: only when the kernels run

        return TritonMoEMLP.apply(x, topk_probs, fc1_weight, fc2_weight, plan, activation, recompute)
    return ReferenceMoEMLP.apply(x, topk_probs, fc1_weight, fc2_weight, plan, activation, recompute)


def check_moe_mlp_args(x, topk_ids, topk_probs, fc1_weight, fc2_weight, activation, plan, recompute, backend,
                       validate=True):
    """Raise a clear error naming the offending argument; returns the number of experts."""
    for name, value in (("x", x), ("topk_probs", topk_probs), ("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name} must have a floating-point dtype, got {value.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    if fc1_weight.dim() != 3 or fc2_weight.dim() != 3:
        raise ValueError(
            f"fc1_weight and fc2_weight must be 3-D [experts, out, in], got shapes "
            f"{tuple(fc1_weight.shape)} and {tuple(fc2_weight.shape)}"
        )
    num_tokens, hidden = x.shape
    num_experts, fc1_out, fc1_in = fc1_weight.shape
    ffn = fc2_weight.shape[2]
    expected_fc1_out = 2 * ffn if activation == "swiglu" else ffn
    if fc1_in != hidden or fc1_out != expected_fc1_out:
        raise ValueError(
            f"fc1_weight has shape {tuple(fc1_weight.shape)}; expected [{num_experts}, "
            f"{expected_fc1_out}, {hidden}] for activation={activation!r} with x of width {hidden} "
            f"and fc2_weight of shape {tuple(fc2_weight.shape)}"
        )
    if tuple(fc2_weight.shape) != (num_experts, hidden, ffn):
        raise ValueError(
            f"fc2_weight has shape {tuple(fc2_weight.shape)}; expected [{num_experts}, {hidden}, {ffn}]"
        )
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    devices = {name: t.device for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_probs", topk_probs),
                                               ("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight))}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {', '.join(f'{k}: {v}' for k, v in devices.items())}")
    check_topk_ids(topk_ids, num_experts, check_values=validate and plan is None)
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows; expected one per token of x ({num_tokens})")
    if tuple(topk_probs.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_probs has shape {tuple(topk_probs.shape)}; expected the shape of topk_ids {tuple(topk_ids.shape)}"
        )
    if x.dtype != fc1_weight.dtype or x.dtype != fc2_weight.dtype:
        raise TypeError(
            f"x, fc1_weight and fc2_weight must share a dtype, got {x.dtype}, {fc1_weight.dtype}, {fc2_weight.dtype}"
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
    if backend == "triton" and x.dtype not in TRITON_DTYPES:
        raise ValueError(
            f"backend='triton' takes float16, bfloat16 or float32 tensors, got x of {x.dtype}; "
            f"use backend='reference' (what 'auto' picks for {x.dtype})"
        )
    if backend == "triton" and not x.is_cuda and not SETTINGS.interpret:
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    return num_experts


def check_split_moe_mlp_args(x, topk_ids, topk_probs, w1, w3, w2, activation, plan, recompute, backend,
                             validate=False):
    """``check_moe_mlp_args`` for fc1 given as ``w1`` alone or, for SwiGLU, as the (gate, up) pair
    ``w1``, ``w3`` [E, F, D] (torchtitan's layout): the same checks, on zero-stride stand-ins of
    the stacked weights, so nothing of the weights' size is made."""
    if w3 is not None and (activation != "swiglu" or w3.shape != w1.shape):
        raise ValueError(f"w3 (the up half of a (gate, up) pair) is for activation='swiglu' with w3 shaped as w1 "
                         f"{tuple(w1.shape)}; got activation={activation!r}, w3 {tuple(w3.shape)}")
    stand_in = x.new_empty(())
    rows = w1.shape[1] * (2 if w3 is not None else 1)
    return check_moe_mlp_args(x, topk_ids, topk_probs, stand_in.expand(w1.shape[0], rows, w1.shape[2]),
                              stand_in.expand(w2.shape), activation, plan, recompute, backend, validate)


def split_fc1(w1, w3, dtype, backend):
    """fc1 in ``dtype`` as ``backend`` ("triton" or "reference") takes it: ``w1`` where there is
    no ``w3``; else the (gate, up) pair for the kernels, which read both halves where they are,
    and [gate | up] stacked for the reference."""
    if w3 is None:
        return w1.to(dtype)
    if backend == "triton":
        return w1.to(dtype), w3.to(dtype)
    return torch.cat([w1, w3], dim=1).to(dtype)


def resolved_backend(x: torch.Tensor, backend: str) -> str:
    """The backend that runs for ``backend`` on ``x``: "auto" is "triton" for CUDA tensors of a
    dtype the kernels take, "reference" otherwise."""
    if backend == "auto":
        return "triton" if x.is_cuda and x.dtype in TRITON_DTYPES else "reference"
    return backend


def start_compile_workers(backend: str = "auto") -> None:
    """Start the kernels' compile workers now (a model's MoE layers call it as they are built), so
    that their start-up (0.5-2 s: each imports Triton and the kernel modules) overlaps the rest of
    a job's setup instead of its first step. Nothing where no kernel will compile: no GPU, the reference
    backend, the interpreter, MOEBLAZE_COMPILE_WORKERS=0."""
    if backend == "reference" or SETTINGS.interpret or not torch.cuda.is_available():
        return
    from .kernels import compile_workers

    compile_workers.start()


def expert_mlp_forward(x, topk_probs, fc1_weight, fc2_weight, plan, activation, backend, out_dtype=None):
    """One forward pass of the op, outside autograd and saving nothing (a ring hop's): ``y`` in
    ``out_dtype`` (x's by default). Arguments are checked by the caller."""
    if resolved_backend(x, backend) == "triton":
        from .fused import fused_forward

        return fused_forward(x, topk_probs, fc1_weight, fc2_weight, plan, activation, save_pre=False,
                             out_dtype=out_dtype)[0]
    return reference_forward(x, topk_probs, fc1_weight, fc2_weight, plan, activation, save_pre=False,
                             out_dtype=out_dtype)[0]


def expert_mlp_backward(grad_y, x, topk_probs, fc1_weight, fc2_weight, plan, activation, backend, needs):
    """One backward pass of the op, recomputing the first GEMM (a ring hop's): ``(grad_x,
    grad_probs, grad_fc1, grad_fc2)``, None where ``needs`` (four bools) says so."""
    if resolved_backend(x, backend) == "triton":
        from .fused import fused_backward

        return fused_backward(grad_y, x.contiguous(), plan.permute_probs(topk_probs.contiguous()), fc1_weight,
                              fc2_weight, plan, activation, None, needs)
    grads = reference_backward(grad_y, x, topk_probs, fc1_weight, fc2_weight, plan, activation, None)
    return tuple(g if need else None for g, need in zip(grads, needs))
