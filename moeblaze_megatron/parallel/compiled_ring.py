"""RelayMoE's ring (``ring.py``) as ``torch.library`` custom ops, for models under torch.compile at
expert parallelism > 1.

The ring keeps nothing between its passes but the layer's inputs and a small host-side table (each
rank's token count and slots per shard), so each pass is one op whose outputs have the inputs'
shapes: ``moeblaze::ring_forward`` returns y [T, d] and the table (a CPU tensor: it never becomes
graph symbols), and ``moeblaze::ring_backward`` the gradients. The hops and their point-to-point
transfers run inside the ops, as in eager (``ring.ring_forward`` / ``ring_backward``): a compiled
step computes the eager one's bits. Which ring runs is decided by the caller (``parallel.moe``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..passes import PassOptions
from .compiled_exchange import check_same_choice
from .ring import ring_backward, ring_forward
from .traffic import EPMode

__all__ = ["compiled_ring_moe"]

# The host-side tensors the ops pass between them.
_HOST = dict(dtype=torch.int64, device="cpu")


def compiled_ring_moe(x, topk_ids, topk_probs, fc1_weight, fc2_weight, group, mode: EPMode, options: PassOptions,
                      chosen=-1):
    """The ring's result (``ring.RingMoE``'s arguments; ``mode`` one of the rings) as ops that
    torch.compile keeps whole; ``chosen`` as ``compiled_alltoall_moe``'s."""
    y, _ = torch.ops.moeblaze.ring_forward(x, topk_probs, fc1_weight, fc2_weight, topk_ids.to(torch.int32),
                                           group.group_name, mode.value, options.activation, options.backend,
                                           options.routing_method, chosen)
    return y


def _encode(sizes, ranks):
    """The forward's size table as an int64 CPU tensor [ranks, 1 + ranks] (-1 rows: not
    gathered, the expert ring needs this rank's row only)."""
    return torch.tensor([row if row is not None else [-1] * (1 + ranks) for row in sizes], **_HOST)


def _decode(table):
    return [row if row[0] >= 0 else None for row in table.tolist()]


@torch.library.custom_op("moeblaze::ring_forward", mutates_args=())
def _forward(x: torch.Tensor, topk_probs: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor,
             topk_ids: torch.Tensor, group_name: str, mode: str, activation: str, backend: str,
             routing_method: str, chosen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [T, d], the size table [ranks, 1 + ranks] (CPU))."""
    group = _resolve_process_group(group_name)
    if chosen >= 0:
        check_same_choice(chosen, x.shape[0], group, x.device)
    y, sizes = ring_forward(x, topk_probs, fc1_weight, fc2_weight, topk_ids, group, EPMode(mode),
                            _options(activation, backend, routing_method))
    return y, _encode(sizes, dist.get_world_size(group))


def _options(activation, backend, routing_method):
    # The ring keeps no pre-activations (config.ring_recompute_problem).
    return PassOptions(activation, False, backend, routing_method)


@_forward.register_fake
def _forward_fake(x, topk_probs, fc1_weight, fc2_weight, topk_ids, group_name, mode, activation, backend,
                  routing_method, chosen):
    ranks = dist.get_world_size(_resolve_process_group(group_name))
    return x.new_empty(x.shape), torch.empty(ranks, 1 + ranks, **_HOST)


@torch.library.custom_op("moeblaze::ring_backward", mutates_args=())
def _backward(grad_y: torch.Tensor, x: torch.Tensor, topk_probs: torch.Tensor, fc1_weight: torch.Tensor,
              fc2_weight: torch.Tensor, topk_ids: torch.Tensor, sizes: torch.Tensor, group_name: str, mode: str,
              activation: str, backend: str, routing_method: str,
              needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad topk_probs, grad fc1, grad fc2), an empty tensor for each ``needs`` does not
    ask for."""
    grads = ring_backward(grad_y, x, topk_probs, fc1_weight, fc2_weight, topk_ids, _resolve_process_group(group_name),
                          EPMode(mode), _decode(sizes), _options(activation, backend, routing_method), needs)
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


@_backward.register_fake
def _backward_fake(grad_y, x, topk_probs, fc1_weight, fc2_weight, topk_ids, sizes, group_name, mode, activation,
                   backend, routing_method, needs):
    likes = (x, topk_probs, fc1_weight, fc2_weight)
    return tuple(like.new_empty(like.shape) if need else x.new_empty(0) for like, need in zip(likes, needs))


def _setup_context(ctx, inputs, output):
    x, topk_probs, fc1_weight, fc2_weight, topk_ids, group_name, mode, activation, backend, routing_method, _ = inputs
    _, sizes = output
    ctx.save_for_backward(x, topk_probs, fc1_weight, fc2_weight, topk_ids, sizes)
    ctx.options = (group_name, mode, activation, backend, routing_method)
    ctx.mark_non_differentiable(sizes)


def _backward_of_forward(ctx, grad_y, *_):
    x, topk_probs, fc1_weight, fc2_weight, topk_ids, sizes = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:4])
    if grad_y is None:
        grad_y = torch.zeros_like(x)
    grads = torch.ops.moeblaze.ring_backward(grad_y, x, topk_probs, fc1_weight, fc2_weight, topk_ids, sizes,
                                             *ctx.options, needs)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None, None, None, None)


_forward.register_autograd(_backward_of_forward, setup_context=_setup_context)
