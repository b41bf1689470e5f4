"""Megatron's FP8 recipe and MoEBlaze's experts: --fp8-format e4m3|hybrid with --fp8-recipe
blockwise runs the experts' GEMMs in FP8 (the op's fp8 option), every other recipe and
--fp8-param-gather are refused by name, --moe-router-padding-for-fp8 is accepted and said to have
nothing to pad."""

from __future__ import annotations

import sys

import pytest
import torch

from megatron_testing import build_moe_layer, cpu_megatron, moe_config, seed_everything  # noqa: F401 - fixture
from moeblaze_megatron import experts as experts_module
from moeblaze_megatron.config import MoEBlazeConfig, get_moeblaze_config
from moeblaze_megatron.megatron_plugin import (
    check_moeblaze_args,
    check_moeblaze_config,
    moeblaze_config_from_args,
    moeblaze_extra_args_provider,
    transformer_config_from_args,
)
from moeblaze_megatron.moe_mlp import moe_mlp

MEGATRON_ARGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "1", "--num-experts", "4",
    "--disable-bias-linear", "--swiglu", "--moe-token-dispatcher-type", "moeblaze",
]


def _parse(monkeypatch, extra):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain", *MEGATRON_ARGS, *extra])
    return parse_args(moeblaze_extra_args_provider())


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_blockwise_recipe_reaches_the_options(monkeypatch, fmt):
    args = _parse(monkeypatch, ["--fp8-format", fmt, "--fp8-recipe", "blockwise", "--moe-router-padding-for-fp8"])
    assert moeblaze_config_from_args(args) == MoEBlazeConfig(fp8=fmt)
    check_moeblaze_args(args)  # nothing refused


def test_no_fp8_leaves_the_experts_in_the_model_dtype(monkeypatch):
    assert moeblaze_config_from_args(_parse(monkeypatch, [])).fp8 is None


def test_ring_with_fp8_is_one_argument_error(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(monkeypatch, ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--moeblaze-ep-mode", "ring",
                             "--moeblaze-recompute", "fc1"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "use --moeblaze-ep-mode alltoall" in lines[0], lines


def test_transformer_config_from_args_carries_the_format(monkeypatch, cpu_megatron):
    from megatron.core.transformer import transformer_config
    from megatron.training.arguments import validate_args

    # Megatron asks Transformer Engine's version for MoE FP8 (its own fp8 layers need TE, not ours):
    # the check answers as a TE install would.
    monkeypatch.setattr(transformer_config, "is_te_min_version", lambda *a, **k: True)
    args = _parse(monkeypatch, ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--bf16"])
    validate_args(args)
    config = transformer_config_from_args(args)
    assert config.fp8 == "hybrid" and get_moeblaze_config(config).fp8 == "hybrid"
    seed_everything(1)
    layer = build_moe_layer(config)
    assert layer.experts.options.fp8 == "hybrid"


def _fp8_config(fmt="e4m3", recipe="blockwise", **overrides):
    config = moe_config("moeblaze", dtype=torch.bfloat16, **overrides)
    # Set after construction: Megatron's own MoE FP8 check asks for Transformer Engine, which the
    # experts do not need.
    config.fp8, config.fp8_recipe = fmt, recipe
    return config


@pytest.mark.parametrize("recipe,named", [("delayed", "fp8_recipe='delayed'"), ("tensorwise", "blockwise"),
                                          ("mxfp8", "MXFP8 needs Blackwell"), ("custom", "fp8_recipe='custom'")])
def test_other_recipes_are_refused_at_layer_build(cpu_megatron, recipe, named):
    config = _fp8_config(recipe=recipe)
    with pytest.raises(ValueError, match="does not support") as error:
        check_moeblaze_config(config)
    assert named in str(error.value)
    with pytest.raises(ValueError, match="blockwise"):
        build_moe_layer(config)


def test_fp8_param_gather_is_refused(cpu_megatron):
    config = _fp8_config()
    config.fp8_param = True
    with pytest.raises(ValueError, match=r"fp8_param \(--fp8-param-gather\)"):
        check_moeblaze_config(config)


def test_layer_runs_the_op_in_fp8(cpu_megatron, capsys):
    """The experts of a layer built under the blockwise recipe give moe_mlp(fp8=...)'s bits for the
    rows and routing they receive (so the option is not dropped on the way), and differ from
    the bf16 experts'; the start-up lines say FP8 and that there is nothing to pad, once."""
    experts_module._said.clear()
    seed_everything(3)
    config = _fp8_config("hybrid")
    config.moe_router_padding_for_quantization = True
    layer = build_moe_layer(config)
    layer(torch.randn(5, 2, 32, dtype=torch.bfloat16))  # a second layer build says nothing new
    build_moe_layer(config)
    out = capsys.readouterr().out
    assert out.count("moeblaze: experts in FP8 (hybrid, blockwise") == 1, out
    assert out.count("moeblaze: --moe-router-padding-for-quantization: nothing to pad") == 1, out

    seen = {}
    forward = layer.experts.forward

    def recorded(rows, routing, probs):
        seen.update(rows=rows.detach().clone(), ids=routing.topk_ids.clone(), probs=probs.detach().clone())
        result = forward(rows, routing, probs)
        seen["out"] = result[0].detach().clone()
        return result

    layer.experts.forward = recorded
    x = torch.randn(7, 3, 32, dtype=torch.bfloat16, requires_grad=True)
    y, _ = layer(x)
    y.float().sum().backward()
    w1, w2 = layer.experts.weight1, layer.experts.weight2
    want = moe_mlp(seen["rows"], seen["ids"], seen["probs"], w1.detach(), w2.detach(), fp8="hybrid", validate=False)
    assert torch.equal(seen["out"], want)
    plain = moe_mlp(seen["rows"], seen["ids"], seen["probs"], w1.detach(), w2.detach(), validate=False)
    assert not torch.equal(plain, want)
    assert w1.grad is not None or getattr(w1, "main_grad", None) is not None
