"""MoEBlazeGroupedMLP: the local experts as two stacked weights, run by ``moe_mlp``.

Weights: ``weight1`` [E_local, 2h, d] for SwiGLU ([gate | up] rows, Megatron's GLU layout) or
[E_local, h, d] for SiLU/GeLU, and ``weight2`` [E_local, d, h], with h = ``moe_ffn_hidden_size``.

Checkpoints are the stock experts': ``state_dict()`` writes the plain layout of the experts this
module replaces (``checkpoint_layout``): SequentialMLP's ``local_experts.{i}.linear_fc1.weight``
[2h, d] and ``local_experts.{i}.linear_fc2.weight`` [d, h] (plus their empty ``_extra_state``), or,
in place of TEGroupedMLP (the Transformer Engine spec with ``moe_grouped_gemm``), its
``linear_fc1.weight{i}`` / ``linear_fc2.weight{i}`` and one ``_extra_state`` per linear.
``load_state_dict()`` reads either layout, TEGroupedMLP's single grouped ``linear_fc1.weight``
[E, 2h, d] and this module's own ``weight1`` / ``weight2``. ``sharded_state_dict()`` describes
the same global tensors under the same keys as SequentialMLP and TEGroupedMLP (which agree:
``{prefix}experts.linear_fc1.weight`` of global shape [E, 2h, d], the SwiGLU halves as separate
shards, and one ``_extra_state`` object per expert and linear), one shard per stacked weight, so
distributed checkpoints load either way and the distributed optimizer finds each parameter.

Initialization follows SequentialMLP draw for draw (expert by expert, fc1 then fc2, in the
expert-parallel RNG stream or on the CPU), so one seed gives both the same weights.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_object_for_checkpoint

from .config import (activation_name, expert_bias_problem, expert_tp_problem, fp8_recipe_problem, get_moeblaze_config,
                     megatron_fp8_format)
from .dispatcher import ExpertRouting
from .parallel.moe import run_routed
from .warmup import start_compile_workers

__all__ = ["CHECKPOINT_LAYOUTS", "MoEBlazeGroupedMLP", "activation_of_config", "expert_activation"]

_FC_NAMES = (("weight1", "linear_fc1"), ("weight2", "linear_fc2"))
# The plain state_dict layouts written: the stock experts' of the spec the module replaces.
CHECKPOINT_LAYOUTS = ("sequential", "te_grouped")


def activation_of_config(config) -> tuple[bool, str]:
    """(gated, the activation function's name) of a TransformerConfig."""
    func = config.activation_func
    name = {F.silu: "silu", F.gelu: "gelu"}.get(func, getattr(func, "__name__", repr(func)))
    return bool(config.gated_linear_unit), name


_said: set = set()


def _say_once(message: str) -> None:
    """One start-up line (on rank 0 where a process group exists), once per process."""
    if message in _said:
        return
    _said.add(message)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"moeblaze: {message}", flush=True)


def expert_options(config):
    """The experts' MoEBlazeConfig for a TransformerConfig: its ``moeblaze`` options with the FP8
    format of ``--fp8-format`` under ``--fp8-recipe blockwise`` (a ValueError naming another
    recipe); a ring mode with FP8 is refused by MoEBlazeConfig's own check."""
    fp8, recipe = getattr(config, "fp8", None), getattr(config, "fp8_recipe", None)
    if fp8 and fp8_recipe_problem(recipe) is not None:
        raise ValueError(f"MoEBlazeGroupedMLP: {fp8_recipe_problem(recipe)}")
    options = get_moeblaze_config(config)
    fp8 = megatron_fp8_format(fp8, recipe)
    return options if options.fp8 == fp8 else dataclasses.replace(options, fp8=fp8)


def expert_activation(config) -> str:
    """``moe_mlp``'s activation for a TransformerConfig: 'swiglu', 'silu' or 'gelu'."""
    return activation_name(*activation_of_config(config))


class MoEBlazeGroupedMLP(MegatronModule):
    """All local experts of one MoE layer; runs behind ``MoEBlazeTokenDispatcher``.

    ``forward(rows [N, d], routing: ExpertRouting, probs [N, K]) -> (out [N, d], None)`` with
    ``out[n] = sum_k probs[n, k] * fc2[e] @ act(fc1[e] @ rows[n])``, e = ``routing.topk_ids[n, k]``.
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None, name: str | None = None,
                 checkpoint_layout: str = "sequential"):
        super().__init__(config=config)
        if checkpoint_layout not in CHECKPOINT_LAYOUTS:
            raise ValueError(f"MoEBlazeGroupedMLP: checkpoint_layout must be one of {CHECKPOINT_LAYOUTS}, "
                             f"got {checkpoint_layout!r}")
        self.checkpoint_layout = checkpoint_layout
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        for problem in (expert_tp_problem(self.tp_group.size()), expert_bias_problem(config.add_bias_linear)):
            if problem is not None:
                raise ValueError(f"MoEBlazeGroupedMLP: {problem}")
        self.activation = expert_activation(config)
        self.options = expert_options(config)
        if self.options.fp8 is not None:
            _say_once(f"experts in FP8 ({self.options.fp8}, blockwise: 1x128 blocks of activations and gradients, "
                      "128x128 of weights, 128x1 along the tokens for the weight gradients)")
        if getattr(config, "moe_router_padding_for_quantization", False):
            _say_once("--moe-router-padding-for-quantization: nothing to pad, the experts take any number of rows "
                      "per expert; the routing is used as the router gave it")
        start_compile_workers(self.options.backend)

        hidden = config.hidden_size
        ffn = config.moe_ffn_hidden_size
        gated = self.activation == "swiglu"
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight1 = torch.nn.Parameter(
            torch.empty(num_local_experts, (2 if gated else 1) * ffn, hidden, device=device, dtype=config.params_dtype)
        )
        self.weight2 = torch.nn.Parameter(
            torch.empty(num_local_experts, hidden, ffn, device=device, dtype=config.params_dtype)
        )
        # The attributes Megatron's DDP, optimizer and grad-norm code read, as on stock experts.
        use_expert_groups = (
            config.expert_model_parallel_size > 1
            or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        for weight, dim, stride in ((self.weight1, 1, 2 if gated else 1), (self.weight2, 2, 1)):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=stride)
            weight.allreduce = not use_expert_groups
        if config.perform_initialization:
            self._initialize_weights()

        self.register_state_dict_post_hook(_save_as_stock_layout)
        self.register_load_state_dict_pre_hook(_load_stock_layouts)

    @torch.no_grad()
    def _initialize_weights(self) -> None:
        for i in range(self.num_local_experts):
            for weight, init_method in (
                (self.weight1, self.config.init_method),
                (self.weight2, self.config.output_layer_init_method),
            ):
                if self.config.use_cpu_initialization:
                    master = torch.empty(weight.shape[1:], dtype=torch.float32)
                    init_method(master)
                    weight[i].copy_(master.to(weight.dtype))
                else:
                    with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                        init_method(weight[i])

    def forward(self, hidden_states: torch.Tensor, routing: ExpertRouting, probs: torch.Tensor):
        if not isinstance(routing, ExpertRouting):
            raise TypeError(
                "MoEBlazeGroupedMLP runs behind MoEBlazeTokenDispatcher "
                "(moe_token_dispatcher_type='moeblaze'): expected an ExpertRouting as second "
                f"argument, got {type(routing).__name__}"
            )
        out = run_routed(hidden_states, routing, probs, self.weight1, self.weight2, options=self.options,
                         activation=self.activation)
        return out, None

    def backward_dw(self) -> None:
        """Weight gradients are computed in backward; nothing is deferred."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """SequentialMLP's sharded tensors (same keys, global shapes, replica ids), one shard per
        stacked weight."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if metadata.get("singleton_local_shards", False):
            raise NotImplementedError(
                "MoEBlazeGroupedMLP does not write singleton_local_shards checkpoints; use the "
                "default distributed checkpoint layout"
            )
        ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
        num_global = ep_size * self.num_local_experts
        expert_axis = len(sharded_offsets)
        # Replicated across expert data parallel ranks, as SequentialMLP marks them.
        replica_id = (0, 0, self.dp_group.rank())
        offsets = (*sharded_offsets, (expert_axis, ep_rank, ep_size))
        sharded = {}
        for param_name, fc in _FC_NAMES:
            key = f"{prefix}experts.{fc}.weight"
            param = getattr(self, param_name)
            if fc == "linear_fc1" and self.activation == "swiglu":
                sharded[f"{prefix}{param_name}"] = _glu_sharded_factory(key, param, offsets, replica_id)
            else:
                sharded[f"{prefix}{param_name}"] = ShardedTensor.from_rank_offsets(
                    key, param, *offsets, replica_id=replica_id, prepend_axis_num=len(sharded_offsets)
                )
            for i in range(self.num_local_experts):
                expert_offsets = (*sharded_offsets, (expert_axis, ep_rank * self.num_local_experts + i, num_global))
                sharded[f"{prefix}local_experts.{i}.{fc}._extra_state"] = make_sharded_object_for_checkpoint(
                    None, f"{prefix}experts.{fc}._extra_state", expert_offsets, replica_id=replica_id
                )
        return sharded


def _glu_sharded_factory(key, param, offsets, replica_id):
    """fc1 of a SwiGLU expert as two shards, gate rows then up rows, as SequentialMLP saves it."""
    prepend = len(offsets) - 1
    row_axis = prepend + 1

    def build(key, data, replica_id, flattened_range):
        if flattened_range is not None:
            raise NotImplementedError("flattened SwiGLU expert shards are not supported")
        gate, up = torch.chunk(data, 2, dim=1)
        return [
            ShardedTensor.from_rank_offsets(
                key, half, *offsets, (row_axis, i, 2), replica_id=replica_id, prepend_axis_num=prepend
            )
            for i, half in enumerate((gate, up))
        ]

    def merge(halves):
        return torch.cat(halves, dim=1)

    return ShardedTensorFactory(key, param, build, merge, replica_id)


def _save_as_stock_layout(module, state_dict, prefix, local_metadata):
    for param_name, fc in _FC_NAMES:
        stacked = state_dict.pop(prefix + param_name).detach()
        if module.checkpoint_layout == "te_grouped":
            for i in range(module.num_local_experts):
                state_dict[f"{prefix}{fc}.weight{i}"] = stacked[i]
            # TE's GroupedLinear keeps one (here empty) extra state per linear; TE loads None.
            state_dict[f"{prefix}{fc}._extra_state"] = None
            continue
        for i in range(module.num_local_experts):
            state_dict[f"{prefix}local_experts.{i}.{fc}.weight"] = stacked[i]
            state_dict[f"{prefix}local_experts.{i}.{fc}._extra_state"] = None


def _load_stock_layouts(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    experts = range(module.num_local_experts)
    for param_name, fc in _FC_NAMES:
        for i in experts:
            state_dict.pop(f"{prefix}local_experts.{i}.{fc}._extra_state", None)
        state_dict.pop(f"{prefix}{fc}._extra_state", None)
        if prefix + param_name in state_dict:
            continue
        for layout in (f"{prefix}local_experts.{{}}.{fc}.weight", f"{prefix}{fc}.weight{{}}"):
            keys = [layout.format(i) for i in experts]
            if all(k in state_dict for k in keys):
                state_dict[prefix + param_name] = torch.stack([state_dict.pop(k) for k in keys])
                break
        else:
            # TEGroupedMLP with moe_single_grouped_weight: one [E_local, out, in] tensor per linear.
            grouped = state_dict.get(f"{prefix}{fc}.weight")
            if torch.is_tensor(grouped) and grouped.dim() == 3 and grouped.shape[0] == module.num_local_experts:
                state_dict[prefix + param_name] = state_dict.pop(f"{prefix}{fc}.weight")
