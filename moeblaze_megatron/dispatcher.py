"""MoEBlazeTokenDispatcher: Megatron's six-method dispatcher contract without a permuted copy.

The router gives a dense ``routing_map`` [T, E] and ``probs`` [T, E]; the dispatcher turns them
into top-k ids and probabilities [T, K] and, instead of permuting tokens into a (T*K, d) buffer,
hands the experts the hidden states as they are plus a routing plan (integer index maps).

How the routing reaches the experts: ``MoELayer`` calls
``experts(tokens, tokens_per_expert, permuted_probs)`` with whatever ``dispatch_postprocess``
returned. This dispatcher returns ``(hidden [N, d], ExpertRouting, topk_probs [N, K])``: the
``tokens_per_expert`` slot carries a ``parallel.moe.ExpertRouting`` (the rows' top-k ids, the mode
that runs, with the per-expert counts as ``.tokens_per_expert``); the experts build the routing
plan. Data flows through the call arguments only, so activation recomputation
(``moe_layer_recompute``) re-runs it like any other forward.
``MoEBlazeGroupedMLP`` returns the combined output per row [N, d], so ``combine_preprocess`` has
nothing left to do.

* EP = 1: N = T, the rows are the layer's own hidden states (a view, no copy).
* EP > 1, alltoall mode: each token travels once to every rank holding one of its experts
  (``parallel.alltoall.TokenExchange``); the N received rows carry their local expert ids and
  probabilities, the partial outputs travel back and are summed per token in rank order.
* EP > 1, ring mode: nothing is exchanged here; the rows are the layer's hidden states with their
  global expert ids, and the experts run RelayMoE's ring over the expert-parallel group
  (``parallel.ring``).

The mode is resolved once per forward, in ``dispatch_preprocess``, by the expert-parallel front's
rule (``parallel.moe.resolve_mode``): with ``ep_mode="auto"`` (or ``ring_mode="auto"``) the mode
that sends fewer bytes per training step, from the group's mean token count.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from .config import expert_tp_problem, get_moeblaze_config
from .parallel.alltoall import prepare_send
from .parallel.moe import EPMode, ExpertRouting, resolve_mode
from .parallel.traffic import LayerTraffic

__all__ = ["ExpertRouting", "MoEBlazeTokenDispatcher", "routing_map_to_topk"]


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int):
    """Dense routing to top-k form: ``(topk_ids [T, K] int32, topk_probs [T, K])``.

    Row t lists the experts marked in ``routing_map[t]`` in ascending id order, then -1 for the
    slots left over (a token dropped from some experts by a capacity limit); ``topk_probs`` holds
    ``probs[t, e]`` for each listed expert and 0 for the -1 slots. A row marking more than
    ``topk`` experts keeps its ``topk`` lowest ids. Deterministic, no host synchronization,
    differentiable in ``probs``.
    """
    if not isinstance(routing_map, torch.Tensor) or routing_map.dtype != torch.bool or routing_map.dim() != 2:
        raise TypeError(
            f"routing_map must be a 2-D bool tensor [tokens, experts], got "
            f"{getattr(routing_map, 'dtype', type(routing_map).__name__)} of shape {tuple(getattr(routing_map, 'shape', ()))}"
        )
    if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != tuple(routing_map.shape):
        raise ValueError(
            f"probs must be a tensor of the routing_map's shape {tuple(routing_map.shape)}, got "
            f"{tuple(getattr(probs, 'shape', ()))}"
        )
    num_experts = routing_map.shape[1]
    if not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be an int in [1, {num_experts}], got {topk!r}")
    # Chosen expert e scores E - e, the others 0: top-k in descending score is ascending expert id.
    score = routing_map.to(torch.int32) * torch.arange(
        num_experts, 0, -1, dtype=torch.int32, device=routing_map.device
    )
    best, experts = torch.topk(score, topk, dim=1, sorted=True)
    used = best > 0
    topk_ids = torch.where(used, experts, -1).to(torch.int32)
    topk_probs = torch.where(used, probs.gather(1, experts), 0)
    return topk_ids, topk_probs


class MoEBlazeTokenDispatcher(MoETokenDispatcher):
    """Routes tokens to MoEBlazeGroupedMLP through routing plans instead of permuted copies."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        problem = expert_tp_problem(self.tp_size)
        if problem is not None:
            raise ValueError(f"MoEBlazeTokenDispatcher: {problem}")
        if num_local_experts < 1 or len(local_expert_indices) != num_local_experts:
            raise ValueError(
                f"num_local_experts={num_local_experts} must be positive and match "
                f"local_expert_indices ({len(local_expert_indices)} given)"
            )
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.topk = config.moe_router_topk
        self.options = get_moeblaze_config(config)
        # What one rank's experts weigh (fc1 [2h or h, d] and fc2 [d, h] each), for the auto choice.
        ffn = config.moe_ffn_hidden_size
        self.expert_weight_numel = num_local_experts * (2 + config.gated_linear_unit) * ffn * config.hidden_size
        self.weight_bytes = config.params_dtype.itemsize
        # The mode of the forward in flight.
        self.mode = None
        self.hidden_shape = None
        self.topk_ids = None
        self.exchange = None
        # What a CUDA graph of the preprocessing (TE's moe_preprocess scope) hands to its replay.
        self.cudagraph_attrs = ["topk_ids"]

    @property
    def num_received_tokens(self) -> int | None:
        """Rows received by this rank in the last exchange (EP > 1): its unique (token, rank)
        pairs; None at EP = 1 or before the first dispatch."""
        if self.exchange is None or self.exchange.recv_counts is None:
            return None
        return self.exchange.num_received

    def _traffic(self, tokens: float, hidden_states, probs) -> LayerTraffic:
        return LayerTraffic(tokens=tokens, hidden=hidden_states.shape[1], topk=self.topk,
                            experts_per_rank=self.num_local_experts, ranks=self.ep_size,
                            weight_numel=self.expert_weight_numel, dtype_bytes=hidden_states.element_size(),
                            prob_bytes=probs.element_size(), weight_bytes=self.weight_bytes)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """Top-k form of the routing and this forward's mode; in alltoall mode also the send
        buffer (one host sync for its size)."""
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        topk_ids, topk_probs = routing_map_to_topk(routing_map, probs, self.topk)
        self.mode, _ = resolve_mode(self.options, self.ep_group if self.ep_size > 1 else None, hidden_states.shape[0],
                                    lambda tokens: self._traffic(tokens, hidden_states, topk_probs),
                                    hidden_states.device)
        if self.mode is not EPMode.ALLTOALL:
            self.topk_ids = topk_ids
            return hidden_states, topk_probs
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        self.exchange, self.topk_ids, send_probs = prepare_send(
            topk_ids, topk_probs, self.num_local_experts, self.ep_size
        )
        return self.exchange.gather(hidden_states), send_probs

    def token_dispatch(self, hidden_states, probs):
        """Alltoall mode: all-to-all of the send rows, their local expert ids and probabilities.
        With ``--moe-shared-expert-overlap`` the shared expert is queued on its own stream here,
        beside the exchange (alltoall) or the routed experts (EP = 1, ring)."""
        if self.mode is not EPMode.ALLTOALL:
            if self.shared_experts is not None:
                # The rows are the layer input itself: the whole shared expert goes now.
                self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
                self.shared_experts.linear_fc1_forward_and_act()
                self.shared_experts.linear_fc2_forward()
                self.shared_experts.post_forward_comm()
            return hidden_states, probs
        self.exchange.exchange_counts(self.ep_group)
        self.topk_ids = self.exchange.dispatch(self.topk_ids, self.ep_group)
        rows = self.exchange.dispatch(hidden_states, self.ep_group)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act()
        return rows, self.exchange.dispatch(probs, self.ep_group)

    def dispatch_postprocess(self, hidden_states, probs):
        """What the experts run on: ``(rows, ExpertRouting, topk_probs)``."""
        # After an exchange the experts' expert-order buffers are as long as the slots received,
        # not received rows x K.
        used = self.exchange.num_received_slots if self.mode is EPMode.ALLTOALL else None
        routing = ExpertRouting(self.topk_ids, self.num_local_experts, self.mode,
                                self.ep_group if self.mode.is_ring else None, used)
        self.topk_ids = None
        return hidden_states, routing, probs

    def combine_preprocess(self, hidden_states):
        """The experts already combined each row's experts."""
        return hidden_states

    def token_combine(self, hidden_states):
        """Alltoall mode: each partial output goes back to its source rank."""
        if self.mode is not EPMode.ALLTOALL:
            return hidden_states
        returned = self.exchange.give_back(hidden_states, self.ep_group)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward()
            self.shared_experts.post_forward_comm()
        return returned

    def combine_postprocess(self, hidden_states):
        """Alltoall mode: per-token sum of the partials in rank order; restore the input's shape;
        add the overlapped shared expert's output (joining its stream)."""
        if self.mode is EPMode.ALLTOALL:
            hidden_states = self.exchange.combine(hidden_states)
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output
