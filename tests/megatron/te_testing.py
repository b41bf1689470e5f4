"""Megatron's TEGroupedMLP on a machine without Transformer Engine: its grouped linears replaced by
stand-ins with TE's state-dict and checkpoint layout, so that the plugin's TE-spec path (the
experts swap, the plain and distributed checkpoint layouts) is tested on the CPU.

TEGroupedMLP itself is Megatron's class (megatron/core/transformer/moe/experts.py: its forward,
activation and ``sharded_state_dict``, which adds the SwiGLU split and the sequential-style keys).
Only its two GroupedLinear submodules are stand-ins: TE's TEColumnParallelGroupedLinear /
TERowParallelGroupedLinear exist only where TE imports. Their ``sharded_state_dict`` transcribes
``TEGroupedLinear._sharded_state_dict_grouped`` of megatron-core 0.19.2
(megatron/core/extensions/transformer_engine.py) at world size 1 without fp8: per GEMM i a
``weight`` ShardedTensor (TP axis 0 for the column-parallel fc1, 1 for the row-parallel fc2) and an
``_extra_state`` ShardedObject, both offset along the expert axis to the global expert, keys
``{prefix}weight`` / ``{prefix}_extra_state``, dict keys ``{prefix}weight{i}`` and
``{prefix}_extra_state{'' if i == 0 else i}``, replica ids (PP, TP, expert-DP rank).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

__all__ = ["FakeTEColumnParallelGroupedLinear", "FakeTERowParallelGroupedLinear", "te_grouped_experts",
           "with_te_grouped_experts"]


class _FakeTEGroupedLinear(torch.nn.Module):
    tp_axis = 0

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                 is_expert=True, tp_comm_buffer_name=None, pg_collection=None, name=None):
        super().__init__()
        if bias:
            raise NotImplementedError("the stand-in has no biases (the tests use --disable-bias-linear)")
        self.num_gemms, self.use_bias = num_gemms, False
        self._pg_collection = pg_collection
        self._tp_group = pg_collection.expt_tp
        self.extra_states_loaded = []
        # TE merges the per-GEMM extra states of a distributed checkpoint (_extra_state1..N-1)
        # into _extra_state before loading (merge_extra_states; empty without fp8).
        self._register_load_state_dict_pre_hook(self._merge_extra_states)
        for i in range(num_gemms):
            weight = torch.empty(output_size, input_size, dtype=config.params_dtype)
            if config.perform_initialization:
                init_method(weight)
            self.register_parameter(f"weight{i}", torch.nn.Parameter(weight))

    def forward(self, x, m_splits):
        chunks = torch.split(x, list(m_splits))
        out = torch.cat([chunk @ getattr(self, f"weight{i}").t() for i, chunk in enumerate(chunks)])
        return out, None

    def _merge_extra_states(self, state_dict, prefix, *args):
        for i in range(1, self.num_gemms):
            state_dict.pop(f"{prefix}_extra_state{i}", None)

    # TE without fp8 saves an empty byte tensor and ignores None or an empty tensor on load.
    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        if state is not None and not (torch.is_tensor(state) and state.numel() == 0):
            raise ValueError(f"unexpected extra state {state!r}")
        self.extra_states_loaded.append(state)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        tp_axis_map = {f"{i}.weight": self.tp_axis for i in range(self.num_gemms)}
        ep = self._pg_collection.ep
        num_global_experts = ep.size() * self.num_gemms
        local_offset = ep.rank() * self.num_gemms
        ep_axis = len(sharded_offsets)
        sharded = {}
        for i in range(self.num_gemms):
            state = {f"{i}.weight": getattr(self, f"weight{i}"), f"{i}._extra_state": self.get_extra_state()}
            sub = make_sharded_tensors_for_checkpoint(
                state, "", tp_axis_map, (*sharded_offsets, (ep_axis, local_offset + i, num_global_experts)),
                tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"],
            )
            replace_prefix_for_sharding(sub, f"{i}.", prefix)
            sharded[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            sharded[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
        expt_dp = self._pg_collection.expt_dp
        objects_dp = getattr(self._pg_collection, "expt_dp_gtp_remat", None) or expt_dp
        for value in sharded.values():
            group = objects_dp if isinstance(value, ShardedObject) else expt_dp
            value.replica_id = (*value.replica_id[:2], group.rank())
        return sharded


class FakeTEColumnParallelGroupedLinear(_FakeTEGroupedLinear):
    tp_axis = 0


class FakeTERowParallelGroupedLinear(_FakeTEGroupedLinear):
    tp_axis = 1


def te_grouped_experts():
    """The experts builder of Megatron's TE spec with ``moe_grouped_gemm`` (TEGroupedMLP), the
    stand-in linears inside."""
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    return functools.partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
        linear_fc1=FakeTEColumnParallelGroupedLinear, linear_fc2=FakeTERowParallelGroupedLinear))


def with_te_grouped_experts(mlp_spec):
    """An MoE layer builder (``partial(MoELayer, submodules=MoESubmodules(...))``) with
    TEGroupedMLP experts; any other builder (a dense MLP) unchanged."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if not (isinstance(mlp_spec, functools.partial) and mlp_spec.func is MoELayer):
        return mlp_spec
    submodules = dataclasses.replace(mlp_spec.keywords["submodules"], experts=te_grouped_experts())
    return functools.partial(MoELayer, *mlp_spec.args, **{**mlp_spec.keywords, "submodules": submodules})
