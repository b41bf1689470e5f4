"""RelayMoE's ring execution of the experts across P expert-parallel ranks.

No rank ever holds a top-k-expanded dispatch buffer. The ranks form a ring (rank r sends to
r + 1 and receives from r - 1, point to point) and, over P hops, either the expert weights or the
tokens travel:

* expert ring: each rank keeps its tokens; the P weight shards travel. At hop j rank r holds the
  shard of rank s = r - j and runs the fused op on its own rows routed to that shard (ids of other
  shards are -1), adding into its output. The next shard's transfer is posted before this hop's
  compute (two receive buffers, alternating). Backward: the shards travel again; each hop
  recomputes its intermediates (the first GEMM), computes the gradients and frees them; each
  shard's weight gradient travels one hop behind its weights, summed in ring order from its owner
  on, and comes home after the last hop.
* token ring: each rank keeps its experts; the token blocks (rows, ids, probabilities) travel. At
  hop j rank r applies its experts to block b = r - j, and the block's output accumulator, one hop
  behind, collects every rank's partial in ring order and comes home after the last hop. Backward:
  the blocks travel again with their output gradient; the input and probability gradients travel
  home the same way; each rank sums its weight gradients over the blocks in hop order.

Every sum runs in a fixed order, so results are bitwise the same run to run. What autograd keeps
per layer is the layer input, the ids and the probabilities (and the host-side row counts).
Each hop's routing plan is trimmed to the rows routed there (``RoutingPlan.trimmed``), so its
intermediates are one hop's rows, not T * K.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import RING_MODES
from ..moe_mlp import expert_mlp_backward, expert_mlp_forward
from ..reference import compute_dtype
from ..routing import build_routing_plan

__all__ = ["choose_ring", "ring_bytes_per_hop", "ring_moe", "shard_row_counts"]


def shard_row_counts(topk_ids: torch.Tensor, experts_per_rank: int, ep_size: int) -> torch.Tensor:
    """[P] (token, expert) slots of ``topk_ids`` (global ids, -1 unused) routed to each rank's
    shard, on the ids' device (no host synchronization)."""
    shard = torch.where(topk_ids >= 0, torch.div(topk_ids, experts_per_rank, rounding_mode="floor"), ep_size)
    return torch.bincount(shard.reshape(-1).long(), minlength=ep_size + 1)[:ep_size]


def ring_bytes_per_hop(mode: str, *, num_tokens: int, hidden: int, topk: int, weight_numel: int,
                       dtype_bytes: int, prob_bytes: int) -> int:
    """Bytes one rank sends per forward hop: its weight shard (``weight_numel`` elements, fc1 and
    fc2 of its experts), or a token block (rows, int32 ids, probabilities) with its output
    accumulator."""
    if mode == "expert":
        return weight_numel * dtype_bytes
    if mode == "token":
        return num_tokens * (2 * hidden * dtype_bytes + topk * (4 + prob_bytes))
    raise ValueError(f"mode must be one of {RING_MODES}, got {mode!r}")


def choose_ring(*, num_tokens: int, hidden: int, topk: int, weight_numel: int, dtype_bytes: int,
                prob_bytes: int) -> str:
    """The ring that moves fewer bytes per hop, from shapes alone (every rank of the group must see
    the same shapes, as Megatron's fixed sequence length gives; no communication, no host sync)."""
    sizes = dict(num_tokens=num_tokens, hidden=hidden, topk=topk, weight_numel=weight_numel,
                 dtype_bytes=dtype_bytes, prob_bytes=prob_bytes)
    expert, token = (ring_bytes_per_hop(mode, **sizes) for mode in RING_MODES)
    return "expert" if expert <= token else "token"


def ring_moe(x, topk_ids, topk_probs, fc1_weight, fc2_weight, group, *, mode: str, activation: str = "swiglu",
             backend: str = "auto", routing_method: str = "auto") -> torch.Tensor:
    """The MoE experts over an expert-parallel ``group`` of P ranks, as a ring.

    x [T, d] this rank's tokens; topk_ids [T, K] global expert ids (-1 unused); topk_probs [T, K];
    fc1_weight [E_local, 2h or h, d], fc2_weight [E_local, d, h]: this rank's experts (global
    expert e lives on rank e // E_local). ``mode``: ``"expert"`` (weights travel) or ``"token"``
    (token blocks travel). Returns y [T, d], as ``moe_mlp`` over all P * E_local experts would;
    differentiable in x, topk_probs and the weights.
    """
    if mode not in RING_MODES:
        raise ValueError(f"mode must be one of {RING_MODES}, got {mode!r}")
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, d] and topk_ids [T, K] with the same T, got {tuple(x.shape)} "
                         f"and {tuple(topk_ids.shape)}")
    if tuple(topk_probs.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_probs has shape {tuple(topk_probs.shape)}; expected topk_ids' {tuple(topk_ids.shape)}")
    function = _ExpertRing if mode == "expert" else _TokenRing
    return function.apply(x, topk_probs, fc1_weight, fc2_weight, topk_ids.to(torch.int32), group, activation,
                          backend, routing_method)


# ----------------------------------------------------------------------------------------------
# Ring communication


class _Ring:
    """This rank's neighbours on the group and the hop's point-to-point transfers."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send: list[torch.Tensor], recv: list[torch.Tensor]):
        """Post the sends to the next rank and the receives from the previous one (in the same
        order on every rank, so each send meets its receive); returns the works to wait on."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in send if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv if t.numel()]
        return dist.batch_isend_irecv(ops) if ops else []

    @staticmethod
    def wait(works) -> None:
        for work in works:
            work.wait()


def _shard_ids(topk_ids, shard: int, experts_per_rank: int) -> torch.Tensor:
    """``topk_ids`` as ids local to rank ``shard``'s experts, -1 for the slots routed elsewhere."""
    local = topk_ids - shard * experts_per_rank
    return torch.where((topk_ids >= 0) & (local >= 0) & (local < experts_per_rank), local, -1)


class _Hop:
    """One hop's routing: the slots of ``topk_ids`` routed to rank ``shard``'s experts, as local
    ids, and their plan trimmed to the hop's ``rows`` routed slots (its buffers are one hop's rows,
    not T * K). Where K exceeds the experts per rank, a row holds at most that many of them: its
    routed slots move to the first columns (``cols``), so the plan is as wide as the shard."""

    def __init__(self, topk_ids, shard: int, experts_per_rank: int, rows: int, method: str):
        ids = _shard_ids(topk_ids, shard, experts_per_rank)
        self.cols = None
        self.width = ids.shape[1]
        if ids.shape[1] > experts_per_rank:
            # A stable sort of "unused" flags puts each row's routed slots first, in k order.
            self.cols = torch.sort((ids < 0).to(torch.int8), dim=1, stable=True).indices[:, :experts_per_rank]
            ids = ids.gather(1, self.cols)
        self.plan = build_routing_plan(ids, experts_per_rank, method=method, validate=False).trimmed(rows)

    def probs(self, topk_probs):
        return topk_probs if self.cols is None else topk_probs.gather(1, self.cols)

    def spread(self, grad_probs):
        """A gradient of ``probs(topk_probs)`` back in the [T, K] slots (0 elsewhere)."""
        if self.cols is None or grad_probs is None:
            return grad_probs
        full = grad_probs.new_zeros(self.cols.shape[0], self.width)
        return full.scatter_(1, self.cols, grad_probs)


def _add(acc, part):
    """``acc + part`` in compute precision (float32 for 16-bit parts; either may be None: nothing
    there yet)."""
    if part is None:
        return acc
    part = part.to(compute_dtype(part.dtype))
    return part if acc is None else acc + part


def _carry(incoming, part, like):
    """A travelling accumulator after this rank's contribution: ``incoming + part`` in place (one
    rounding to the dtype it travels in, ``like``'s), or, at its first rank, ``part`` itself."""
    if incoming is None:
        return torch.zeros_like(like) if part is None else part.to(like.dtype)
    return incoming if part is None else incoming.add_(part)


# ----------------------------------------------------------------------------------------------
# Expert ring: the weights travel


class _ExpertRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_probs, fc1_weight, fc2_weight, topk_ids, group, activation, backend, method):
        ring = _Ring(group)
        experts = fc1_weight.shape[0]
        # One host synchronization: each hop's rows size its buffers.
        rows = shard_row_counts(topk_ids, experts, ring.size).tolist()
        y = None
        shard = (fc1_weight.detach(), fc2_weight.detach())
        spare = None
        for hop in range(ring.size):
            owner = (ring.rank - hop) % ring.size
            works = []
            if hop < ring.size - 1:
                incoming = spare or tuple(torch.empty_like(w) for w in shard)
                works = ring.start(list(shard), list(incoming))
            if rows[owner]:
                hop_ = _Hop(topk_ids, owner, experts, rows[owner], method)
                y = _add(y, expert_mlp_forward(x, hop_.probs(topk_probs), *shard, hop_.plan, activation, backend,
                                               out_dtype=compute_dtype(x.dtype)))
            ring.wait(works)
            if hop < ring.size - 1:
                # The shard just sent is free for the hop after next (never our own weights).
                spare = shard if hop > 0 else None
                shard = incoming
        ctx.save_for_backward(x, topk_probs, fc1_weight, fc2_weight, topk_ids)
        ctx.config = (group, activation, backend, method, rows)
        return torch.zeros_like(x) if y is None else y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, topk_probs, fc1_weight, fc2_weight, topk_ids = ctx.saved_tensors
        group, activation, backend, method, rows = ctx.config
        ring = _Ring(group)
        experts = fc1_weight.shape[0]
        needs = ctx.needs_input_grad[:4]
        grad_x = grad_probs = None
        shard = (fc1_weight.detach(), fc2_weight.detach())
        spare = None
        # The weight gradient of the shard held at the previous hop, complete up to this rank.
        done = None
        for hop in range(ring.size + 1):
            owner = (ring.rank - hop) % ring.size
            send, recv = [], []
            if hop < ring.size - 1:
                incoming = spare or tuple(torch.empty_like(w) for w in shard)
                send += shard
                recv += incoming
            if hop > 0:
                # The gradient of the shard held now, as far as the previous rank brought it.
                arriving = tuple(torch.empty_like(w) for w in (fc1_weight, fc2_weight))
                send += done
                recv += arriving
            if hop == ring.size:
                # The last shard's gradient goes home; this rank's own arrives.
                if ring.size > 1:
                    ring.wait(ring.start(send, recv))
                break
            works = ring.start(send, recv)
            part = (None, None, None, None)
            if rows[owner]:
                hop_ = _Hop(topk_ids, owner, experts, rows[owner], method)
                part = expert_mlp_backward(grad_y, x, hop_.probs(topk_probs), *shard, hop_.plan, activation,
                                           backend, needs=(needs[0], needs[1], True, True))
                part = (part[0], hop_.spread(part[1]), *part[2:])
            grad_x = _add(grad_x, part[0])
            grad_probs = _add(grad_probs, part[1])
            ring.wait(works)
            done = tuple(_carry(arriving[i] if hop > 0 else None, part[2 + i], w)
                         for i, w in enumerate((fc1_weight, fc2_weight)))
            del part
            if hop < ring.size - 1:
                spare = shard if hop > 0 else None
                shard = incoming
        # After the last hop this rank's own shard's gradient arrived from the previous rank.
        grad_fc1, grad_fc2 = arriving if ring.size > 1 else done
        grad_x = _finish(grad_x, x) if needs[0] else None
        grad_probs = _finish(grad_probs, topk_probs) if needs[1] else None
        return (grad_x, grad_probs, grad_fc1 if needs[2] else None, grad_fc2 if needs[3] else None,
                None, None, None, None, None)


def _finish(acc, like):
    return torch.zeros_like(like) if acc is None else acc.to(like.dtype)


# ----------------------------------------------------------------------------------------------
# Token ring: the token blocks travel


def _block_sizes(ring: _Ring, topk_ids, experts: int) -> list[list[int]]:
    """[P][1 + P]: every rank's token count and its slots routed to each rank's experts (one small
    all-gather, one host synchronization)."""
    mine = torch.cat([torch.tensor([topk_ids.shape[0]], device=topk_ids.device),
                      shard_row_counts(topk_ids, experts, ring.size)]).long()
    table = torch.empty(ring.size, ring.size + 1, dtype=torch.long, device=topk_ids.device)
    dist.all_gather_into_tensor(table.view(-1), mine, group=ring.group)
    return table.tolist()


def _shaped(like, tokens: int):
    """An empty tensor like ``like`` with ``tokens`` rows (allocation only: the caching allocator
    hands back memory without touching it)."""
    return like.new_empty(tokens, *like.shape[1:])


def _empty_block(block, tokens: int):
    """Receive buffers for a block of ``tokens`` rows shaped like ``block``'s tensors."""
    return tuple(_shaped(t, tokens) for t in block)


class _TokenRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_probs, fc1_weight, fc2_weight, topk_ids, group, activation, backend, method):
        ring = _Ring(group)
        experts = fc1_weight.shape[0]
        sizes = _block_sizes(ring, topk_ids, experts)
        block = (x.detach().contiguous(), topk_ids.contiguous(), topk_probs.detach().contiguous())
        y = _token_ring_pass(ring, sizes, block, lambda held, rows: _token_forward(
            held, rows, ring.rank, experts, fc1_weight, fc2_weight, activation, backend, method), x)[0]
        ctx.save_for_backward(x, topk_probs, fc1_weight, fc2_weight, topk_ids)
        ctx.config = (group, activation, backend, method, sizes)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, topk_probs, fc1_weight, fc2_weight, topk_ids = ctx.saved_tensors
        group, activation, backend, method, sizes = ctx.config
        ring = _Ring(group)
        experts = fc1_weight.shape[0]
        needs = ctx.needs_input_grad[:4]
        weight_grads = [None, None]

        def hop(held, rows):
            x_b, ids_b, probs_b, grad_y_b = held
            hop_ = _Hop(ids_b, ring.rank, experts, rows, method)
            gx, gp, g1, g2 = expert_mlp_backward(grad_y_b, x_b, hop_.probs(probs_b), fc1_weight.detach(),
                                                 fc2_weight.detach(), hop_.plan, activation, backend,
                                                 needs=(True, True, needs[2], needs[3]))
            gp = hop_.spread(gp)
            # This rank's weight gradients, summed over the blocks in hop order.
            weight_grads[0] = _add(weight_grads[0], g1)
            weight_grads[1] = _add(weight_grads[1], g2)
            return gx, gp

        block = (x.detach().contiguous(), topk_ids.contiguous(), topk_probs.detach().contiguous(),
                 grad_y.contiguous())
        grad_x, grad_probs = _token_ring_pass(ring, sizes, block, hop, x, topk_probs)
        grad_fc1 = _finish(weight_grads[0], fc1_weight) if needs[2] else None
        grad_fc2 = _finish(weight_grads[1], fc2_weight) if needs[3] else None
        return (grad_x if needs[0] else None, grad_probs if needs[1] else None, grad_fc1, grad_fc2,
                None, None, None, None, None)


def _token_forward(held, rows, rank, experts, fc1_weight, fc2_weight, activation, backend, method):
    x_b, ids_b, probs_b = held
    hop_ = _Hop(ids_b, rank, experts, rows, method)
    return (expert_mlp_forward(x_b, hop_.probs(probs_b), fc1_weight.detach(), fc2_weight.detach(), hop_.plan,
                               activation, backend,
                               out_dtype=compute_dtype(x_b.dtype)),)


def _token_ring_pass(ring: _Ring, sizes, block, compute, *results_like):
    """Send ``block`` (this rank's tensors, T rows each) around the ring; at the hop where this rank
    holds block b, ``compute(held, rows)`` gives its partial results for b's rows (float32 or None
    each, ``rows`` the slots of b routed here). The accumulators of the results, in the dtypes of
    ``results_like``, travel one hop behind their block and come home after the last hop: returns
    this rank's accumulated results."""
    size, rank = ring.size, ring.rank
    held = block
    done = None
    for hop in range(size + 1):
        owner = (rank - hop) % size
        tokens = sizes[owner][0]
        send, recv = [], []
        if hop < size - 1:
            incoming = _empty_block(block, sizes[(owner - 1) % size][0])
            send += held
            recv += incoming
        if hop > 0:
            # The results of the block held now, as far as the previous rank brought them.
            arriving = tuple(_shaped(like, tokens) for like in results_like)
            send += done
            recv += arriving
        if hop == size:
            # The last block's results go home; this rank's own arrive.
            if size == 1:
                return done
            ring.wait(ring.start(send, recv))
            return arriving
        works = ring.start(send, recv)
        rows = sizes[owner][1 + rank]
        parts = compute(held, rows) if rows else (None,) * len(results_like)
        ring.wait(works)
        done = tuple(_carry(arriving[i] if hop > 0 else None, part, _shaped(like, tokens))
                     for i, (part, like) in enumerate(zip(parts, results_like)))
        del parts
        if hop < size - 1:
            held = incoming
    return done
