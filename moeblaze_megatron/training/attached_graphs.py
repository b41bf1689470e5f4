"""Autograd graphs that a model keeps between calls, and dropping them; step state machines a
step that raised leaves mid-way, and resetting them.

Megatron's stock token dispatchers (plain objects hanging off each MoE layer) keep the last
forward's router probabilities with their graph attached (``MoEAlltoAllTokenDispatcher.probs``).
After a complete step that graph is spent and holds little; after a step that raised (out of
memory in a memory search) it holds every activation saved up to that layer, tens of GiB at the
Qwen3-MoE-like shape, into the next step. Megatron's overlapped shared experts
(``--moe-shared-expert-overlap``) walk a state machine through each forward and assert, at the
next one, that the last reached IDLE: after a step that raised between two of its calls, every
later forward fails.
"""

from __future__ import annotations

from enum import Enum

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


# The attribute of a module that holds a per-forward state machine (an Enum with an IDLE member):
# Megatron's SharedExpertMLP._overlap_state.
STEP_STATE_ATTRIBUTE = "_overlap_state"


def reset_step_states(modules) -> list[str]:
    """Set back to IDLE every per-forward state machine (``STEP_STATE_ATTRIBUTE``) that a module of
    ``modules`` (submodules included) was left in mid-way; returns them as ``Owner.name (STATE)``."""
    reset = []
    for root in modules:
        for module in root.modules():
            state = getattr(module, STEP_STATE_ATTRIBUTE, None)
            idle = getattr(type(state), "IDLE", None) if isinstance(state, Enum) else None
            if idle is not None and state is not idle:
                setattr(module, STEP_STATE_ATTRIBUTE, idle)
                reset.append(f"{type(module).__name__}.{STEP_STATE_ATTRIBUTE} ({state.name})")
    return reset
