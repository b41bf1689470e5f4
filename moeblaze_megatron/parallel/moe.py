"""The expert-parallel front: how one MoE layer's experts run across the expert-parallel ranks,
decided in one place, from one rule, and run through one entry.

* ``resolve_mode``: the rule. Once per layer forward it turns the options (``MoEBlazeConfig``'s
  ``ep_mode`` and ``ring_mode``) into the ``EPMode`` that runs: ``LOCAL`` (expert parallelism 1),
  ``ALLTOALL`` (each token sent once per rank holding one of its experts, ``alltoall.py``),
  ``EXPERT_RING`` or ``TOKEN_RING`` (RelayMoE's rings, ``ring.py``). Where the options leave a
  choice, the mode that sends the fewest bytes per training step wins (``traffic.choose_mode``),
  from a token count every rank agrees on: the group's mean (one small all-gather) in eager; under
  torch.compile, where the graph must hold one mode, this rank's own, and the ops check before
  any transfer that every rank chose alike (``compiled_exchange.check_same_choice``).
* ``expert_parallel_moe``: the whole of it for one layer (the mode, the exchange or the ring, the
  experts), eager and compiled; the torchtitan override runs it, and ``alltoall_moe`` /
  ``ring_moe`` name one mode.
* ``ExpertRouting`` and ``run_routed``: the experts' half for Megatron's dispatcher, whose six
  stages keep the exchange split (Megatron's overlap schedules call them one by one): the
  dispatcher resolves the mode and exchanges the rows, then the experts run ``run_routed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import RING_MODES, MoEBlazeConfig
from ..moe_mlp import check_moe_mlp_args, moe_mlp
from ..passes import pass_options
from .alltoall import prepare_send
from .compiled_exchange import compiled_alltoall_moe
from .compiled_ring import compiled_ring_moe
from .ring import RingMoE
from .traffic import MODES, EPMode, LayerTraffic, choose_mode

__all__ = ["EPMode", "ExpertRouting", "alltoall_moe", "expert_parallel_moe", "group_mean_tokens", "layer_traffic",
           "resolve_mode", "ring_moe", "ring_shards", "run_routed"]


def group_mean_tokens(num_tokens: int, group, device) -> float:
    """The mean token count over the ranks of ``group`` (one small all-gather, one host
    synchronization): shapes every rank agrees on, for a choice every rank must make alike."""
    mine = torch.tensor([num_tokens], dtype=torch.long, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return torch.cat(every).sum().item() / len(every)


def layer_traffic(tokens: float, x, topk_probs, weights, ranks: int) -> LayerTraffic:
    """The layer's shapes for ``parallel.traffic``: ``tokens`` per rank, the rest from the tensors;
    ``weights``: this rank's expert weights (fc1 and fc2, or any split of them), expert-major; they
    travel in x's dtype (``ring_shards``)."""
    return LayerTraffic(tokens=tokens, hidden=x.shape[-1], topk=topk_probs.shape[-1],
                        experts_per_rank=weights[0].shape[0], ranks=ranks,
                        weight_numel=sum(w.numel() for w in weights), dtype_bytes=x.element_size(),
                        prob_bytes=topk_probs.element_size(), weight_bytes=x.element_size())


def _candidates(options: MoEBlazeConfig) -> tuple[str, ...]:
    rings = RING_MODES if options.ring_mode == "auto" else (options.ring_mode,)
    if options.ep_mode == "alltoall":
        return ("alltoall",)
    return (("alltoall",) if options.ep_mode == "auto" else ()) + rings


def resolve_mode(options: MoEBlazeConfig, group, num_tokens: int, traffic_of, device, *,
                 compiling: bool = False) -> tuple[EPMode, int]:
    """The mode one layer forward runs, and, where it was chosen from this rank's own token count
    (under compile), its index in ``traffic.MODES`` for the ops to check (-1 otherwise).
    ``group``: the expert-parallel group (None or a group of one: ``LOCAL``); ``traffic_of(tokens)``:
    the layer's ``LayerTraffic`` for a token count, asked for only where the options leave a
    choice."""
    if group is None or dist.get_world_size(group) == 1:
        return EPMode.LOCAL, -1
    candidates = _candidates(options)
    if len(candidates) == 1:
        return EPMode(candidates[0]), -1
    tokens = num_tokens if compiling else group_mean_tokens(num_tokens, group, device)
    mode = choose_mode(candidates, traffic_of(tokens))
    return EPMode(mode), MODES.index(mode) if compiling else -1


def ring_shards(fc1, fc2, dtype):
    """(fc1 [E_local, 2F or F, D], fc2) in ``dtype`` as the ring sends them: whole shards, a (gate,
    up) pair stacked [gate | up]."""
    if isinstance(fc1, tuple):
        fc1 = torch.cat(fc1, dim=1)
    return fc1.to(dtype), fc2.to(dtype)


@dataclass(frozen=True)
class ExpertRouting:
    """What the experts need besides their rows, for one forward: the rows' expert ids [N, K]
    (-1 unused; local to this rank after an exchange, global for a ring), the mode that runs, the
    expert-parallel group (for a ring), this rank's expert count and, after an exchange, how many
    of the ids are used (the experts' expert-order buffers are cut to them)."""

    topk_ids: torch.Tensor
    num_local_experts: int
    mode: EPMode = EPMode.LOCAL
    group: object = None
    used_slots: int | None = None

    @property
    def tokens_per_expert(self) -> torch.Tensor | None:
        """[E_local] (row, expert) pairs per local expert, on device, without a host
        synchronization (None for a ring: each hop routes its own rows)."""
        if self.mode.is_ring:
            return None
        # Unused slots (-1) land in bin 0, which is cut off.
        shifted = self.topk_ids.reshape(-1).long() + 1
        return torch.bincount(shifted, minlength=self.num_local_experts + 1)[1:]


def run_routed(rows, routing: ExpertRouting, topk_probs, fc1, fc2, *, options: MoEBlazeConfig,
               activation: str = "swiglu"):
    """This rank's experts over ``rows`` as ``routing`` says: the op over the rows (local ids), or
    a ring over the group (global ids)."""
    if routing.mode.is_ring:
        return _ring(rows, routing.topk_ids, topk_probs, fc1, fc2, routing.group, routing.mode, options, activation)
    return moe_mlp(rows, routing.topk_ids, topk_probs, fc1, fc2, activation, recompute=options.recompute,
                   backend=options.backend, routing_method=options.routing_method, validate=False,
                   used_slots=routing.used_slots, fp8=options.fp8)


def expert_parallel_moe(x, topk_ids, topk_probs, fc1, fc2, group, *, options: MoEBlazeConfig,
                        activation: str = "swiglu", record: dict | None = None):
    """``y[t] = sum_k topk_probs[t, k] * expert_{topk_ids[t, k]}(x[t])`` over the experts of every
    rank of ``group`` (None: this rank's alone).

    x [T, d] this rank's tokens (T may differ between ranks); topk_ids [T, K] global expert ids
    (-1 unused; the values are not checked); topk_probs [T, K]; fc1 [E_local, 2F or F, d] or its
    (gate, up) pair, fc2 [E_local, d, F]: this rank's experts (global expert e lives on rank
    e // E_local), in any floating dtype (cast to x's as ``moe_mlp`` does). Differentiable in x,
    topk_probs and the weights; runs eager and under torch.compile. ``record``: where given, the
    eager exchange writes the rows this rank received under "received_tokens"."""
    ranks = 1 if group is None else dist.get_world_size(group)
    compiling = torch.compiler.is_compiling()
    weights = tuple(fc1) + (fc2,) if isinstance(fc1, tuple) else (fc1, fc2)
    mode, chosen = resolve_mode(options, group, x.shape[0], lambda tokens: layer_traffic(
        tokens, x, topk_probs, weights, ranks), x.device, compiling=compiling)
    if mode is EPMode.LOCAL:
        return moe_mlp(x, topk_ids, topk_probs, fc1, fc2, activation, recompute=options.recompute,
                       backend=options.backend, routing_method=options.routing_method, validate=False,
                       fp8=options.fp8)
    _check_args(x, topk_ids, topk_probs, fc1, fc2, ranks, activation, options)
    if mode is EPMode.ALLTOALL:
        if compiling:
            return compiled_alltoall_moe(x, topk_ids, topk_probs, fc1, fc2, group, activation=activation,
                                         recompute=options.recompute, routing_method=options.routing_method,
                                         backend=options.backend, chosen=chosen, fp8=options.fp8)
        return _alltoall(x, topk_ids, topk_probs, fc1, fc2, group, options, activation, record)
    return _ring(x, topk_ids, topk_probs, fc1, fc2, group, mode, options, activation, compiling, chosen)


def _check_args(x, topk_ids, topk_probs, fc1, fc2, ranks, activation, options):
    """The op's argument checks with the ids global: weights of ``ranks`` times the local experts
    (zero-stride stand-ins in the weights' dtypes)."""
    def whole(w):
        return w.new_empty(()).expand(w.shape[0] * ranks, *w.shape[1:])

    check_moe_mlp_args(x, topk_ids, topk_probs, tuple(map(whole, fc1)) if isinstance(fc1, tuple) else whole(fc1),
                       whole(fc2), activation, None, options.recompute, options.backend, options.routing_method,
                       validate=False, fp8=options.fp8)


def _alltoall(x, topk_ids, topk_probs, fc1, fc2, group, options, activation, record):
    """Each token once to every rank holding one of its experts, with that rank's local ids and
    probabilities; the partial outputs come back and are summed per token in rank order."""
    experts = (fc1[0] if isinstance(fc1, tuple) else fc1).shape[0]
    exchange, send_ids, send_probs = prepare_send(topk_ids, topk_probs, experts, dist.get_world_size(group))
    exchange.exchange_counts(group)
    if record is not None:
        record["received_tokens"] = exchange.num_received
    ids = exchange.dispatch(send_ids, group)
    rows = exchange.dispatch(exchange.gather(x), group)
    probs = exchange.dispatch(send_probs, group)
    routing = ExpertRouting(ids, experts, EPMode.ALLTOALL, group, exchange.num_received_slots)
    out = run_routed(rows, routing, probs, fc1, fc2, options=options, activation=activation)
    return exchange.combine(exchange.give_back(out, group))


def _ring(x, topk_ids, topk_probs, fc1, fc2, group, mode, options, activation, compiling=False, chosen=-1):
    """RelayMoE's ring over ``group``: the weight shards or the token blocks travel."""
    shards = ring_shards(fc1, fc2, x.dtype)
    passes_options = pass_options(x, activation, options.recompute, options.backend, options.routing_method)
    if compiling:
        return compiled_ring_moe(x, topk_ids, topk_probs, *shards, group, mode, passes_options, chosen)
    return RingMoE.apply(x, topk_probs, *shards, topk_ids.to(torch.int32), group, mode, passes_options)


def alltoall_moe(x, topk_ids, topk_probs, fc1_weight, fc2_weight, group, *, activation: str = "swiglu",
                 recompute: str = "activation", backend: str = "auto", routing_method: str = "auto"):
    """``expert_parallel_moe`` through the token exchange."""
    options = MoEBlazeConfig(recompute=recompute, backend=backend, routing_method=routing_method, ep_mode="alltoall")
    return expert_parallel_moe(x, topk_ids, topk_probs, fc1_weight, fc2_weight, group, options=options,
                               activation=activation)


def ring_moe(x, topk_ids, topk_probs, fc1_weight, fc2_weight, group, *, mode: str = "auto",
             activation: str = "swiglu", backend: str = "auto", routing_method: str = "auto"):
    """``expert_parallel_moe`` as RelayMoE's ring: ``mode`` "expert" (the weights travel), "token"
    (the token blocks travel) or "auto" (the one sending fewer bytes per training step). The ring
    recomputes each hop's first GEMM in backward (recompute="fc1")."""
    options = MoEBlazeConfig(recompute="fc1", backend=backend, routing_method=routing_method, ep_mode="ring",
                             ring_mode=mode)
    return expert_parallel_moe(x, topk_ids, topk_probs, fc1_weight, fc2_weight, group, options=options,
                               activation=activation)
