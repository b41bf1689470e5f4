"""The expert-parallel token exchange (``alltoall.py``) as ``torch.library`` custom ops, for models
under torch.compile at expert parallelism > 1.

torchtitan compiles each transformer block with ``fullgraph=True``. The eager exchange lays out its
send buffer with ``nonzero`` and reads its all-to-all splits on the host, which dynamo cannot trace.
Here each direction of the exchange is one op: ``ep_dispatch`` (layout, count exchange, and the
all-to-all of rows, local ids and probabilities) and ``ep_combine`` (the all-to-all back and the
per-token sum in rank order), each with a backward op. Their data-dependent sizes (rows sent,
rows received, slots received) are unbacked sizes in the compiled graph; the splits travel between
the ops in a small int64 CPU tensor, never through the graph's symbols. The ops call the eager
exchange's own pieces, so a compiled step computes the eager one's bits.

``compiled_alltoall_moe(x, topk_ids, topk_probs, fc1, fc2, group, ...)``: the experts over the
group through these ops and ``moe_mlp`` (its custom ops, under compile), with the received rows'
expert-order buffers cut to the slots actually received.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..moe_mlp import moe_mlp
from ..reference import sum_slots
from .alltoall import _all_to_all, plan_token_exchange
from .traffic import MODES

__all__ = ["check_same_choice", "compiled_alltoall_moe"]

# The splits tensor (int64, CPU, [4, ranks]) holds, per rank, the rows sent to it, the slots they
# carry, the rows received from it and their slots: the host ints of the all-to-alls.
_HOST = dict(dtype=torch.int64, device="cpu")


def compiled_alltoall_moe(x, topk_ids, topk_probs, fc1, fc2, group, *, activation="swiglu", recompute="activation",
                          routing_method="auto", backend="auto", chosen=-1, fp8=None):
    """The experts over ``group`` (x [T, d], global ``topk_ids`` [T, K], this rank's experts: fc1
    [E_local, 2F or F, d] or its (gate, up) pair, fc2 [E_local, d, F]) as ops that torch.compile
    keeps whole. Each token goes once to each rank holding one of its experts; the partial outputs
    come back and are summed per token in rank order. ``chosen``: this mode's index in
    ``traffic.MODES`` where each rank chose it alone (``check_same_choice``), else -1. Arguments
    are checked by the caller (``parallel.moe``)."""
    name = group.group_name
    experts = (fc1[0] if isinstance(fc1, tuple) else fc1).shape[0]
    recv_x, recv_ids, recv_probs, used_slots, send_token, send_slot, _, splits = torch.ops.moeblaze.ep_dispatch(
        x, topk_ids, topk_probs, experts, name, chosen)
    out = moe_mlp(recv_x, recv_ids, recv_probs, fc1, fc2, activation, recompute=recompute, backend=backend,
                  routing_method=routing_method, validate=False, used_slots=used_slots, fp8=fp8)
    return torch.ops.moeblaze.ep_combine(out, send_token, send_slot, splits, name)


def check_same_choice(chosen: int, tokens: int, group, device) -> None:
    """Under ``ep_mode="auto"`` a compiled graph holds one mode, chosen at trace time from this
    rank's own token count (eager gathers the group's first). Before any transfer of either mode
    (this all-gather is the first collective of both), every rank learns every rank's choice, and
    all raise alike if they differ: never one rank in the exchange and another in the ring."""
    mine = torch.tensor([chosen, tokens], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).tolist()
    if len({row[0] for row in table}) > 1:
        raise RuntimeError(
            f"ep_mode='auto' under torch.compile: the ranks chose different modes (indices into {MODES}: "
            f"{[row[0] for row in table]}) from their own token counts {[row[1] for row in table]}; with "
            "token counts that differ between ranks, name the mode (ep_mode='alltoall' or 'ring')")


def _counts(splits):
    return splits.tolist()


@torch.library.custom_op("moeblaze::ep_dispatch", mutates_args=())
def _dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_probs: torch.Tensor, num_local_experts: int,
              group_name: str, chosen: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(received rows [R, d], their local expert ids [R, W] (-1 padded, W = min(K, E_local)) and
    probabilities [R, W], the received slots (0-d, CPU), send_token [S], send_slot [T, ranks],
    send_cols [S, W], the splits [4, ranks] (CPU))."""
    group = _resolve_process_group(group_name)
    if chosen >= 0:
        check_same_choice(chosen, x.shape[0], group, x.device)
    ranks = dist.get_world_size(group)
    exchange, send_ids, send_cols = plan_token_exchange(topk_ids, num_local_experts, ranks)
    exchange.exchange_counts(group)
    send_probs = torch.where(send_ids >= 0, topk_probs[exchange.send_token].gather(1, send_cols), 0)
    recv, send = exchange.recv_counts, exchange.send_counts
    recv_x = _all_to_all(x[exchange.send_token], recv, send, group)
    recv_ids = _all_to_all(send_ids, recv, send, group)
    recv_probs = _all_to_all(send_probs, recv, send, group)
    splits = torch.tensor([exchange.send_counts, exchange.send_slots, exchange.recv_counts, exchange.recv_slots],
                          **_HOST)
    used_slots = torch.tensor(exchange.num_received_slots, **_HOST)
    # The fake implementation's strides and fresh storage (the compiled graph asserts 16-byte
    # alignment): send_token is a row of nonzero's result, send_cols a slice of the sort's indices.
    return (recv_x, recv_ids, recv_probs, used_slots, exchange.send_token.clone(), exchange.send_slot,
            send_cols.contiguous(), splits)


@_dispatch.register_fake
def _dispatch_fake(x, topk_ids, topk_probs, num_local_experts, group_name, chosen):
    ctx = torch.library.get_ctx()
    ranks = dist.get_world_size(_resolve_process_group(group_name))
    width = min(topk_ids.shape[1], num_local_experts)
    received, sent = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    index = dict(dtype=torch.int64, device=topk_ids.device)
    return (x.new_empty(received, x.shape[1]), torch.empty(received, width, dtype=torch.int32, device=x.device),
            topk_probs.new_empty(received, width), torch.empty((), **_HOST),
            torch.empty(sent, **index), torch.empty(topk_ids.shape[0], ranks, **index),
            torch.empty(sent, width, **index), torch.empty(4, ranks, **_HOST))


@torch.library.custom_op("moeblaze::ep_dispatch_backward", mutates_args=())
def _dispatch_backward(grad_x_rows: torch.Tensor, grad_prob_rows: torch.Tensor, recv_ids: torch.Tensor,
                       send_slot: torch.Tensor, send_cols: torch.Tensor, splits: torch.Tensor, topk: int,
                       group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad x [T, d], grad topk_probs [T, K]): each received row's gradients back to its source,
    summed per token in rank order; a probability's gradient to the column it was taken from."""
    group = _resolve_process_group(group_name)
    send, _, recv, _ = _counts(splits)
    grad_x = sum_slots(_all_to_all(grad_x_rows, send, recv, group), send_slot)
    grad_send = _all_to_all(torch.where(recv_ids >= 0, grad_prob_rows, 0), send, recv, group)
    grad_cols = grad_send.new_zeros(grad_send.shape[0], topk).scatter_add_(1, send_cols, grad_send)
    return grad_x, sum_slots(grad_cols, send_slot)


@_dispatch_backward.register_fake
def _dispatch_backward_fake(grad_x_rows, grad_prob_rows, recv_ids, send_slot, send_cols, splits, topk, group_name):
    tokens = send_slot.shape[0]
    return grad_x_rows.new_empty(tokens, grad_x_rows.shape[1]), grad_prob_rows.new_empty(tokens, topk)


def _dispatch_setup(ctx, inputs, output):
    _, topk_ids, _, _, group_name, _ = inputs
    _, recv_ids, _, _, _, send_slot, send_cols, splits = output
    ctx.save_for_backward(recv_ids, send_slot, send_cols, splits)
    ctx.topk, ctx.group_name = topk_ids.shape[1], group_name
    ctx.row_shape, ctx.dtypes = output[0].shape, (output[0].dtype, output[2].dtype)
    ctx.mark_non_differentiable(*output[1:2], *output[3:])


def _dispatch_grad(ctx, grad_x_rows, _, grad_prob_rows, *__):
    recv_ids, send_slot, send_cols, splits = ctx.saved_tensors
    # A received tensor the layer did not use gets no gradient: zeros, so every rank still takes
    # part in both all-to-alls.
    if grad_x_rows is None:
        grad_x_rows = recv_ids.new_zeros(ctx.row_shape, dtype=ctx.dtypes[0])
    if grad_prob_rows is None:
        grad_prob_rows = recv_ids.new_zeros(recv_ids.shape, dtype=ctx.dtypes[1])
    grad_x, grad_probs = torch.ops.moeblaze.ep_dispatch_backward(grad_x_rows, grad_prob_rows, recv_ids, send_slot,
                                                                send_cols, splits, ctx.topk, ctx.group_name)
    return grad_x, None, grad_probs, None, None, None


_dispatch.register_autograd(_dispatch_grad, setup_context=_dispatch_setup)


@torch.library.custom_op("moeblaze::ep_combine", mutates_args=())
def _combine(rows: torch.Tensor, send_token: torch.Tensor, send_slot: torch.Tensor, splits: torch.Tensor,
             group_name: str) -> torch.Tensor:
    """y [T, d]: the rows computed here for every source rank sent back, and each token's partials
    summed in rank order."""
    send, _, recv, _ = _counts(splits)
    return sum_slots(_all_to_all(rows, send, recv, _resolve_process_group(group_name)), send_slot)


@_combine.register_fake
def _combine_fake(rows, send_token, send_slot, splits, group_name):
    return rows.new_empty(send_slot.shape[0], rows.shape[1])


@torch.library.custom_op("moeblaze::ep_combine_backward", mutates_args=())
def _combine_backward(grad_y: torch.Tensor, send_token: torch.Tensor, splits: torch.Tensor, num_rows: int,
                      group_name: str) -> torch.Tensor:
    """grad rows [num_rows, d]: each token's output gradient to every rank that computed for it."""
    send, _, recv, _ = _counts(splits)
    return _all_to_all(grad_y[send_token], recv, send, _resolve_process_group(group_name))


@_combine_backward.register_fake
def _combine_backward_fake(grad_y, send_token, splits, num_rows, group_name):
    return grad_y.new_empty(num_rows, grad_y.shape[1])


def _combine_setup(ctx, inputs, output):
    rows, send_token, _, splits, group_name = inputs
    ctx.save_for_backward(send_token, splits)
    ctx.num_rows, ctx.group_name = rows.shape[0], group_name


def _combine_grad(ctx, grad_y):
    send_token, splits = ctx.saved_tensors
    grad_rows = torch.ops.moeblaze.ep_combine_backward(grad_y.contiguous(), send_token, splits, ctx.num_rows,
                                                       ctx.group_name)
    return grad_rows, None, None, None, None


_combine.register_autograd(_combine_grad, setup_context=_combine_setup)
