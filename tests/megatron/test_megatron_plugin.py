"""install(), the spec builders, the command line, the plugin options and what MoEBlaze refuses."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import moeblaze_megatron
from megatron_testing import (
    build_gpt,
    build_moe_layer,
    copy_parameters,
    cpu_megatron,  # noqa: F401 - fixture
    moe_config,
    seed_everything,
)
from moeblaze_megatron import megatron_plugin
from moeblaze_megatron.config import MoEBlazeConfig, get_moeblaze_config, set_moeblaze_config
from moeblaze_megatron.dispatcher import MoEBlazeTokenDispatcher
from moeblaze_megatron.experts import MoEBlazeGroupedMLP
from moeblaze_megatron.megatron_plugin import (
    add_moeblaze_args,
    check_moeblaze_config,
    moeblaze_extra_args_provider,
    transformer_config_from_args,
)

pytestmark = pytest.mark.usefixtures("cpu_megatron")


def _moe_layers(module):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in module.modules() if isinstance(m, MoELayer)]


def test_install_is_idempotent_and_reversible():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    moeblaze_megatron.install()
    patched = MoELayer.__init__
    moeblaze_megatron.install()
    assert MoELayer.__init__ is patched, "a second install() wrapped the constructor again"
    megatron_plugin.uninstall()
    try:
        assert not megatron_plugin.is_installed()
        with pytest.raises(ValueError, match="Unsupported token dispatcher type: moeblaze"):
            build_moe_layer(moe_config("moeblaze"))
    finally:
        moeblaze_megatron.install()
    assert isinstance(build_moe_layer(moe_config("moeblaze")).token_dispatcher, MoEBlazeTokenDispatcher)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_other_dispatchers_untouched(dispatcher):
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAllGatherTokenDispatcher,
        MoEAlltoAllTokenDispatcher,
    )

    layer = build_moe_layer(moe_config(dispatcher))
    expected = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}[dispatcher]
    assert type(layer.token_dispatcher) is expected
    assert type(layer.experts) is SequentialMLP
    assert layer.config.moe_token_dispatcher_type == dispatcher


def test_local_layer_spec_builds_moeblaze():
    config = moe_config("moeblaze", moe_ffn_hidden_size=40)
    layer = build_moe_layer(config)
    assert isinstance(layer.token_dispatcher, MoEBlazeTokenDispatcher)
    assert isinstance(layer.experts, MoEBlazeGroupedMLP)
    assert config.moe_token_dispatcher_type == "moeblaze", "the config was left modified"
    # moe_ffn_hidden_size, not ffn_hidden_size, sizes the experts; SwiGLU doubles fc1.
    assert tuple(layer.experts.weight1.shape) == (6, 80, 32)
    assert tuple(layer.experts.weight2.shape) == (6, 32, 40)


def test_decoder_block_spec_builds_moeblaze_layers():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    model = build_gpt(moe_config("moeblaze", num_layers=3, moe_layer_freq=[1, 0, 1]))
    layers = _moe_layers(model)
    assert len(layers) == 2
    for layer in layers:
        assert isinstance(layer, MoELayer)
        assert isinstance(layer.token_dispatcher, MoEBlazeTokenDispatcher)
        assert isinstance(layer.experts, MoEBlazeGroupedMLP)


def test_transformer_engine_spec_builds_moeblaze():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if not HAVE_TE:
        pytest.skip("Transformer Engine is not installed")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    for grouped_gemm in (False, True):
        config = moe_config("moeblaze", moe_grouped_gemm=grouped_gemm)
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=6, moe_grouped_gemm=grouped_gemm)
        layer = spec.submodules.mlp(config=config)
        assert isinstance(layer.token_dispatcher, MoEBlazeTokenDispatcher)
        assert isinstance(layer.experts, MoEBlazeGroupedMLP)


def test_foreign_experts_refused():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    class CustomExperts(torch.nn.Module):
        pass

    spec = get_gpt_layer_local_spec(num_experts=6)
    submodules = spec.submodules.mlp.keywords["submodules"]
    custom = MoESubmodules(experts=CustomExperts, shared_experts=submodules.shared_experts)
    with pytest.raises(ValueError, match="CustomExperts"):
        spec.submodules.mlp.func(config=moe_config("moeblaze"), submodules=custom)


def test_experts_refuse_stock_dispatcher_output():
    layer = build_moe_layer(moe_config("moeblaze"))
    with pytest.raises(TypeError, match="ExpertRouting"):
        layer.experts(torch.randn(4, 32), torch.tensor([1, 1, 1, 1, 0, 0]), torch.rand(4))


# ---------------------------------------------------------------------------------------------
# Command line

MEGATRON_ARGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "1", "--num-experts", "4",
    "--disable-bias-linear", "--swiglu",
]


def _parse(monkeypatch, extra, provider=None):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain", *MEGATRON_ARGS, *extra])
    return parse_args(provider or moeblaze_extra_args_provider())


def test_parser_accepts_moeblaze_and_plugin_flags(monkeypatch):
    def user_provider(parser):
        parser.add_argument("--my-option", type=int, default=0)
        return parser

    args = _parse(
        monkeypatch,
        ["--moe-token-dispatcher-type", "moeblaze", "--moeblaze-recompute", "fc1",
         "--moeblaze-routing-method", "sort", "--moeblaze-backend", "reference", "--my-option", "7"],
        moeblaze_extra_args_provider(user_provider),
    )
    assert args.moe_token_dispatcher_type == "moeblaze"
    assert (args.moeblaze_recompute, args.moeblaze_routing_method, args.moeblaze_backend) == ("fc1", "sort", "reference")
    assert args.my_option == 7
    assert megatron_plugin.moeblaze_config_from_args(args) == MoEBlazeConfig("fc1", "sort", "reference")


def test_every_megatron_parse_accepts_moeblaze_after_install(monkeypatch):
    """pretrain() parses sys.argv again with no extra_args_provider (fault-tolerance setup)."""
    from megatron.training import arguments, ft_integration

    monkeypatch.setattr(sys, "argv", ["pretrain", *MEGATRON_ARGS, "--moe-token-dispatcher-type", "moeblaze",
                                      "--moeblaze-recompute", "fc1"])
    was_installed = megatron_plugin.is_installed()
    megatron_plugin.install()
    try:
        ft_integration.setup()  # the re-parse inside pretrain(); returns when FT is off
        args = arguments.parse_args(ignore_unknown_args=True)
        assert (args.moe_token_dispatcher_type, args.moeblaze_recompute) == ("moeblaze", "fc1")
        megatron_plugin.uninstall()
        with pytest.raises(SystemExit):
            arguments.parse_args(ignore_unknown_args=True)
    finally:
        megatron_plugin.install()
        if not was_installed:
            megatron_plugin.uninstall()


def test_parser_defaults_and_stock_choices(monkeypatch):
    args = _parse(monkeypatch, ["--moe-token-dispatcher-type", "alltoall"])
    assert args.moe_token_dispatcher_type == "alltoall"
    assert megatron_plugin.moeblaze_config_from_args(args) == MoEBlazeConfig()


@pytest.mark.parametrize("flags,message", [
    (["--moeblaze-recompute", "full"],
     "argument --moeblaze-recompute: invalid choice: 'full' (choose from 'activation', 'fc1')"),
    (["--moeblaze-backend", "cuda"], "argument --moeblaze-backend: invalid choice: 'cuda'"),
    (["--moeblaze-ep-mode", "ring"], "ep_mode='ring' needs recompute='fc1' (--moeblaze-recompute fc1)"),
])
def test_parser_rejects_bad_plugin_values_in_one_line(monkeypatch, capsys, flags, message):
    """A bad --moeblaze-* value: argparse's own form of error, one line, exit code 2, no usage dump."""
    with pytest.raises(SystemExit) as exit_info:
        _parse(monkeypatch, ["--moe-token-dispatcher-type", "moeblaze", *flags])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "error: " in lines[0] and message in lines[0], lines


def test_add_moeblaze_args_twice_is_harmless():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"))
    add_moeblaze_args(add_moeblaze_args(parser))
    args = parser.parse_args(["--moe-token-dispatcher-type", "moeblaze"])
    assert args.moe_token_dispatcher_type == "moeblaze" and args.moeblaze_recompute == "activation"


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--fp8-format", "e4m3"], "fp8_recipe='delayed'"),
        (["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"], "use --fp8-recipe blockwise"),
        (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], "MXFP8 needs Blackwell"),
        (["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--fp8-param-gather"], "fp8_param"),
        (["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"], "moe_pad_expert_input_to_capacity"),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "expert_tensor_parallel_size=2"),
        (["--expert-tensor-parallel-size", "2"], "expert_tensor_parallel_size=2"),
        (["--expert-model-parallel-size", "2", "--cuda-graph-impl", "local", "--cuda-graph-modules", "moe"],
         "CUDA graphs over the MoE dispatch at expert-parallel size 2"),
        (["--overlap-moe-expert-parallel-comm"], "overlap_moe_expert_parallel_comm"),
        (["--moe-permute-fusion"], "moe_permute_fusion"),
        (["--moe-apply-probs-on-input"], "moe_apply_probs_on_input"),
        (["--add-bias-linear"], "add_bias_linear"),
        (["--moe-latent-size", "8"], "moe_latent_size"),
    ],
)
def test_parser_refuses_unsupported_options(monkeypatch, capsys, flags, named):
    from megatron.training.arguments import parse_args

    argv = [a for a in MEGATRON_ARGS if not (a == "--disable-bias-linear" and "--add-bias-linear" in flags)]
    monkeypatch.setattr(sys, "argv", ["pretrain", *argv, "--moe-token-dispatcher-type", "moeblaze", *flags])
    with pytest.raises(SystemExit) as exit_info:
        parse_args(moeblaze_extra_args_provider())
    stderr = capsys.readouterr().err
    if "unrecognized arguments" in stderr:
        pytest.skip(f"this Megatron has no flag among {flags}")
    # A plain argument error: exit code 2, the plugin's message, no traceback, no usage dump.
    assert exit_info.value.code == 2
    assert "error:" in stderr and "does not support" in stderr and named in stderr
    assert "Traceback" not in stderr and "usage:" not in stderr


def test_parser_tp_with_expert_tp_1_accepted(monkeypatch):
    args = _parse(
        monkeypatch,
        ["--moe-token-dispatcher-type", "moeblaze", "--tensor-model-parallel-size", "2",
         "--sequence-parallel", "--expert-tensor-parallel-size", "1"],
    )
    assert args.expert_tensor_parallel_size == 1


def test_ep_and_ring_mode_flags(monkeypatch):
    fc1 = ["--moeblaze-recompute", "fc1"]
    for flags, want in (([], ("alltoall", "auto")), (["--moeblaze-ep-mode", "ring", *fc1], ("ring", "auto")),
                        (["--moeblaze-ep-mode", "auto", "--moeblaze-ring-mode", "token", *fc1], ("auto", "token")),
                        (["--moeblaze-ep-mode", "ring", "--moeblaze-ring-mode", "expert", *fc1], ("ring", "expert"))):
        args = _parse(monkeypatch, ["--moe-token-dispatcher-type", "moeblaze", *flags])
        options = megatron_plugin.moeblaze_config_from_args(args)
        assert (options.ep_mode, options.ring_mode) == want
    with pytest.raises(ValueError, match="ep_mode must be one of"):
        MoEBlazeConfig(ep_mode="relay")
    with pytest.raises(ValueError, match="ring_mode must be one of"):
        MoEBlazeConfig(ring_mode="weights")


def test_transformer_config_from_args_attaches_options(monkeypatch):
    from megatron.training.arguments import validate_args

    args = _parse(monkeypatch, ["--moe-token-dispatcher-type", "moeblaze", "--moeblaze-recompute", "fc1", "--bf16"])
    validate_args(args)
    config = transformer_config_from_args(args)
    assert config.moe_token_dispatcher_type == "moeblaze"
    assert get_moeblaze_config(config) == MoEBlazeConfig(recompute="fc1")
    seed_everything(1)
    layer = build_moe_layer(config)
    assert layer.experts.options.recompute == "fc1"


# ---------------------------------------------------------------------------------------------
# Configs and options


@pytest.mark.parametrize(
    "overrides,named",
    [
        (dict(add_bias_linear=True), "add_bias_linear"),
        (dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True), "moe_pad_expert_input_to_capacity"),
        (dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True), "moe_apply_probs_on_input"),
        (dict(gated_linear_unit=True, activation_func=F.gelu), "gated activation with gelu"),
        (dict(gated_linear_unit=False, activation_func=torch.relu), "activation relu"),
        (dict(activation_func_clamp_value=5.0), "activation_func_clamp_value"),
        (dict(glu_linear_offset=1.0), "glu_linear_offset"),
        (dict(tensor_model_parallel_size=2, sequence_parallel=True), "expert_tensor_parallel_size=2"),
        (dict(moe_mlp_glu_interleave_size=32), "moe_mlp_glu_interleave_size"),
    ],
)
def test_layer_build_refuses_unsupported_config(overrides, named):
    config = moe_config("moeblaze", **overrides)
    with pytest.raises(ValueError, match="does not support") as error:
        check_moeblaze_config(config)
    assert named in str(error.value)
    if config.tensor_model_parallel_size == 1:
        with pytest.raises(ValueError, match=named.split("=")[0]):
            build_moe_layer(config)


def test_check_lists_every_problem():
    config = moe_config("moeblaze", add_bias_linear=True, glu_linear_offset=1.0)
    with pytest.raises(ValueError) as error:
        check_moeblaze_config(config)
    assert "add_bias_linear" in str(error.value) and "glu_linear_offset" in str(error.value)


def test_supported_configs_pass_check():
    for overrides in (
        {},
        dict(moe_expert_capacity_factor=0.5),
        dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1),
        dict(recompute_granularity="selective", recompute_modules=["moe", "moe_act"], moe_grouped_gemm=True),
        dict(gated_linear_unit=False, activation_func=F.gelu),
    ):
        check_moeblaze_config(moe_config("moeblaze", **overrides))


def test_moeblaze_config_values_checked():
    with pytest.raises(ValueError, match="recompute"):
        MoEBlazeConfig(recompute="everything")
    with pytest.raises(ValueError, match="routing_method"):
        MoEBlazeConfig(routing_method="magic")
    with pytest.raises(ValueError, match="backend"):
        MoEBlazeConfig(backend="cuda")
    config = moe_config("moeblaze")
    with pytest.raises(TypeError, match="MoEBlazeConfig"):
        set_moeblaze_config(config, {"recompute": "fc1"})
    config.moeblaze = "fc1"
    with pytest.raises(TypeError, match="config.moeblaze"):
        get_moeblaze_config(config)


def test_recompute_option_reaches_the_op():
    """recompute='fc1' keeps less for backward than 'activation', with identical results."""
    layers, saved = {}, {}
    for mode in ("activation", "fc1"):
        config = set_moeblaze_config(moe_config("moeblaze"), MoEBlazeConfig(recompute=mode))
        seed_everything(3)
        layers[mode] = build_moe_layer(config)
    copy_parameters(layers["activation"], layers["fc1"])
    x = torch.randn(16, 2, 32)
    outs = {}
    for mode, layer in layers.items():
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        xx = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = layer(xx)
        out.sum().backward()
        saved[mode] = sum(storages.values())
        outs[mode] = (out.detach(), xx.grad)
    assert saved["fc1"] < saved["activation"]
    assert torch.equal(outs["fc1"][0], outs["activation"][0])
    torch.testing.assert_close(outs["fc1"][1], outs["activation"][1], rtol=1e-6, atol=1e-7)
