"""torchtitan adapter: MoEBlaze's routed experts as a torchtitan 0.3.0 config override.

Activate it with torchtitan's own override mechanism (``torchtitan/config/override.py``)::

    torchrun ... -m torchtitan.train --module ... --config ... \\
        --override.imports moeblaze_megatron.torchtitan.moeblaze_experts
    # options as a JSON object attached to the target (one shell token):
    --override.imports 'moeblaze_megatron.torchtitan.moeblaze_experts={"recompute": "fc1"}'

The override claims every ``RoutedExperts.Config`` of the model (the routed half of each
``MoE`` layer: ``token_dispatcher`` + ``inner_experts``) and returns a ``MoEBlazeRoutedExperts``
config. torchtitan's router, shared experts, score function, top-k, route norm and scale,
expert-bias load balancing (``MoE.expert_bias_E`` / ``tokens_per_expert_E`` and the optimizer
hook) and the whole config system stay as they are: ``MoE.forward`` still calls
``routed_experts(x, topk_scores, topk_expert_ids, counts)`` and adds the shared experts.

What changes inside: instead of an argsort into a (T*K, D) expert-sorted copy of the tokens,
three grouped GEMMs and a scatter-add, the experts run as ``moe_mlp`` over a routing plan (the
fused gather-GEMM kernels on CUDA, the PyTorch reference on the CPU); the router scores multiply
the expert outputs, as in torchtitan's combine. With expert parallelism each token travels once
to every rank holding one of its experts (``parallel.alltoall``) or around RelayMoE's ring
(``parallel.ring``), over torchtitan's expert-parallel mesh. Under torch.compile (torchtitan's
``--compile.enable``) the op, the exchange and the ring run as ``torch.library`` custom ops
(``compiled_op``, ``parallel.compiled_exchange``, ``parallel.compiled_ring``) that the compiled
graph keeps whole.

Weights and checkpoints: the ``inner_experts`` child is torchtitan's own ``GroupedExperts``
module, untouched: ``w1_EFD`` (gate) and ``w3_EFD`` (up) [E, F, D] and ``w2_EDF`` [E, D, F], the
same parameters, FQNs, initializers, sharding configs (``Shard(0)`` over the EP mesh) and
state-dict keys, so checkpoints (model and optimizer) move freely between stock torchtitan and
the override. The fused kernels take w1 and w3 as they are (a (gate, up) pair: no stacked copy,
and their gradients come back as two tensors); the PyTorch reference (the CPU path) takes fc1 as
[gate | up] rows [E, 2F, D], ``torch.cat([w1, w3], 1)`` built inside the autograd function in
forward and again in backward (``_SplitGateUpExperts``). Either way only the parameters are
kept between the passes. Like ``GroupedExperts``, the experts compute in bfloat16 whatever the
parameter dtype (``expert_dtype="input"`` computes in the input's dtype instead): a cast copy,
made in each pass, where the parameters are in another dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.config import override
from torchtitan.config.override import derive
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

from .compiled_op import expert_mlp
from .config import MoEBlazeConfig
from .moe_mlp import check_split_moe_mlp_args, moe_mlp, resolved_backend, split_fc1, start_compile_workers
from .parallel.alltoall import prepare_send
from .parallel.compiled_exchange import compiled_alltoall_moe
from .parallel.compiled_ring import compiled_ring_moe
from .parallel.ring import group_mean_tokens, layer_traffic, ring_moe
from .parallel.traffic import MODES, resolve_ep_mode
from .reference import ReferenceMoEMLP
from .routing import build_routing_plan

__all__ = ["EXPERT_DTYPES", "MoEBlazeRoutedExperts", "moeblaze_experts", "moeblaze_options"]

# The dtype the experts compute in: bfloat16 as torchtitan's GroupedExperts (which casts its
# input and weights to bfloat16 whatever their dtype), or the input's own dtype.
EXPERT_DTYPES = ("bfloat16", "input")
_OVERRIDE = "moeblaze_megatron.torchtitan.moeblaze_experts"
# GroupedExperts always computes silu(x @ w1^T) * (x @ w3^T).
_ACTIVATION = "swiglu"


def moeblaze_options(**options) -> tuple[MoEBlazeConfig, str]:
    """The override's keyword arguments as ``(MoEBlazeConfig, expert_dtype)``; a ValueError or
    TypeError naming the argument and what it takes otherwise. The MoEBlaze options are
    ``MoEBlazeConfig``'s fields, their choices declared in ``config.py``."""
    expert_dtype = options.pop("expert_dtype", "bfloat16")
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"{_OVERRIDE}: expert_dtype must be one of {EXPERT_DTYPES}, got {expert_dtype!r}")
    known = [f.name for f in dataclasses.fields(MoEBlazeConfig)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"{_OVERRIDE}: unknown option(s) {unknown}; it takes {known + ['expert_dtype']}")
    try:
        return MoEBlazeConfig(**options), expert_dtype
    except ValueError as error:
        raise ValueError(f"{_OVERRIDE}: {error}") from None


def config_problem(cfg: RoutedExperts.Config) -> str | None:
    """Why the override cannot take a routed-experts config (None: it can)."""
    inner = cfg.inner_experts
    if type(inner) is not GroupedExperts.Config:
        return (f"inner_experts is {type(inner).__qualname__}; MoEBlaze replaces torchtitan's GroupedExperts "
                "(w1/w3 [E, F, D], w2 [E, D, F], SwiGLU, no bias) only: not fused gate/up weights "
                "(fused_grouped_experts), GPT-OSS experts or quantized (float8 / MX) experts")
    dispatcher = cfg.token_dispatcher
    if type(dispatcher) not in (LocalTokenDispatcher.Config, AllToAllTokenDispatcher.Config):
        return (f"token_dispatcher is {type(dispatcher).__qualname__}; MoEBlaze does its own token exchange "
                "in place of torchtitan's local / all-to-all dispatch: build the model with the 'standard' "
                "MoE comm backend (DeepEP, HybridEP, MinimalAsyncEP and the padded TorchAO dispatch are "
                "not combined with it)")
    return None


class MoEBlazeRoutedExperts(RoutedExperts):
    """torchtitan's ``RoutedExperts`` with the experts run by MoEBlaze's op.

    ``forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)`` keeps
    the stock signature (the sharding config's local_map names these arguments) and returns
    ``y[t] = sum_k scores[t, k] * expert_{ids[t, k]}(x[t])`` [B, L, D] in x's dtype.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        moeblaze: MoEBlazeConfig = field(default_factory=MoEBlazeConfig)
        """MoEBlaze's options (recompute, routing_method, backend, ep_mode, ...)."""
        expert_dtype: str = "bfloat16"
        """``bfloat16`` (as GroupedExperts) or ``input`` (the input's dtype)."""

    def __init__(self, config: Config):
        problem = config_problem(config)
        if problem is not None:
            raise ValueError(f"MoEBlazeRoutedExperts: {problem}")
        if not isinstance(config.moeblaze, MoEBlazeConfig):
            raise TypeError(f"MoEBlazeRoutedExperts: moeblaze must be a MoEBlazeConfig, got "
                            f"{type(config.moeblaze).__name__}")
        if config.expert_dtype not in EXPERT_DTYPES:
            raise ValueError(f"MoEBlazeRoutedExperts: expert_dtype must be one of {EXPERT_DTYPES}, "
                             f"got {config.expert_dtype!r}")
        super().__init__(config)
        self.options = config.moeblaze
        self.expert_dtype = config.expert_dtype
        start_compile_workers(self.options.backend)
        # The expert-parallel process group, set by parallelize() when EP > 1.
        self.ep_group = None
        # Rows this rank received in the last exchange (EP > 1, alltoall, eager: a compiled graph
        # keeps no Python side effects): its unique (token, rank) pairs.
        self.num_received_tokens = None

    def parallelize(self, parallel_dims) -> None:
        if parallel_dims.tp > 1 and parallel_dims.ep == 1:
            raise ValueError(
                f"MoEBlazeRoutedExperts: tensor_parallel_degree={parallel_dims.tp} without expert "
                "parallelism shards torchtitan's experts over TP (expert tensor parallelism); MoEBlaze "
                "experts hold whole experts: use --parallelism.expert_parallel_degree > 1 with TP, "
                "or --parallelism.tensor_parallel_degree 1")
        super().parallelize(parallel_dims)
        mesh = parallel_dims.get_optional_mesh("ep")
        self.ep_group = None if mesh is None or mesh.size() == 1 else mesh.get_group()

    def _local_weights(self):
        """(w1, w3, w2) of this rank's experts as plain tensors (the EP shard of a DTensor)."""
        weights = (self.inner_experts.w1_EFD, self.inner_experts.w3_EFD, self.inner_experts.w2_EDF)
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in weights)

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
        # The counts are stock's grouped-GEMM offsets; the routing plan replaces them.
        del num_local_tokens_per_expert_E
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.shape[-1]
        x = x_BLD.reshape(B * L, D)
        scores = topk_scores_BLK.reshape(B * L, K)
        ids = topk_expert_ids_BLK.reshape(B * L, K)
        w1, w3, w2 = self._local_weights()
        dtype = torch.bfloat16 if self.expert_dtype == "bfloat16" else x.dtype
        y = self._experts(x.to(dtype), scores, ids, w1, w3, w2)
        return y.to(x_BLD.dtype).view(B, -1, D)

    def _experts(self, x, scores, ids, w1, w3, w2):
        if torch.compiler.is_compiling():
            return self._run_compiled(x, scores, ids, w1, w3, w2)
        if self.ep_group is None:
            return self._run_local(x, scores, ids, w1, w3, w2)
        ranks = dist.get_world_size(self.ep_group)
        mode = resolve_ep_mode(self.options.ep_mode, self.options.ring_mode, lambda: layer_traffic(
            group_mean_tokens(x.shape[0], self.ep_group, x.device), x, scores, (w1, w3, w2), ranks))
        if mode == "alltoall":
            return self._run_alltoall(x, scores, ids, w1, w3, w2)
        return self._run_ring(x, scores, ids, w1, w3, w2, mode)

    def _run_compiled(self, x, scores, ids, w1, w3, w2):
        """Under torch.compile (torchtitan's ``--compile.enable``, each block with fullgraph=True):
        the op as one custom op each way (``compiled_op``), which the graph keeps whole; with
        expert parallelism, the token exchange or the ring as custom ops too
        (``compiled_exchange``, ``compiled_ring``)."""
        options = dict(recompute=self.options.recompute, routing_method=self.options.routing_method,
                       backend=self.options.backend)
        if self.ep_group is None:
            return expert_mlp(x, ids, scores, w1, w3, w2, _ACTIVATION, **options)
        mode, chosen = self.options.ep_mode, -1
        if mode == "auto":
            # Chosen at trace time from this rank's token count (eager gathers the group's): the
            # ops check, before any transfer, that every rank chose alike.
            ranks = dist.get_world_size(self.ep_group)
            mode = resolve_ep_mode("auto", self.options.ring_mode,
                                   lambda: layer_traffic(x.shape[0], x, scores, (w1, w3, w2), ranks))
            chosen = MODES.index(mode)
        elif mode == "ring":
            mode = self.options.ring_mode
        if mode == "alltoall":
            return compiled_alltoall_moe(x, ids, scores, w1, w3, w2, self.ep_group, activation=_ACTIVATION,
                                         chosen=chosen, **options)
        del options["recompute"]  # the ring recomputes each hop's first GEMM in backward
        return compiled_ring_moe(x, ids, scores, *_ring_weights(w1, w3, w2, x.dtype), self.ep_group, mode=mode,
                                 activation=_ACTIVATION, chosen=chosen, **options)

    def _run_local(self, x, scores, ids, w1, w3, w2, slots=None):
        """This rank's experts over rows x with local expert ids (-1 unused); ``slots``: how many
        of the ids are used, where known (the plan's expert-order buffers are cut to them)."""
        num_experts = w1.shape[0]
        plan = build_routing_plan(ids, num_experts, method=self.options.routing_method, validate=False)
        if slots is not None:
            plan = plan.trimmed(slots)
        if x.shape[0] == 0:
            # Nothing routed here: moe_mlp keeps the graph connected (zero weight gradients).
            return moe_mlp(x, ids, scores, torch.cat([w1, w3], dim=1).to(x.dtype), w2.to(x.dtype), _ACTIVATION,
                           plan, recompute=self.options.recompute, backend=self.options.backend, validate=False)
        check_split_moe_mlp_args(x, ids, scores, w1, w3, w2, _ACTIVATION, plan, self.options.recompute,
                                 self.options.backend)
        if resolved_backend(x, self.options.backend) == "triton":
            from .fused import TritonMoEMLP as function  # imports Triton: only when the kernels run
        else:
            function = ReferenceMoEMLP
        return _SplitGateUpExperts.apply(function, x.dtype, x, scores, w1, w3, w2, plan, _ACTIVATION,
                                         self.options.recompute)

    def _run_alltoall(self, x, scores, ids, w1, w3, w2):
        """Each token once to every rank holding one of its experts, with that rank's local ids
        and scores; the partial outputs come back and are summed per token in rank order."""
        group = self.ep_group
        exchange, send_ids, send_scores = prepare_send(ids, scores, w1.shape[0], dist.get_world_size(group))
        send_x = exchange.gather(x)
        exchange.exchange_counts(group)
        self.num_received_tokens = exchange.num_received
        recv_ids = exchange.dispatch(send_ids, group)
        out = self._run_local(exchange.dispatch(send_x, group), exchange.dispatch(send_scores, group), recv_ids,
                              w1, w3, w2, slots=exchange.num_received_slots)
        return exchange.combine(exchange.give_back(out, group))

    def _run_ring(self, x, scores, ids, w1, w3, w2, mode):
        """RelayMoE's ring over the EP group: the expert weights or the token blocks travel
        (``mode``: "expert", "token", or "auto": the ring picks by bytes). The stacked fc1 is
        kept for backward by the ring (E_local * 2F * D elements per layer; the local path
        rebuilds it instead)."""
        return ring_moe(x, ids, scores, *_ring_weights(w1, w3, w2, x.dtype), self.ep_group, mode=mode,
                        activation=_ACTIVATION, backend=self.options.backend,
                        routing_method=self.options.routing_method)


def _ring_weights(w1, w3, w2, dtype):
    """(fc1 [E_local, 2F, D] stacked [gate | up], fc2) in ``dtype``: the ring sends whole shards."""
    return torch.cat([w1, w3], dim=1).to(dtype), w2.to(dtype)


class _InnerContext:
    """Stands in for autograd's ctx when ``_SplitGateUpExperts`` runs a core Function's forward
    and backward itself: what the Function saves, and the attributes it sets on ctx."""

    def save_for_backward(self, *tensors):
        self.saved = tensors


class _SplitGateUpExperts(torch.autograd.Function):
    """Runs the op's autograd Function (TritonMoEMLP or ReferenceMoEMLP: forward(ctx, x, probs,
    fc1, fc2 [E, D, F], ...)) on torchtitan's separate w1, w3 and w2: fc1 as the (w1, w3) pair
    for the kernels, stacked [E, 2F, D] for the reference. The weights in the compute dtype are
    made from the parameters in forward and again in backward; in between, only the parameters
    themselves are kept (a cast or stacked copy is 2*E*F*D elements, more than all the
    activations on fine-grained shapes)."""

    @staticmethod
    def forward(ctx, function, dtype, x, probs, w1, w3, w2, *rest):
        fc1, fc2 = _compute_weights(function, w1, w3, w2, dtype)
        inner = _InnerContext()
        inner.needs_input_grad = _inner_needs(ctx.needs_input_grad, len(rest))
        y = function.forward(inner, x, probs, fc1, fc2, *rest)
        saved = list(inner.saved)
        # Slots holding the weights in the compute dtype are rebuilt in backward.
        ctx.weight_slots = [(i, 0 if t is fc1 else 1) for i, t in enumerate(saved) if t is fc1 or t is fc2]
        for i, _ in ctx.weight_slots:
            saved[i] = None
        ctx.save_for_backward(w1, w3, w2, *saved)
        ctx.function, ctx.dtype, ctx.inner, ctx.num_rest = function, dtype, inner, len(rest)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        w1, w3, w2, *saved = ctx.saved_tensors
        weights = _compute_weights(ctx.function, w1, w3, w2, ctx.dtype)
        for i, which in ctx.weight_slots:
            saved[i] = weights[which]
        inner = ctx.inner
        inner.saved_tensors = tuple(saved)
        need = ctx.needs_input_grad
        inner.needs_input_grad = _inner_needs(need, ctx.num_rest)
        grad_x, grad_probs, grad_fc1, grad_fc2 = ctx.function.backward(inner, grad_y)[:4]
        del inner.saved_tensors, weights
        grad_w1 = grad_w3 = None
        if grad_fc1 is not None:
            # The kernels' gradient is a pair already; the reference's, [E, 2F, D], is split.
            grad_w1, grad_w3 = grad_fc1 if isinstance(grad_fc1, tuple) else grad_fc1.split(w1.shape[1], dim=1)
        return (None, None, grad_x if need[2] else None, grad_probs if need[3] else None,
                _as(grad_w1, w1, need[4]), _as(grad_w3, w3, need[5]), _as(grad_fc2, w2, need[6]),
                *(None,) * ctx.num_rest)


def _inner_needs(need, num_rest):
    """The core Function's needs_input_grad (x, probs, fc1, fc2, then the rest, never
    differentiable) from ``_SplitGateUpExperts``'s (function, dtype, x, probs, w1, w3, w2, ...)."""
    return (need[2], need[3], need[4] or need[5], need[6], *(False,) * num_rest)


def _compute_weights(function, w1, w3, w2, dtype):
    """(fc1, fc2 [E, D, F]) in ``dtype`` as ``function`` takes them: fc1 as the (gate, up) pair for
    the kernels, as [gate | up] rows [E, 2F, D] for the reference."""
    return split_fc1(w1, w3, dtype, "reference" if function is ReferenceMoEMLP else "triton"), w2.to(dtype)


def _as(grad, weight, needed):
    """A weight's gradient in the weight's dtype, or None where it is not needed."""
    return grad.to(weight.dtype) if needed and grad is not None else None


@override(
    target=RoutedExperts.Config,
    description="MoEBlaze experts: routing plan and fused gather-GEMM kernels, no permuted copy of the tokens.",
)
def moeblaze_experts(cfg: RoutedExperts.Config, **options) -> MoEBlazeRoutedExperts.Config:
    """Every MoE layer's routed experts -> MoEBlazeRoutedExperts (same weights and keys).

    Options (keyword arguments, from ``--override.imports 'TARGET={"name": value, ...}'``):
    every field of ``MoEBlazeConfig`` (``recompute``: "activation" | "fc1"; ``routing_method``;
    ``backend``: "auto" | "triton" | "reference"; ``ep_mode``: "alltoall" | "ring" | "auto";
    ``ring_mode``: "auto" | "expert" | "token"; their choices are declared in
    ``moeblaze_megatron/config.py``), and ``expert_dtype``: "bfloat16"
    (default, as GroupedExperts) or "input".
    """
    if isinstance(cfg, MoEBlazeRoutedExperts.Config):
        # Applied again: the new options win.
        cfg = derive(cfg, RoutedExperts.Config)
    moeblaze, expert_dtype = moeblaze_options(**options)
    problem = config_problem(cfg)
    if problem is not None:
        raise ValueError(f"{_OVERRIDE}: {problem}")
    return derive(cfg, MoEBlazeRoutedExperts.Config, moeblaze=moeblaze, expert_dtype=expert_dtype)
