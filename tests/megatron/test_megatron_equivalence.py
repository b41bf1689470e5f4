"""MoEBlaze vs Megatron's stock MoE (allgather dispatcher + SequentialMLP) on CPU.

For each router / expert configuration, the stock layer and the MoEBlaze layer get the same
weights and inputs; both are compared with the stock layer evaluated in float64 on the same
(rounded) weights and inputs: the output, the input gradient, the router gradient (aux losses
flow into it) and every expert gradient. A small GPTModel is compared the same way (loss and all
parameter gradients).

Tolerances (relative, in norm): float32 1e-5 (rounding only, ~1e-7 per op); bfloat16 8 * 2**-9,
the bound used for the op itself. The stock bf16 layer is measured against the same oracle and
must pass the same bar, which keeps the bar honest.
"""

from __future__ import annotations

import pytest
import torch

from megatron_testing import (
    REL_TOL,
    build_gpt,
    build_moe_layer,
    copy_parameters,
    cpu_megatron,  # noqa: F401 - fixture
    moe_config,
    rel_error,
    seed_everything,
)
from moeblaze_megatron.training.named_grads import sequential_named_grads as named_grads

pytestmark = pytest.mark.usefixtures("cpu_megatron")

# (id, activation, config overrides). moe_config's defaults: 6 experts, top-2, softmax scores,
# hidden 32, moe_ffn_hidden_size 24 (ffn_hidden_size 64 for dense layers).
LAYER_CASES = [
    ("softmax_swiglu", "swiglu", {}),
    ("silu", "silu", {}),
    ("gelu", "gelu", {}),
    ("sigmoid", "swiglu", dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.0)),
    ("pre_softmax_top1", "swiglu", dict(moe_router_topk=1, moe_router_pre_softmax=True)),
    ("group_limited", "swiglu", dict(moe_router_num_groups=3, moe_router_group_topk=2, moe_router_topk=3)),
    (
        "expert_bias",
        "swiglu",
        dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    ),
    ("aux_loss", "swiglu", dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1)),
    ("seq_aux_loss", "swiglu", dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1)),
    (
        "capacity_dropping",
        "swiglu",
        dict(moe_expert_capacity_factor=0.6, moe_aux_loss_coeff=0.01, moe_router_topk=3),
    ),
    ("top_k_equals_e", "swiglu", dict(moe_router_topk=6)),
    (
        "shared_experts",
        "swiglu",
        dict(moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True),
    ),
    ("moe_layer_recompute", "swiglu", dict(recompute_granularity="selective", recompute_modules=["moe"])),
]
BF16_CASES = ["softmax_swiglu", "sigmoid", "capacity_dropping", "shared_experts"]


def _layers(case_id, dtype, stock="allgather"):
    _, activation, overrides = next(c for c in LAYER_CASES if c[0] == case_id)
    layers = {}
    for label, dispatcher, layer_dtype in (
        ("stock", stock, dtype),
        ("moeblaze", "moeblaze", dtype),
        ("oracle", "allgather", torch.float64),
    ):
        seed_everything(11)
        layers[label] = build_moe_layer(moe_config(dispatcher, activation, layer_dtype, **overrides))
    if overrides.get("moe_router_enable_expert_bias"):
        # Non-zero bias so that it changes the selection (it starts at zero).
        layers["stock"].router.expert_bias.copy_(torch.linspace(-0.2, 0.3, 6))
    copy_parameters(layers["stock"], layers["moeblaze"])
    copy_parameters(layers["stock"], layers["oracle"])
    return layers


def _run_layer(layer, x, upstream):
    layer.train()
    x = x.clone().to(next(layer.parameters()).dtype).requires_grad_()
    out, bias = layer(x)
    assert bias is None
    (out * upstream.to(out.dtype)).sum().backward()
    return out.detach(), x.grad, named_grads(layer)


def _compare(results, dtype, label):
    want_out, want_dx, want_grads = results["oracle"]
    errors = {}
    for name in ("stock", label):
        out, dx, grads = results[name]
        errors[name] = {"output": rel_error(out, want_out), "input grad": rel_error(dx, want_dx)}
        assert grads.keys() == want_grads.keys(), f"{name}: parameters differ from the stock layer's"
        for key, want in want_grads.items():
            assert (grads[key] is None) == (want is None), f"{name}: {key} gradient presence"
            if want is not None:
                errors[name][key] = rel_error(grads[key], want)
    for name, errs in errors.items():
        bad = {k: v for k, v in errs.items() if v > REL_TOL[dtype]}
        assert not bad, f"{name} ({dtype}) exceeds {REL_TOL[dtype]:.2g}: {bad}"
    return errors


@pytest.mark.parametrize(
    "case_id,dtype",
    [(c[0], torch.float32) for c in LAYER_CASES] + [(c, torch.bfloat16) for c in BF16_CASES],
    ids=[f"{c[0]}-fp32" for c in LAYER_CASES] + [f"{c}-bf16" for c in BF16_CASES],
)
def test_moe_layer_matches_stock(case_id, dtype):
    layers = _layers(case_id, dtype)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(24, 2, 32, generator=generator).to(dtype)
    upstream = torch.randn(24, 2, 32, generator=generator).to(dtype)
    routing_maps = []
    layers["moeblaze"].router.register_forward_hook(lambda m, i, out: routing_maps.append(out[1]))
    results = {name: _run_layer(layer, x, upstream) for name, layer in layers.items()}
    _compare(results, dtype, "moeblaze")
    if case_id == "capacity_dropping":
        per_token = routing_maps[0].sum(dim=1)
        assert bool((per_token < 3).any()), "the capacity factor dropped no slot"
    if case_id == "expert_bias":
        # The router's token counts (the input of the bias update) see the same routing.
        assert torch.equal(
            layers["moeblaze"].router.local_tokens_per_expert, layers["stock"].router.local_tokens_per_expert
        )


def test_alltoall_stock_agrees():
    """The GPU script compares with the alltoall dispatcher; it agrees with allgather on CPU."""
    layers = _layers("softmax_swiglu", torch.float32, stock="alltoall")
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(16, 2, 32, generator=generator)
    upstream = torch.randn(16, 2, 32, generator=generator)
    results = {name: _run_layer(layer, x, upstream) for name, layer in layers.items()}
    _compare(results, torch.float32, "moeblaze")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpt_model_matches_stock(dtype):
    """A GPTModel with a dense and an MoE layer (shared experts, aux loss): loss and gradients."""
    overrides = dict(
        moe_layer_freq=[0, 1, 1],
        num_layers=3,
        moe_aux_loss_coeff=0.01,
        moe_shared_expert_intermediate_size=16,
    )
    models = {}
    for label, dispatcher, model_dtype in (
        ("stock", "allgather", dtype),
        ("moeblaze", "moeblaze", dtype),
        ("oracle", "allgather", torch.float64),
    ):
        seed_everything(21)
        models[label] = build_gpt(moe_config(dispatcher, "swiglu", model_dtype, **overrides))
    copy_parameters(models["stock"], models["moeblaze"])
    copy_parameters(models["stock"], models["oracle"])

    generator = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, 64, (2, 16), generator=generator)
    positions = torch.arange(16)[None].expand(2, -1)
    causal = torch.ones(2, 1, 16, 16, dtype=torch.bool).tril().logical_not()
    losses, grads = {}, {}
    for label, model in models.items():
        model.train()
        loss = model(tokens, positions, causal, labels=tokens).float().mean()
        loss.backward()
        losses[label] = loss.detach().double()
        grads[label] = named_grads(model)
    for label in ("stock", "moeblaze"):
        assert rel_error(losses[label], losses["oracle"]) <= REL_TOL[dtype], f"{label} loss"
        assert grads[label].keys() == grads["oracle"].keys()
        bad = {
            k: rel_error(g, grads["oracle"][k])
            for k, g in grads[label].items()
            if g is not None and rel_error(g, grads["oracle"][k]) > REL_TOL[dtype]
        }
        assert not bad, f"{label} ({dtype}) gradients exceed {REL_TOL[dtype]:.2g}: {bad}"
