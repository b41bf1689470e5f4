"""RelayMoE's ring (``ring.py``) as ``torch.library`` custom ops, for models under torch.compile at
expert parallelism > 1.

The ring keeps nothing between its passes but the layer's inputs and a small host-side table (each
rank's token count and slots per shard), so each pass is one op whose outputs have the inputs'
shapes: ``moeblaze::ring_forward`` returns y [T, d], the table and the ring that ran (a CPU
tensor each: the table never becomes graph symbols), and ``moeblaze::ring_backward`` the
gradients. The hops, their point-to-point transfers and, with ``mode="auto"``, the choice of ring
run inside the ops, as in eager (``ring.ring_forward`` / ``ring_backward``): a compiled step
computes the eager one's bits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..config import RING_MODES
from .compiled_exchange import check_same_choice
from .ring import check_ring_args, ring_backward, ring_forward

__all__ = ["compiled_ring_moe"]

# The host-side tensors the ops pass between them.
_HOST = dict(dtype=torch.int64, device="cpu")


def compiled_ring_moe(x, topk_ids, topk_probs, fc1_weight, fc2_weight, group, *, mode="auto", activation="swiglu",
                      backend="auto", routing_method="auto", chosen=-1):
    """``ring_moe``'s arguments and result as ops that torch.compile keeps whole; ``chosen`` as
    ``compiled_alltoall_moe``'s."""
    check_ring_args(x, topk_ids, topk_probs, fc1_weight, fc2_weight, mode)
    y, _, _ = torch.ops.moeblaze.ring_forward(x, topk_probs, fc1_weight, fc2_weight, topk_ids.to(torch.int32),
                                              group.group_name, mode, activation, backend, routing_method, chosen)
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
             routing_method: str, chosen: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [T, d], the size table [ranks, 1 + ranks] (CPU), the ring that ran: an index into
    RING_MODES (0-d, CPU))."""
    group = _resolve_process_group(group_name)
    if chosen >= 0:
        check_same_choice(chosen, x.shape[0], group, x.device)
    y, ran, sizes = ring_forward(x, topk_probs, fc1_weight, fc2_weight, topk_ids, group, mode, activation, backend,
                                 routing_method)
    return y, _encode(sizes, dist.get_world_size(group)), torch.tensor(RING_MODES.index(ran), **_HOST)


@_forward.register_fake
def _forward_fake(x, topk_probs, fc1_weight, fc2_weight, topk_ids, group_name, mode, activation, backend,
                  routing_method, chosen):
    ranks = dist.get_world_size(_resolve_process_group(group_name))
    return x.new_empty(x.shape), torch.empty(ranks, 1 + ranks, **_HOST), torch.empty((), **_HOST)


@torch.library.custom_op("moeblaze::ring_backward", mutates_args=())
def _backward(grad_y: torch.Tensor, x: torch.Tensor, topk_probs: torch.Tensor, fc1_weight: torch.Tensor,
              fc2_weight: torch.Tensor, topk_ids: torch.Tensor, sizes: torch.Tensor, ran: torch.Tensor,
              group_name: str, activation: str, backend: str, routing_method: str,
              needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad topk_probs, grad fc1, grad fc2), an empty tensor for each ``needs`` does not
    ask for."""
    grads = ring_backward(grad_y, x, topk_probs, fc1_weight, fc2_weight, topk_ids, _resolve_process_group(group_name),
                          RING_MODES[int(ran)], _decode(sizes), activation, backend, routing_method, needs)
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


@_backward.register_fake
def _backward_fake(grad_y, x, topk_probs, fc1_weight, fc2_weight, topk_ids, sizes, ran, group_name, activation,
                   backend, routing_method, needs):
    likes = (x, topk_probs, fc1_weight, fc2_weight)
    return tuple(like.new_empty(like.shape) if need else x.new_empty(0) for like, need in zip(likes, needs))


def _setup_context(ctx, inputs, output):
    x, topk_probs, fc1_weight, fc2_weight, topk_ids, group_name, _, activation, backend, routing_method, _ = inputs
    _, sizes, ran = output
    ctx.save_for_backward(x, topk_probs, fc1_weight, fc2_weight, topk_ids, sizes, ran)
    ctx.options = (group_name, activation, backend, routing_method)
    ctx.mark_non_differentiable(sizes, ran)


def _backward_of_forward(ctx, grad_y, *_):
    x, topk_probs, fc1_weight, fc2_weight, topk_ids, sizes, ran = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:4])
    if grad_y is None:
        grad_y = torch.zeros_like(x)
    grads = torch.ops.moeblaze.ring_backward(grad_y, x, topk_probs, fc1_weight, fc2_weight, topk_ids, sizes, ran,
                                             *ctx.options, needs)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None, None, None, None)


_forward.register_autograd(_backward_of_forward, setup_context=_setup_context)
