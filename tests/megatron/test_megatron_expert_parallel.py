"""Expert parallelism on CPU with gloo: MoEBlaze at EP = 2 and 4 against the same layer at EP = 1.

Each rank builds the full layer at EP = 1 (every expert, identical global weights on every rank)
and the EP layer holding its slice of the experts with the same weights, runs both on its own
tokens, and compares outputs and gradients: input and router gradients per rank, expert
gradients after summing the EP = 1 gradients over ranks (the EP layer's expert gradients already
gather every rank's tokens). The ring modes (``--moeblaze-ep-mode ring`` with the expert and the
token ring: RelayMoE's ring, no exchange) and ``--moeblaze-ep-mode auto`` are checked the same way. The stock allgather dispatcher at the same EP size is a second
reference. The receive buffers must hold exactly one row per unique (token, rank) pair.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moe_testing import run_distributed
from megatron_testing import (
    build_moe_layer,
    megatron_on_cpu,
    moe_config,
    rel_error,
    seed_everything,
)
from moeblaze_megatron.config import MoEBlazeConfig, set_moeblaze_config
from moeblaze_megatron.parallel.moe import EPMode
from moeblaze_megatron.training.named_grads import sequential_named_grads as named_grads

# (name, config overrides, expert bias or None). "skewed": the expert bias sends every token to
# experts 0, 1 and 2, so at EP = 4 ranks 2 and 3 receive nothing. "dropping": a capacity factor
# drops slots (-1 in topk_ids). "top1_gelu": one expert per token, an ungated activation.
CASES = [
    ("softmax_top3", dict(moe_router_topk=3), None),
    (
        "skewed",
        dict(moe_router_topk=3, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
        [30.0, 20.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ),
    (
        "dropping",
        dict(moe_router_topk=2, moe_expert_capacity_factor=0.5, moe_aux_loss_coeff=0.01),
        None,
    ),
    ("top1_gelu", dict(moe_router_topk=1, moe_router_pre_softmax=True, activation="gelu"), None),
    # Megatron's MoE-layer recompute re-runs the exchange (or the ring) in backward.
    ("moe_recompute", dict(moe_router_topk=2, recompute_granularity="selective", recompute_modules=["moe"]), None),
]
NUM_EXPERTS = 8
# The MoEBlaze layers at EP = world size: their options.
EP_LAYERS = {
    "ep": MoEBlazeConfig(),
    # The ring recomputes each hop's fc1 in backward: recompute="fc1" is its one setting.
    "ring_expert": MoEBlazeConfig(ep_mode="ring", ring_mode="expert", recompute="fc1"),
    "ring_token": MoEBlazeConfig(ep_mode="ring", ring_mode="token", recompute="fc1"),
    "ring_auto": MoEBlazeConfig(ep_mode="ring", recompute="fc1"),
    "auto": MoEBlazeConfig(ep_mode="auto", recompute="fc1"),
}
TOL = 1e-5  # fp32: the EP and EP = 1 paths differ only in summation order


def _ep_worker(rank, world_size, port):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    report = {}
    with megatron_on_cpu(rank, world_size, port, expert_model_parallel_size=world_size):
        singletons = [dist.new_group([r]) for r in range(world_size)]
        ep1_groups = copy.copy(get_default_pg_collection())
        ep1_groups.ep = ep1_groups.tp_ep = ep1_groups.expt_dp = singletons[rank]
        for name, overrides, expert_bias in CASES:
            overrides = dict(overrides)
            activation = overrides.pop("activation", "swiglu")
            layers = {}
            variants = [("ep1", "moeblaze", 1), *((label, "moeblaze", world_size) for label in EP_LAYERS),
                        ("stock", "allgather", world_size)]
            for label, dispatcher, ep in variants:
                config = moe_config(
                    dispatcher, activation, num_moe_experts=NUM_EXPERTS, expert_model_parallel_size=ep, **overrides
                )
                if label in EP_LAYERS:
                    set_moeblaze_config(config, EP_LAYERS[label])
                seed_everything(7)
                layers[label] = build_moe_layer(config, pg_collection=ep1_groups if ep == 1 else None)
            reference = layers["ep1"]
            if expert_bias is not None:
                reference.router.expert_bias.copy_(torch.tensor(expert_bias))
            full = reference.state_dict()
            per_rank = NUM_EXPERTS // world_size
            local = {k: v for k, v in full.items() if "local_experts" not in k}
            for i in range(per_rank):
                for fc in ("linear_fc1", "linear_fc2"):
                    local[f"experts.local_experts.{i}.{fc}.weight"] = full[
                        f"experts.local_experts.{rank * per_rank + i}.{fc}.weight"
                    ]
            for label in (*EP_LAYERS, "stock"):
                layers[label].load_state_dict(local)

            routing_maps = []
            hook = reference.router.register_forward_hook(lambda m, i, out: routing_maps.append(out[1]))
            generator = torch.Generator().manual_seed(100 + rank)
            x = torch.randn(10, 2, 32, generator=generator)
            upstream = torch.randn(10, 2, 32, generator=generator)
            results = {}
            expert_calls = []
            for label, layer in layers.items():
                calls = layer.experts.register_forward_pre_hook(lambda m, a: expert_calls.append(label))
                xx = x.clone().requires_grad_()
                out, _ = layer(xx)
                (out * upstream).sum().backward()
                calls.remove()
                results[label] = (out.detach(), xx.grad, named_grads(layer))
            hook.remove()
            # With MoE-layer recompute every layer's experts run again in backward.
            runs = 2 if layers["ep1"].moe_layer_recompute else 1
            assert expert_calls == [label for label in layers for _ in range(runs)], (name, expert_calls)
            modes = {label: layers[label].token_dispatcher.mode for label in EP_LAYERS}
            assert modes["ep"] is EPMode.ALLTOALL, modes
            assert modes["ring_expert"] is EPMode.EXPERT_RING and modes["ring_token"] is EPMode.TOKEN_RING, modes
            assert modes["ring_auto"].is_ring, modes  # the ring picks which ring itself
            assert modes["auto"] in (EPMode.ALLTOALL, EPMode.EXPERT_RING, EPMode.TOKEN_RING), modes
            # Deterministic: a second run of the EP layers repeats the first bit for bit.
            for label in EP_LAYERS:
                layers[label].zero_grad()
                xx = x.clone().requires_grad_()
                out, _ = layers[label](xx)
                (out * upstream).sum().backward()
                assert torch.equal(out, results[label][0]) and torch.equal(xx.grad, results[label][1]), name
                assert all(
                    torch.equal(g, results[label][2][k]) for k, g in named_grads(layers[label]).items() if g is not None
                ), f"{name}/{label}"

            ref_out, ref_dx, ref_grads = results["ep1"]
            for label in (*EP_LAYERS, "stock"):
                out, dx, grads = results[label]
                assert rel_error(out, ref_out) < TOL, f"{name}/{label}: output"
                assert rel_error(dx, ref_dx) < TOL, f"{name}/{label}: input gradient"
                assert rel_error(grads["router.weight"], ref_grads["router.weight"]) < TOL, f"{name}/{label}: router"
            for fc in ("linear_fc1", "linear_fc2"):
                # Every rank's EP = 1 gradients of all experts, summed: what the EP layer gathers.
                want = torch.stack([ref_grads[f"experts.local_experts.{e}.{fc}.weight"] for e in range(NUM_EXPERTS)])
                dist.all_reduce(want)
                for i in range(per_rank):
                    for label in (*EP_LAYERS, "stock"):
                        got = results[label][2][f"experts.local_experts.{i}.{fc}.weight"]
                        err = rel_error(got, want[rank * per_rank + i])
                        assert err < TOL, f"{name}/{label}: expert {i} {fc} gradient, relative error {err:.3g}"

            # One received row per unique (token, destination rank) pair, summed over sources.
            routing_map = routing_maps[0]
            goes_to = routing_map.view(routing_map.shape[0], world_size, per_rank).any(dim=2)
            pairs_to = goes_to.sum(dim=0)
            dist.all_reduce(pairs_to)
            received = layers["ep"].token_dispatcher.num_received_tokens
            assert received == int(pairs_to[rank]), f"{name}: received {received}, expected {int(pairs_to[rank])}"
            slots = torch.tensor([int(routing_map.sum())])
            dist.all_reduce(slots)
            report[name] = {"auto_mode": modes["auto"], "received": received, "pairs_to_rank": int(pairs_to[rank]), "total_slots": int(slots)}
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_matches_ep1(world_size):
    reports = run_distributed(_ep_worker, world_size)
    for name, _, _ in CASES:
        received = [r[name]["received"] for r in reports]
        if name == "skewed" and world_size == 4:
            assert received[2] == received[3] == 0, "ranks without chosen experts received rows"
        # Stock dispatchers move one row per (token, expert) slot; MoEBlaze one per (token, rank).
        assert sum(received) <= reports[0][name]["total_slots"]
        if name == "softmax_top3":
            assert sum(received) < reports[0][name]["total_slots"], "no token had two experts on one rank"
