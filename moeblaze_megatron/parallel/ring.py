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

Which ring runs is decided by the expert-parallel front (``parallel.moe.resolve_mode``); the
passes here take it resolved (``EPMode.EXPERT_RING`` or ``EPMode.TOKEN_RING``). The ring keeps
no pre-activations: it needs ``recompute="fc1"`` (``config.ring_recompute_problem``).

Every sum runs in a fixed order, so results are bitwise the same run to run; the sums that travel
are float32 (for 16-bit inputs) and rounded once, at home. What autograd keeps per layer is the
layer input, the ids and the probabilities (and the host-side row counts).
Each hop's routing plan is trimmed to the rows routed there (``RoutingPlan.trimmed``), so its
intermediates are one hop's rows, not T * K.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import passes
from ..passes import PassOptions
from ..reference import compute_dtype
from .traffic import EPMode

__all__ = ["RingMoE", "hop_backward", "hop_forward", "ring_backward", "ring_forward",
           "shard_row_counts"]


def shard_row_counts(topk_ids: torch.Tensor, experts_per_rank: int, ep_size: int) -> torch.Tensor:
    """[P] (token, expert) slots of ``topk_ids`` (global ids, -1 unused) routed to each rank's
    shard, on the ids' device (no host synchronization)."""
    shard = torch.where(topk_ids >= 0, torch.div(topk_ids, experts_per_rank, rounding_mode="floor"), ep_size)
    return torch.bincount(shard.reshape(-1).long(), minlength=ep_size + 1)[:ep_size]


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

    def sizes(self, topk_ids, experts: int) -> list[list[int]]:
        """[P][1 + P]: every rank's token count and its slots routed to each rank's experts (one
        small all-gather, one host synchronization)."""
        mine = torch.cat([torch.tensor([topk_ids.shape[0]], device=topk_ids.device),
                          shard_row_counts(topk_ids, experts, self.size)]).long()
        table = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(table, mine, group=self.group)
        return torch.stack(table).tolist()


def _shard_ids(topk_ids, shard: int, experts_per_rank: int) -> torch.Tensor:
    """``topk_ids`` as ids local to rank ``shard``'s experts, -1 for the slots routed elsewhere."""
    local = topk_ids - shard * experts_per_rank
    return torch.where((topk_ids >= 0) & (local >= 0) & (local < experts_per_rank), local, -1)


class _Hop:
    """One hop's routing: the slots of ``topk_ids`` routed to rank ``shard``'s experts, as local
    ids, and their plan trimmed to the hop's ``rows`` routed slots (its buffers are one hop's rows,
    not T * K). Where K exceeds the experts per rank, a row holds at most that many of them: its
    routed slots move to the first columns (``cols``), so the plan is as wide as the shard."""

    def __init__(self, x, topk_ids, topk_probs, weights, shard: int, rows: int, options: PassOptions, needs):
        experts_per_rank = weights[0].shape[0]
        ids = _shard_ids(topk_ids, shard, experts_per_rank)
        self.cols = None
        self.width = ids.shape[1]
        if ids.shape[1] > experts_per_rank:
            # A stable sort of "unused" flags puts each row's routed slots first, in k order.
            self.cols = torch.sort((ids < 0).to(torch.int8), dim=1, stable=True).indices[:, :experts_per_rank]
            ids = ids.gather(1, self.cols)
        self.probs = topk_probs if self.cols is None else topk_probs.gather(1, self.cols)
        self.plan = passes.build_plan(x, ids, self.probs, *weights, experts_per_rank, options, needs, used_slots=rows)

    def spread(self, grad_probs):
        """A gradient of ``probs(topk_probs)`` back in the [T, K] slots (0 elsewhere)."""
        if self.cols is None or grad_probs is None:
            return grad_probs
        full = grad_probs.new_zeros(self.cols.shape[0], self.width)
        return full.scatter_(1, self.cols, grad_probs)


def hop_forward(x, topk_ids, topk_probs, weights, shard: int, rows: int, options: PassOptions) -> torch.Tensor:
    """One hop's partial output [T, d] in compute precision: ``x``'s slots routed to rank
    ``shard``'s experts (``topk_ids`` global) through ``weights`` (that shard's fc1 and fc2),
    nothing saved (``options.save_pre`` is False on the ring). ``rows`` must be exactly the count
    of those slots (``shard_row_counts``): it sizes the hop's buffers, unchecked (a check would
    synchronize with the host)."""
    hop = _Hop(x, topk_ids, topk_probs, weights, shard, rows, options, (True,) * 4)
    return passes.forward(x, hop.probs, *weights, hop.plan, options, out_dtype=compute_dtype(x.dtype))[0]


def hop_backward(grad_y, x, topk_ids, topk_probs, weights, shard: int, rows: int, options: PassOptions,
                 needs) -> tuple:
    """One hop's gradients ``(x, probs [T, K], fc1, fc2)`` (None where ``needs`` says), its first
    GEMM recomputed."""
    hop = _Hop(x, topk_ids, topk_probs, weights, shard, rows, options, needs)
    grad_x, grad_probs, grad_fc1, grad_fc2 = passes.backward(grad_y, x, hop.probs, None, *weights, hop.plan, None,
                                                             options, needs)
    return grad_x, hop.spread(grad_probs), grad_fc1, grad_fc2


def _add(acc, part):
    """``acc + part`` in compute precision (float32 for 16-bit parts; either may be None: nothing
    there yet)."""
    if part is None:
        return acc
    part = part.to(compute_dtype(part.dtype))
    return part if acc is None else acc + part


def _carry(incoming, part, shape, dtype, device):
    """A travelling accumulator after this rank's contribution: ``incoming + part`` in place, or,
    at its first rank, ``part`` as a ``dtype`` tensor (zeros of ``shape`` where this rank adds
    nothing)."""
    if incoming is None:
        return torch.zeros(shape, dtype=dtype, device=device) if part is None else part.to(dtype)
    return incoming if part is None else incoming.add_(part)


def _finish(acc, like):
    """An accumulated result in ``like``'s dtype (zeros if nothing was added)."""
    return torch.zeros_like(like) if acc is None else acc.to(like.dtype)


def ring_forward(x, topk_probs, fc1_weight, fc2_weight, topk_ids, group, mode: EPMode, options: PassOptions):
    """The ring's forward pass, nothing saved: ``(y, the host-side sizes its backward takes)``.
    ``topk_ids`` int32; ``mode`` one of the rings."""
    ring = _Ring(group)
    experts = fc1_weight.shape[0]
    if mode is EPMode.EXPERT_RING:
        # Only this rank's rows per shard are needed: no all-gather.
        sizes = [None] * ring.size
        sizes[ring.rank] = [topk_ids.shape[0], *shard_row_counts(topk_ids, experts, ring.size).tolist()]
        run = _expert_forward
    elif mode is EPMode.TOKEN_RING:
        sizes = ring.sizes(topk_ids, experts)
        run = _token_forward
    else:
        raise ValueError(f"mode must be a ring (EPMode.EXPERT_RING or EPMode.TOKEN_RING), got {mode!r}")
    y = run(ring, sizes, x, topk_ids, topk_probs, (fc1_weight, fc2_weight), options)
    return y, sizes


def ring_backward(grad_y, x, topk_probs, fc1_weight, fc2_weight, topk_ids, group, mode: EPMode, sizes,
                  options: PassOptions, needs):
    """The ring's backward pass (``sizes`` as ``ring_forward`` returned them): the gradients of
    (x, topk_probs, fc1, fc2), None where ``needs`` says."""
    run = _expert_backward if mode is EPMode.EXPERT_RING else _token_backward
    grads = run(_Ring(group), sizes, grad_y.contiguous(), x, topk_ids, topk_probs, (fc1_weight, fc2_weight), options,
                needs)
    return tuple(g if need else None for g, need in zip(grads, needs))


class RingMoE(torch.autograd.Function):
    """The ring's autograd: keeps the layer input, the probabilities, the ids and the weights (and
    the host-side sizes), nothing of rows x hidden."""

    @staticmethod
    def forward(ctx, x, topk_probs, fc1_weight, fc2_weight, topk_ids, group, mode, options):
        y, sizes = ring_forward(x.detach(), topk_probs.detach(), fc1_weight.detach(), fc2_weight.detach(), topk_ids,
                                group, mode, options)
        ctx.save_for_backward(x, topk_probs, fc1_weight, fc2_weight, topk_ids)
        ctx.config = (group, mode, sizes, options)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, topk_probs, fc1_weight, fc2_weight, topk_ids = ctx.saved_tensors
        group, mode, sizes, options = ctx.config
        grads = ring_backward(grad_y, x, topk_probs, fc1_weight.detach(), fc2_weight.detach(), topk_ids, group, mode,
                              sizes, options, ctx.needs_input_grad[:4])
        return (*grads, None, None, None, None)


# ----------------------------------------------------------------------------------------------
# Expert ring: the weights travel


def _expert_forward(ring, sizes, x, topk_ids, topk_probs, weights, options):
    rows = sizes[ring.rank][1:]
    y = None
    shard, spare = weights, None
    for hop in range(ring.size):
        owner = (ring.rank - hop) % ring.size
        works = []
        if hop < ring.size - 1:
            incoming = spare or tuple(torch.empty_like(w) for w in shard)
            # The next shard's transfer runs while this one computes.
            works = ring.start(list(shard), list(incoming))
        if rows[owner]:
            y = _add(y, hop_forward(x, topk_ids, topk_probs, shard, owner, rows[owner], options))
        ring.wait(works)
        if hop < ring.size - 1:
            # The shard just sent is free for the hop after next (never our own weights).
            spare = shard if hop > 0 else None
            shard = incoming
    return _finish(y, x)


def _expert_backward(ring, sizes, grad_y, x, topk_ids, topk_probs, weights, options, needs):
    rows = sizes[ring.rank][1:]
    want_weights = needs[2] or needs[3]
    # Each shard's gradient travels in float32 one hop behind its weights, from its owner on, and
    # is rounded once, at home.
    acc = compute_dtype(weights[0].dtype)
    grad_x = grad_probs = None
    shard, spare = weights, None
    done = arriving = None
    for hop in range(ring.size + 1):
        owner = (ring.rank - hop) % ring.size
        send, recv = [], []
        if hop < ring.size - 1:
            incoming = spare or tuple(torch.empty_like(w) for w in shard)
            send += shard
            recv += incoming
        if hop > 0 and want_weights:
            # The gradient of the shard held now, as far as the previous rank brought it.
            arriving = tuple(torch.empty(w.shape, dtype=acc, device=w.device) for w in weights)
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
            part = hop_backward(grad_y, x, topk_ids, topk_probs, shard, owner, rows[owner], options,
                                needs=(needs[0], needs[1], want_weights, want_weights))
        grad_x = _add(grad_x, part[0])
        grad_probs = _add(grad_probs, part[1])
        ring.wait(works)
        if want_weights:
            done = tuple(_carry(arriving[i] if hop > 0 else None, part[2 + i], w.shape, acc, w.device)
                         for i, w in enumerate(weights))
        del part
        if hop < ring.size - 1:
            spare = shard if hop > 0 else None
            shard = incoming
    if want_weights:
        # After the last hop this rank's own shard's gradient arrived from the previous rank.
        grad_fc1, grad_fc2 = (_finish(g, w) for g, w in zip(arriving if ring.size > 1 else done, weights))
    else:
        grad_fc1 = grad_fc2 = None
    return _finish(grad_x, x), _finish(grad_probs, topk_probs), grad_fc1, grad_fc2


# ----------------------------------------------------------------------------------------------
# Token ring: the token blocks travel


def _token_forward(ring, sizes, x, topk_ids, topk_probs, weights, options):

    def hop(held, rows):
        x_b, ids_b, probs_b = held
        return (hop_forward(x_b, ids_b, probs_b, weights, ring.rank, rows, options),)

    block = (x.contiguous(), topk_ids.contiguous(), topk_probs.contiguous())
    (y,) = _token_ring_pass(ring, sizes, block, hop, [(x.shape[1:], compute_dtype(x.dtype))])
    return y.to(x.dtype)


def _token_backward(ring, sizes, grad_y, x, topk_ids, topk_probs, weights, options, needs):
    want_weights = needs[2] or needs[3]
    weight_grads = [None, None]

    def hop(held, rows):
        x_b, ids_b, probs_b, grad_y_b = held
        gx, gp, g1, g2 = hop_backward(grad_y_b, x_b, ids_b, probs_b, weights, ring.rank, rows, options,
                                      needs=(True, True, want_weights, want_weights))
        # This rank's weight gradients, summed over the blocks in hop order.
        weight_grads[0] = _add(weight_grads[0], g1)
        weight_grads[1] = _add(weight_grads[1], g2)
        return gx, gp

    block = (x.detach().contiguous(), topk_ids.contiguous(), topk_probs.detach().contiguous(), grad_y)
    results = [(x.shape[1:], compute_dtype(x.dtype)), (topk_probs.shape[1:], compute_dtype(topk_probs.dtype))]
    grad_x, grad_probs = _token_ring_pass(ring, sizes, block, hop, results)
    grad_fc1, grad_fc2 = (_finish(g, w) if want_weights else None for g, w in zip(weight_grads, weights))
    return grad_x.to(x.dtype), grad_probs.to(topk_probs.dtype), grad_fc1, grad_fc2


def _token_ring_pass(ring: _Ring, sizes, block, compute, results):
    """Send ``block`` (this rank's tensors, T rows each) around the ring; at the hop where this rank
    holds block b, ``compute(held, rows)`` gives its partial results for b's rows (or None each;
    ``rows`` the slots of b routed here). The results' accumulators (``results``: the trailing
    shape and dtype of each) travel one hop behind their block and come home after the last hop:
    returns this rank's accumulated results."""
    size, rank = ring.size, ring.rank
    device = block[0].device

    def accumulator(spec, tokens):
        shape, dtype = spec
        return torch.empty((tokens, *shape), dtype=dtype, device=device)

    held, done = block, None
    for hop in range(size + 1):
        owner = (rank - hop) % size
        tokens = sizes[owner][0]
        send, recv = [], []
        if hop < size - 1:
            incoming = tuple(t.new_empty(sizes[(owner - 1) % size][0], *t.shape[1:]) for t in block)
            send += held
            recv += incoming
        if hop > 0:
            # The results of the block held now, as far as the previous rank brought them.
            arriving = tuple(accumulator(spec, tokens) for spec in results)
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
        parts = compute(held, rows) if rows else (None,) * len(results)
        ring.wait(works)
        done = tuple(_carry(arriving[i] if hop > 0 else None, part, (tokens, *shape), dtype, device)
                     for i, (part, (shape, dtype)) in enumerate(zip(parts, results)))
        del parts
        if hop < size - 1:
            held = incoming
    return done
