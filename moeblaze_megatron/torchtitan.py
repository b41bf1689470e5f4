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
three grouped GEMMs and a scatter-add, the experts run through the expert-parallel front
(``parallel.moe.expert_parallel_moe``, the same one Megatron's experts use): ``moe_mlp`` over a
routing plan (the fused gather-GEMM kernels on CUDA, the PyTorch reference on the CPU); the
router scores multiply the expert outputs, as in torchtitan's combine. With expert parallelism
each token travels once to every rank holding one of its experts (``parallel.alltoall``) or
around RelayMoE's ring (``parallel.ring``), over torchtitan's expert-parallel mesh. Under
torch.compile (torchtitan's ``--compile.enable``) the op, the exchange and the ring run as
``torch.library`` custom ops that the compiled graph keeps whole.

Weights and checkpoints: the ``inner_experts`` child is torchtitan's own ``GroupedExperts``
module, untouched: ``w1_EFD`` (gate) and ``w3_EFD`` (up) [E, F, D] and ``w2_EDF`` [E, D, F], the
same parameters, FQNs, initializers, sharding configs (``Shard(0)`` over the EP mesh) and
state-dict keys, so checkpoints (model and optimizer) move freely between stock torchtitan and
the override. ``moe_mlp`` takes w1 and w3 as the (gate, up) pair (the kernels read them where they
are and their gradients come back as two tensors; the reference stacks them inside each pass),
so only the parameters are kept between the passes. Like ``GroupedExperts``, the experts compute
in bfloat16 whatever the parameter dtype (``expert_dtype="input"`` computes in the input's dtype
instead): a cast copy, made in each pass, where the parameters are in another dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torchtitan.config import override
from torchtitan.config.override import derive
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

from .config import MoEBlazeConfig, OptionError
from .parallel.moe import expert_parallel_moe
from .warmup import start_compile_workers

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
    except OptionError as error:
        raise ValueError(f"{_OVERRIDE}: {error}") from None


def config_problem(cfg: RoutedExperts.Config) -> str | None:
    """Why the override cannot take a routed-experts config (None: it can)."""
    inner = cfg.inner_experts
    if type(inner) is not GroupedExperts.Config:
        owner = getattr(type(inner), "_owner", None)
        name = f"{owner.__name__}.Config" if owner is not None else type(inner).__qualname__
        quantized = name.startswith(("Float8", "MX", "NVFP4"))
        advice = (": torchtitan's quantized experts (Float8GroupedExpertsConverter and its kin) do not compose "
                  "with MoEBlaze's; keep the converter for the dense layers only (Float8LinearConverter) and give "
                  "the override {\"fp8\": \"e4m3\"} for FP8 experts") if quantized else ""
        return (f"inner_experts is {name}; MoEBlaze replaces torchtitan's GroupedExperts "
                "(w1/w3 [E, F, D], w2 [E, D, F], SwiGLU, no bias) only: not fused gate/up weights "
                f"(fused_grouped_experts), GPT-OSS experts or quantized (float8 / MX) experts{advice}")
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
            return expert_parallel_moe(x, ids, scores, (w1, w3), w2, self.ep_group, options=self.options,
                                       activation=_ACTIVATION)
        record = {}
        y = expert_parallel_moe(x, ids, scores, (w1, w3), w2, self.ep_group, options=self.options,
                                activation=_ACTIVATION, record=record)
        self.num_received_tokens = record.get("received_tokens", self.num_received_tokens)
        return y


@override(
    target=RoutedExperts.Config,
    description="MoEBlaze experts: routing plan and fused gather-GEMM kernels, no permuted copy of the tokens.",
)
def moeblaze_experts(cfg: RoutedExperts.Config, **options) -> MoEBlazeRoutedExperts.Config:
    """Every MoE layer's routed experts -> MoEBlazeRoutedExperts (same weights and keys).

    Options (keyword arguments, from ``--override.imports 'TARGET={"name": value, ...}'``):
    every field of ``MoEBlazeConfig`` (``recompute``: "activation" | "fc1"; ``routing_method``;
    ``backend``: "auto" | "triton" | "reference"; ``ep_mode``: "alltoall" | "ring" | "auto";
    ``ring_mode``: "auto" | "expert" | "token"; ``fp8``: null | "e4m3" | "hybrid", the experts' GEMMs
    under the blockwise FP8 recipe; their choices are declared in
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
