"""The expert-parallel token exchange: each token travels once per destination rank.

Stock dispatchers send one copy of a token per chosen expert. Here a token goes to each rank that
holds at least one of its experts exactly once, carrying its expert ids local to that rank
(ascending, -1 padded to min(K, experts per rank)) and the matching router probabilities. The
receiver runs its experts over the received rows (its own routing plan) and sends back one partial
output per received row; the source sums the partials of each token in ascending rank order, so
the result is deterministic.

Send rows are ordered by destination rank, tokens ascending within a rank. Backward mirrors the
forward: the gradient of the combine is a gather, the gradient of the dispatch gather is the same
fixed-order per-token sum, and each all-to-all's gradient is the reverse all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..reference import sum_slots

__all__ = ["TokenExchange", "all_to_all", "plan_token_exchange", "prepare_send"]


@dataclass
class TokenExchange:
    """Who sends which rows where, for one expert-parallel exchange.

    send_token [S]: source token of each send row (rank-major, tokens ascending per rank);
    send_slot [T, R]: row of (token t, rank r) in the send buffer, -1 if t does not go to r;
    send_counts / recv_counts: rows sent to / received from each rank (host ints, the
        all-to-all splits; recv_counts is filled in by ``exchange_counts``);
    send_slots / recv_slots: the (token, expert) slots those rows carry, per rank.
    """

    send_token: torch.Tensor
    send_slot: torch.Tensor
    send_counts: list[int]
    send_slots: list[int]
    recv_counts: list[int] | None = None
    recv_slots: list[int] | None = None

    @property
    def num_received(self) -> int:
        """Rows this rank receives: its (token, rank) pairs from every source."""
        return sum(self.recv_counts)

    @property
    def num_received_slots(self) -> int:
        """The (token, expert) slots of the received rows: how many rows this rank's experts
        compute, what sizes their expert-order buffers (``RoutingPlan.trimmed``)."""
        return sum(self.recv_slots)

    def exchange_counts(self, group) -> None:
        """Tell every rank how many rows, and slots, it gets from this one (a small all-to-all)."""
        send = torch.tensor([self.send_counts, self.send_slots], dtype=torch.int64, device=self.send_token.device)
        recv = torch.empty_like(send.t().contiguous())
        dist.all_to_all_single(recv, send.t().contiguous(), group=group)
        self.recv_counts, self.recv_slots = (list(c) for c in zip(*recv.tolist()))

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """The send buffer: ``rows[send_token]`` (differentiable; deterministic backward)."""
        return _GatherRows.apply(rows, self.send_token, self.send_slot)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-token sum of returned rows, in ascending rank order (adjoint of ``gather``)."""
        return _SumRows.apply(rows, self.send_slot, self.send_token)

    def dispatch(self, send: torch.Tensor, group) -> torch.Tensor:
        """Send buffer -> rows received from every rank (rank-major)."""
        return all_to_all(send, self.recv_counts, self.send_counts, group)

    def give_back(self, received: torch.Tensor, group) -> torch.Tensor:
        """Rows computed for every source rank -> the rows this rank sent, in send order."""
        return all_to_all(received, self.send_counts, self.recv_counts, group)


def plan_token_exchange(topk_ids: torch.Tensor, num_local_experts: int, ep_size: int):
    """Lay out the send buffer for ``topk_ids`` [T, K] (global expert ids, -1 unused).

    Returns the TokenExchange, ``send_ids`` [S, W] and ``send_cols`` [S, W], W = min(K, E_local):
    for each send row, the token's expert ids local to the destination rank in ascending order,
    -1 padded, and the column of ``topk_ids`` each came from (to pick the matching
    probabilities). Synchronizes with the host for the layout's size and the all-to-all splits.
    """
    num_tokens, topk = topk_ids.shape
    device = topk_ids.device
    ids = topk_ids.long()
    used = ids >= 0
    dest_rank = torch.where(used, torch.div(ids, num_local_experts, rounding_mode="floor"), -1)
    to_rank = dest_rank[:, :, None] == torch.arange(ep_size, device=device)  # [T, K, R]
    goes_to = to_rank.any(dim=1)  # [T, R]
    # (rank, token) pairs in row-major order of goes_to.T: rank-major, tokens ascending.
    send_rank, send_token = goes_to.t().nonzero(as_tuple=True)
    # Slots per destination rank: its experts among each token's (one host synchronization for both).
    slots_to = to_rank.sum(dim=(0, 1))
    send_counts, send_slots = torch.stack([goes_to.sum(dim=0), slots_to]).tolist()
    slot = torch.full((num_tokens, ep_size), -1, dtype=torch.long, device=device)
    slot[send_token, send_rank] = torch.arange(send_token.numel(), device=device)
    local = ids[send_token] - send_rank[:, None] * num_local_experts
    here = used[send_token] & (local >= 0) & (local < num_local_experts)
    # A rank holds at most E_local of a token's experts: keep those first (stable, so ascending)
    # and cut the row to min(K, E_local) columns.
    width = min(topk, num_local_experts)
    send_cols = torch.sort(torch.where(here, local, num_local_experts), dim=1, stable=True).indices[:, :width]
    send_ids = torch.where(here, local, -1).gather(1, send_cols).to(torch.int32)
    return TokenExchange(send_token, slot, send_counts, send_slots), send_ids, send_cols


def prepare_send(topk_ids: torch.Tensor, topk_probs: torch.Tensor, num_local_experts: int, ep_size: int):
    """``(exchange, send_ids, send_probs)``: the exchange's layout (``plan_token_exchange``), and
    per send row the destination's local expert ids and their router probabilities (0 where
    unused; differentiable in ``topk_probs``)."""
    exchange, send_ids, send_cols = plan_token_exchange(topk_ids, num_local_experts, ep_size)
    send_probs = torch.where(send_ids >= 0, exchange.gather(topk_probs).gather(1, send_cols), 0)
    return exchange, send_ids, send_probs


def all_to_all(x: torch.Tensor, recv_counts, send_counts, group) -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0 (integer tensors pass without a graph)."""
    if x.dtype.is_floating_point:
        return _AllToAll.apply(x, recv_counts, send_counts, group)
    return _all_to_all(x, recv_counts, send_counts, group)


def _all_to_all(x, recv_counts, send_counts, group):
    x = x.contiguous()
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x, recv_counts, send_counts, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, recv_counts, send_counts, group):
        ctx.counts = (recv_counts, send_counts)
        ctx.group = group
        return _all_to_all(x, recv_counts, send_counts, group)

    @staticmethod
    def backward(ctx, grad):
        recv_counts, send_counts = ctx.counts
        return _all_to_all(grad, send_counts, recv_counts, ctx.group), None, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send_token, send_slot):
        ctx.save_for_backward(send_slot)
        return rows[send_token]

    @staticmethod
    def backward(ctx, grad):
        (send_slot,) = ctx.saved_tensors
        return sum_slots(grad.contiguous(), send_slot), None, None


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send_slot, send_token):
        ctx.save_for_backward(send_token)
        return sum_slots(rows, send_slot)

    @staticmethod
    def backward(ctx, grad):
        (send_token,) = ctx.saved_tensors
        return grad[send_token], None, None
