"""Gradients in the stock layout: how a MoEBlaze model's gradients compare with a stock model's."""

from __future__ import annotations

import torch

from ..experts import MoEBlazeGroupedMLP

__all__ = ["sequential_named_grads"]


def sequential_named_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of ``module``'s parameters under their state-dict names, each
    MoEBlazeGroupedMLP's stacked expert gradients split into SequentialMLP's
    ``local_experts.{i}.linear_fc{1,2}.weight`` entries: the form in which they compare with a
    stock model's. Parameters without a gradient are left out."""
    grads = {}
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(mod, MoEBlazeGroupedMLP):
            for param_name, fc in (("weight1", "linear_fc1"), ("weight2", "linear_fc2")):
                grad = getattr(mod, param_name).grad
                if grad is not None:
                    for i in range(mod.num_local_experts):
                        grads[f"{prefix}local_experts.{i}.{fc}.weight"] = grad[i]
            continue
        for name, param in mod.named_parameters(recurse=False):
            if param.grad is not None:
                grads[f"{prefix}{name}"] = param.grad
    return grads

