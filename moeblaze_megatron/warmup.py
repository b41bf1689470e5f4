"""A layer's first call without one compile after another: the compile-latency machinery of the
op, in one module.

Triton compiles a kernel at its first launch, one after another as the launches come, and each
takes seconds on a GPU. Here, at a layer's first call of its kind (``prepare``, called by the
op's passes before the routing plan is built), every kernel that call will launch (the plan's
build, the forward's and the backward's GEMMs) goes to the compile workers at once
(``kernels/compile_workers.py``), to compile side by side while this process goes on. Where the
plan's own build kernels just went to the workers, this first plan is built by the PyTorch path
instead (the same plan, bit for bit), so that nothing waits on them. What torch's first backward
imports (seconds, once per process) is imported while this process waits on the workers.

The adapters start the workers when a layer is built (``start_compile_workers``), so that their
start-up overlaps the rest of a job's setup instead of its first step. Nothing here runs without a
GPU, under the interpreter, for the reference backend, or with MOEBLAZE_COMPILE_WORKERS=0.
"""

from __future__ import annotations

import importlib
import sys

import torch

from .routing import RoutingPlan, choose_routing_method

__all__ = ["BACKWARD_IMPORT", "TORCH_PLAN_MAX_CELLS", "layer_launches", "prepare", "start_compile_workers"]

# What torch's first backward imports (``autograd._make_grads``; sympy with it: seconds, once per
# process): imported while this process waits on the compile workers instead.
BACKWARD_IMPORT = "torch.fx.experimental.symbolic_shapes"

# The largest first plan (experts x tokens) built in PyTorch while the Triton build compiles: its
# dense map and scans take ~13 bytes a cell (2**24 cells: ~220 MB, once).
TORCH_PLAN_MAX_CELLS = 2**24

# The kinds of plan build and of layer whose kernels were handed to the workers.
_prefetched: set = set()


def start_compile_workers(backend: str = "auto") -> None:
    """Start the kernels' compile workers now (a model's MoE layers call it as they are built), so
    that their start-up (0.5-2 s: each imports Triton and the kernel modules) overlaps the rest of
    a job's setup instead of its first step. Nothing where no kernel will compile: no GPU, the
    reference backend, the interpreter, MOEBLAZE_COMPILE_WORKERS=0."""
    from .kernels.settings import SETTINGS

    if backend == "reference" or SETTINGS.interpret or not torch.cuda.is_available():
        return
    from .kernels import compile_workers

    compile_workers.start()


def prepare(x, topk_ids, topk_probs, fc1, fc2, num_experts: int, rows: int, options, needs) -> str:
    """Before a layer call builds its routing plan (``rows`` used slots of ``topk_ids``; ``options``
    the passes' ``PassOptions``; ``needs`` the four gradients asked for): at the first call of its
    kind, hand the plan build's kernels and every kernel the layer's forward and backward will
    launch to the compile workers. Returns the plan build method to use: ``options.routing_method``
    resolved, or "torch" for this first plan where the Triton build's kernels just went to the
    workers."""
    method = options.routing_method
    if method == "auto":
        method = choose_routing_method(topk_ids, num_experts)
    if not topk_ids.is_cuda:
        return method
    from .kernels import compile_workers

    if not compile_workers.enabled():
        return method
    plan_sent = method in ("three_step", "sort") and compile_workers.running() and _prefetch_plan_build(
        method, topk_ids, num_experts)
    # The layer's launches are recorded from the bf16 passes: the FP8 kernels compile at first use.
    if options.backend == "triton" and options.fp8 is None:
        _prefetch_layer(x, topk_ids, topk_probs, fc1, fc2, num_experts, rows, options, needs)
    # The PyTorch build synchronizes with the host: not inside a CUDA graph's capture.
    if (plan_sent and num_experts * topk_ids.shape[0] <= TORCH_PLAN_MAX_CELLS
            and not torch.cuda.is_current_stream_capturing()):
        return "torch"
    return method


def _plan_build(method):
    if method == "three_step":
        from .kernels.plan_three_step import three_step_routing_plan

        return three_step_routing_plan
    from .kernels.plan_sort import sort_routing_plan

    return sort_routing_plan


def _prefetch_plan_build(method, topk_ids, num_experts) -> bool:
    """At the first plan of its kind, hand the build's few kernels to the workers at once; returns
    whether any went. The kind: the build, the ids' dtype, K, E, the token count's power-of-two
    bucket and 16-divisibility (what the kernels specialize on)."""
    from .kernels import compile_workers
    from .kernels.calls import stand_in
    from .kernels.launch import next_pow2

    num_tokens = topk_ids.shape[0]
    key = ("plan", method, topk_ids.device, topk_ids.dtype, topk_ids.shape[1], num_experts, next_pow2(num_tokens),
           num_tokens % 16)
    if key in _prefetched:
        return False
    _prefetched.add(key)
    build, ids = _plan_build(method), stand_in(topk_ids)
    return compile_workers.prefetch(compile_workers.recorded_launches(topk_ids.device,
                                                                      lambda: build(ids, num_experts))) > 0


def _prefetch_layer(x, topk_ids, topk_probs, fc1, fc2, num_experts, rows, options, needs) -> int:
    """At a layer's first call of its kind, hand every kernel its forward and backward will launch
    (``layer_launches``) to the workers at once; returns how many compiles were submitted. The
    kind is what the kernels specialize on or tune by (dtypes, widths, experts, top-k, the rows'
    power-of-two bucket and 16-divisibility, the options): a token count that changes every step
    does not repeat it."""
    from .kernels import compile_workers
    from .kernels.launch import next_pow2

    key = ("layer", x.device, x.dtype, topk_probs.dtype, isinstance(fc1, tuple), options.activation, options.save_pre,
           tuple(needs), x.shape[1], fc2.shape[2], num_experts, topk_ids.shape[1], next_pow2(rows), rows % 16,
           x.shape[0] % 16)
    if key in _prefetched:
        return 0
    _prefetched.add(key)
    submitted = compile_workers.prefetch(layer_launches(x, topk_ids, topk_probs, fc1, fc2, num_experts, rows,
                                                        options, needs))
    if submitted and any(needs) and BACKWARD_IMPORT not in sys.modules:
        compile_workers.run_while_waiting(lambda: importlib.import_module(BACKWARD_IMPORT))
    return submitted


def plan_stand_in(topk_ids, num_experts: int, rows: int) -> RoutingPlan:
    """Meta tensors shaped as the plan of ``topk_ids`` cut to ``rows`` used slots (all int32, as the
    builds make them), for code run inside ``kernels.calls.recording``."""
    from .kernels.calls import stand_in

    def index(*shape):
        return torch.empty(shape, dtype=torch.int32, device="meta")

    ids = stand_in(topk_ids) if topk_ids.dtype == torch.int32 else index(*topk_ids.shape)
    return RoutingPlan(index(rows), index(num_experts + 1), ids, index(*topk_ids.shape))


def layer_launches(x, topk_ids, topk_probs, fc1, fc2, num_experts: int, rows: int, options, needs) -> list:
    """The ``KernelCall``s that the fused forward, then backward (where ``needs`` asks for any
    gradient), launch for these arguments, in order: the same passes run on meta tensors standing
    for them inside ``kernels.calls.recording``, so nothing runs and nothing is allocated. A
    launcher that cannot follow meta tensors ends the list early."""
    from .fused import fused_backward, fused_forward
    from .kernels import compile_workers
    from .kernels.calls import stand_in

    fc1 = tuple(map(stand_in, fc1)) if isinstance(fc1, tuple) else stand_in(fc1)
    xs, fc2, plan = stand_in(x), stand_in(fc2), plan_stand_in(topk_ids, num_experts, rows)

    def passes():
        y, probs_sorted, pre = fused_forward(xs, stand_in(topk_probs), fc1, fc2, plan, options.activation,
                                             save_pre=options.save_pre)
        if any(needs):
            # new_empty, not empty_like: on meta tensors the latter imports sympy (seconds).
            fused_backward(y.new_empty(y.shape), xs, probs_sorted, fc1, fc2, plan, options.activation, pre, needs)

    return compile_workers.recorded_launches(x.device, passes)
