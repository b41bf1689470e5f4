"""State-dict names of Megatron's Transformer Engine layer spec against its local spec, and the
layout of a distributed checkpoint: what the TE checks (benchlib.te_checks) need to evaluate a TE
model with a local float32 oracle and to compare TEGroupedMLP's checkpoint with MoEBlaze's.

Only names move between the two specs (the same math, the same tensors): TE fuses the layer norm
before a linear into the linear (``self_attention.linear_qkv.layer_norm_weight`` is the local
spec's ``input_layernorm.weight``; in a dense layer ``mlp.linear_fc1.layer_norm_weight`` is
``pre_mlp_layernorm.weight``) and TEGroupedMLP keeps expert i's weights as
``experts.linear_fc{1,2}.weight{i}`` where SequentialMLP has
``experts.local_experts.{i}.linear_fc{1,2}.weight``; TE modules add ``_extra_state`` entries of
their own. torch is imported by the functions.
"""

from __future__ import annotations

import math
import re

__all__ = ["compare_sharded_layouts", "rename_te_key", "sharded_layout", "te_to_local_state"]

_TE_TO_LOCAL = (
    (re.compile(r"(^|\.)self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), r"\1input_layernorm.\2"),
    (re.compile(r"(^|\.)mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r"\1pre_mlp_layernorm.\2"),
    (re.compile(r"(^|\.)experts\.(linear_fc[12])\.(weight|bias)(\d+)$"), r"\1experts.local_experts.\4.\2.\3"),
)


def rename_te_key(key: str) -> str:
    """The local spec's name of a TE spec state-dict (or parameter) name; others unchanged."""
    for pattern, replacement in _TE_TO_LOCAL:
        key = pattern.sub(replacement, key)
    return key


def te_to_local_state(state: dict, target_keys) -> dict:
    """A TE spec model's plain state dict renamed for a local spec model whose state-dict keys are
    ``target_keys``: tensors renamed, TE's ``_extra_state`` entries (and empty placeholder tensors
    the target lacks) dropped, the target's own ``_extra_state`` entries set to None (what
    Megatron's local modules save). KeyError naming every key that would be missing or left over."""
    target = list(target_keys)
    wanted = set(target)
    out = {}
    for key, value in state.items():
        if key.endswith("_extra_state"):
            continue
        new = rename_te_key(key)
        # An empty tensor the target lacks is a placeholder (TE can keep one for an absent bias).
        if new not in wanted and getattr(value, "numel", lambda: 1)() == 0:
            continue
        if new in out:
            raise KeyError(f"two TE keys map to {new!r}")
        out[new] = value
    for key in target:
        if key.endswith("_extra_state") and key not in out:
            out[key] = None
    missing = sorted(set(target) - set(out))
    unexpected = sorted(set(out) - set(target))
    if missing or unexpected:
        raise KeyError(f"TE -> local state dict: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                       f"left over {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    return out


def sharded_layout(sharded_state_dict) -> dict:
    """{checkpoint key: {"kind", "global_shape", "dtype", "chunks", "numel"}} of a sharded state
    dict, factories (the SwiGLU halves) built: what a torch_dist checkpoint of it holds, by key.
    ``numel`` sums the chunks' elements (tensors), so a complete single-process layout covers
    its global shape exactly once."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
        apply_factories,
    )

    # apply_factories replaces factories in place: build them on a copy of the containers.
    def containers(x):
        if isinstance(x, dict):
            return {k: containers(v) for k, v in x.items()}
        if isinstance(x, list):
            return [containers(v) for v in x]
        return x

    built = containers(sharded_state_dict)
    apply_factories(built)
    layout = {}
    for value in nested_values(built):
        if isinstance(value, ShardedTensorFactory):
            raise TypeError(f"unbuilt factory {value.key}")
        if isinstance(value, ShardedTensor):
            entry = layout.setdefault(value.key, {"kind": "tensor", "global_shape": tuple(value.global_shape),
                                                  "dtype": str(value.dtype), "chunks": 0, "numel": 0})
            entry["numel"] += math.prod(value.local_shape)
        elif isinstance(value, ShardedObject):
            entry = layout.setdefault(value.key, {"kind": "object", "global_shape": tuple(value.global_shape),
                                                  "dtype": None, "chunks": 0, "numel": 0})
            entry["numel"] += 1
        else:
            continue
        shape = tuple(value.global_shape)
        if shape != entry["global_shape"]:
            raise ValueError(f"{value.key}: chunks disagree on the global shape ({shape} vs {entry['global_shape']})")
        entry["chunks"] += 1
    return layout


def compare_sharded_layouts(stock: dict, ours: dict) -> dict:
    """Where two sharded_layout()s differ: keys only in one, and keys whose kind, global shape,
    dtype or covered element count differ (the chunking may differ: torch_dist reshards on load).
    ``same`` is True when nothing differs."""
    only_stock = sorted(set(stock) - set(ours))
    only_ours = sorted(set(ours) - set(stock))
    mismatched = []
    for key in sorted(set(stock) & set(ours)):
        a, b = stock[key], ours[key]
        fields = [f for f in ("kind", "global_shape", "dtype", "numel") if a[f] != b[f]]
        if fields:
            mismatched.append({"key": key, "fields": fields, "stock": {f: a[f] for f in fields},
                               "ours": {f: b[f] for f in fields}})
    return {"same": not (only_stock or only_ours or mismatched), "only_stock": only_stock, "only_ours": only_ours,
            "mismatched": mismatched, "keys": len(set(stock) | set(ours)),
            "chunking_differs": sorted(k for k in set(stock) & set(ours) if stock[k]["chunks"] != ours[k]["chunks"])}
