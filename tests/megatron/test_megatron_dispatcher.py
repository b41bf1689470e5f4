"""MoEBlazeTokenDispatcher: routing_map -> top-k, the EP = 1 path without a copy, the six-method
contract, and the expert-parallel exchange layout (single process)."""

from __future__ import annotations

import pytest
import torch

from megatron_testing import build_moe_layer, cpu_megatron, moe_config  # noqa: F401
from moeblaze_megatron.dispatcher import ExpertRouting, MoEBlazeTokenDispatcher, routing_map_to_topk
from moeblaze_megatron.parallel.moe import EPMode
from moeblaze_megatron.parallel.alltoall import TokenExchange, _GatherRows, _SumRows, plan_token_exchange


def _random_routing(num_tokens, num_experts, topk, generator, keep=1.0):
    """A router-like routing: K distinct experts per token, then about 1 - keep of the slots
    dropped (a capacity limit); probs [T, E] positive on chosen experts, 0 elsewhere."""
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    chosen = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, chosen, True)
    routing_map &= torch.rand(num_tokens, num_experts, generator=generator) < keep
    probs = torch.where(routing_map, scores, 0.0)
    return routing_map, probs


@pytest.mark.parametrize(
    "num_tokens,num_experts,topk,keep",
    [(50, 8, 2, 1.0), (40, 6, 6, 1.0), (64, 16, 1, 1.0), (100, 12, 4, 0.6), (7, 4, 3, 0.0), (0, 4, 2, 1.0)],
)
def test_routing_map_to_topk(num_tokens, num_experts, topk, keep):
    generator = torch.Generator().manual_seed(num_tokens + topk)
    routing_map, probs = _random_routing(num_tokens, num_experts, topk, generator, keep)
    probs.requires_grad_()
    ids, topk_probs = routing_map_to_topk(routing_map, probs, topk)
    assert ids.dtype == torch.int32 and tuple(ids.shape) == (num_tokens, topk)
    for t in range(num_tokens):
        experts = routing_map[t].nonzero().flatten().tolist()  # ascending
        want = experts + [-1] * (topk - len(experts))
        assert ids[t].tolist() == want
        want_probs = [probs[t, e].item() for e in experts] + [0.0] * (topk - len(experts))
        assert topk_probs[t].tolist() == want_probs
    # The gradient reaches exactly the chosen (token, expert) entries.
    upstream = torch.rand(topk_probs.shape, generator=generator)
    (topk_probs * upstream).sum().backward()
    want_grad = torch.zeros_like(probs)
    for t in range(num_tokens):
        for k, e in enumerate(ids[t].tolist()):
            if e >= 0:
                want_grad[t, e] = upstream[t, k]
    assert torch.equal(probs.grad, want_grad)
    again = routing_map_to_topk(routing_map, probs.detach(), topk)
    assert torch.equal(again[0], ids)


def test_routing_map_to_topk_bad_input():
    routing_map = torch.zeros(4, 6, dtype=torch.bool)
    with pytest.raises(TypeError, match="routing_map"):
        routing_map_to_topk(routing_map.int(), torch.zeros(4, 6), 2)
    with pytest.raises(ValueError, match="probs"):
        routing_map_to_topk(routing_map, torch.zeros(4, 5), 2)
    with pytest.raises(ValueError, match="topk"):
        routing_map_to_topk(routing_map, torch.zeros(4, 6), 7)


@pytest.mark.usefixtures("cpu_megatron")
def test_experts_get_the_original_hidden_states_and_a_plan():
    """EP = 1: the experts see the layer input itself (same storage, no permuted copy) and the
    router's top-k choices (the op builds its plan from them); the six dispatcher methods run in Megatron's order."""
    layer = build_moe_layer(moe_config("moeblaze", moe_router_topk=3))
    dispatcher = layer.token_dispatcher
    assert isinstance(dispatcher, MoEBlazeTokenDispatcher)
    calls = []
    for name in ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                 "combine_preprocess", "token_combine", "combine_postprocess"):
        method = getattr(dispatcher, name)
        setattr(dispatcher, name, lambda *a, _m=method, _n=name, **k: (calls.append(_n), _m(*a, **k))[1])
    seen = {}
    layer.experts.register_forward_pre_hook(lambda m, args: seen.update(args=args))
    routing = {}
    layer.router.register_forward_hook(lambda m, i, out: routing.update(probs=out[0], map=out[1]))

    x = torch.randn(12, 2, 32, requires_grad=True)
    out, _ = layer(x)
    assert calls == ["dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                     "combine_preprocess", "token_combine", "combine_postprocess"]
    hidden, expert_routing, probs = seen["args"]
    assert hidden.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert tuple(hidden.shape) == (24, 32)
    assert isinstance(expert_routing, ExpertRouting)
    want_ids, want_probs = routing_map_to_topk(routing["map"], routing["probs"], 3)
    assert torch.equal(expert_routing.topk_ids, want_ids)
    assert torch.equal(probs, want_probs)
    assert expert_routing.mode is EPMode.LOCAL and expert_routing.used_slots is None
    assert torch.equal(expert_routing.tokens_per_expert.long(), routing["map"].sum(dim=0))
    assert tuple(out.shape) == tuple(x.shape)


def _exchange_oracle(topk_ids, per_rank, ep_size):
    """Send rows by loops: rank-major, tokens ascending; local ids ascending, -1 padded."""
    width = min(topk_ids.shape[1], per_rank)
    rows = []
    for r in range(ep_size):
        for t, row in enumerate(topk_ids.tolist()):
            local = sorted(e - r * per_rank for e in row if e >= 0 and e // per_rank == r)
            if local:
                rows.append((r, t, local + [-1] * (width - len(local))))
    return rows


@pytest.mark.parametrize("ep_size,per_rank,topk", [(2, 3, 2), (4, 2, 3), (3, 1, 2), (2, 4, 4)])
def test_plan_token_exchange_layout(ep_size, per_rank, topk):
    generator = torch.Generator().manual_seed(ep_size * 10 + topk)
    num_experts = ep_size * per_rank
    routing_map, probs = _random_routing(40, num_experts, topk, generator, keep=0.8)
    topk_ids, topk_probs = routing_map_to_topk(routing_map, probs, topk)
    exchange, send_ids, send_cols = plan_token_exchange(topk_ids, per_rank, ep_size)
    want = _exchange_oracle(topk_ids, per_rank, ep_size)
    assert exchange.send_token.tolist() == [t for _, t, _ in want]
    assert send_ids.tolist() == [ids for _, _, ids in want]
    assert exchange.send_counts == [sum(1 for r, _, _ in want if r == rank) for rank in range(ep_size)]
    # send_cols points at the slot each local id came from.
    picked = topk_ids[exchange.send_token].gather(1, send_cols)
    ranks = torch.tensor([r for r, _, _ in want])[:, None]
    assert torch.equal(torch.where(send_ids >= 0, picked - ranks * per_rank, -1), send_ids.long())
    # send_slot inverts send_token.
    for row, (r, t, _) in enumerate(want):
        assert exchange.send_slot[t, r] == row
    assert int((exchange.send_slot >= 0).sum()) == len(want)


def test_exchange_gather_and_combine_are_adjoint():
    """Gradients of the send-buffer gather and the per-token combine, checked numerically."""
    generator = torch.Generator().manual_seed(3)
    routing_map, _ = _random_routing(9, 6, 3, generator, keep=0.9)
    topk_ids, _ = routing_map_to_topk(routing_map, torch.zeros(9, 6), 3)
    exchange, _, _ = plan_token_exchange(topk_ids, 2, 3)
    assert isinstance(exchange, TokenExchange)
    rows = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    sent = torch.randn(len(exchange.send_token), 5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda r: _GatherRows.apply(r, exchange.send_token, exchange.send_slot), (rows,))
    torch.autograd.gradcheck(lambda s: _SumRows.apply(s, exchange.send_slot, exchange.send_token), (sent,))
    combined = exchange.combine(exchange.gather(rows))
    fanout = (exchange.send_slot >= 0).sum(dim=1, keepdim=True)
    torch.testing.assert_close(combined, rows * fanout)
