"""Autograd graphs that a model keeps between calls, and dropping them.

Megatron's stock token dispatchers (plain objects hanging off each MoE layer) keep the last
forward's router probabilities with their graph attached (``MoEAlltoAllTokenDispatcher.probs``).
After a complete step that graph is spent and holds little; after a step that raised (out of
memory in a memory search) it holds every activation saved up to that layer, tens of GiB at the
Qwen3-MoE-like shape, into the next step.
"""

from __future__ import annotations

import torch


def drop_attached_graphs(modules) -> list[str]:
    """Set to None every tensor attribute with an autograd graph (``grad_fn``) kept by a module
    of ``modules`` (each module's submodules included) or by a plain object hanging off one;
    returns the dropped attributes as ``Owner.name``."""
    dropped = []
    for root in modules:
        for module in root.modules():
            owners = [module] + [value for value in vars(module).values()
                                 if hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.Tensor))]
            for owner in owners:
                for name, value in list(vars(owner).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(owner, name, None)
                        dropped.append(f"{type(owner).__name__}.{name}")
    return dropped
