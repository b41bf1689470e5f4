"""The plugin's Transformer Engine layer-spec path without Transformer Engine: Megatron's own
TEGroupedMLP (its grouped linears stand-ins with TE's layouts, te_testing.py) against
MoEBlazeGroupedMLP. The plugin swaps TEGroupedMLP for MoEBlaze's experts writing TEGroupedMLP's
plain layout; forward and backward agree with TEGroupedMLP's; plain state dicts load both ways
strictly; the torch_dist sharded layouts (keys, global shapes, dtypes) are TEGroupedMLP's and
checkpoints move both ways; and benchlib.te_layouts renames a TE model for a local-spec oracle."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from benchlib.te_layouts import compare_sharded_layouts, rename_te_key, sharded_layout, te_to_local_state
from megatron_testing import REL_TOL, cpu_megatron, moe_config, rel_error, seed_everything  # noqa: F401 - fixture
from te_testing import FakeTEColumnParallelGroupedLinear, with_te_grouped_experts

from moeblaze_megatron.experts import MoEBlazeGroupedMLP


def build_te_moe_layer(config):
    """The MoE layer of the local spec with TEGroupedMLP experts (what the TE spec builds for the
    experts with moe_grouped_gemm)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=False)
    return with_te_grouped_experts(spec.submodules.mlp)(config=config).to(config.params_dtype)


def build_te_gpt(config, vocab_size: int = 64, seq_len: int = 16):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    layers = [dataclasses.replace(s, submodules=dataclasses.replace(
        s.submodules, mlp=with_te_grouped_experts(s.submodules.mlp))) for s in block.layer_specs]
    block = dataclasses.replace(block, layer_specs=layers)
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=vocab_size, max_sequence_length=seq_len,
                     position_embedding_type="rope")
    return model.to(config.params_dtype)


def _tensors(module):
    return {k: v for k, v in module.state_dict().items() if torch.is_tensor(v) and not k.endswith("_extra_state")}


def _assert_same_tensors(got, want):
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.usefixtures("cpu_megatron")
def test_plugin_swaps_te_grouped_mlp_for_moeblaze_experts_in_its_layout():
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    stock = build_te_moe_layer(moe_config("allgather"))
    blaze = build_te_moe_layer(moe_config("moeblaze"))
    assert isinstance(stock.experts, TEGroupedMLP)
    assert isinstance(stock.experts.linear_fc1, FakeTEColumnParallelGroupedLinear)
    assert isinstance(blaze.experts, MoEBlazeGroupedMLP) and blaze.experts.checkpoint_layout == "te_grouped"
    assert blaze.state_dict().keys() == stock.state_dict().keys()
    assert "experts.linear_fc1.weight5" in blaze.state_dict() and "experts.linear_fc2._extra_state" in blaze.state_dict()


@pytest.mark.usefixtures("cpu_megatron")
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_forward_backward_match_te_grouped_mlp(activation):
    """Same weights: MoEBlaze's output and gradients are TEGroupedMLP's ([gate | up] fc1 rows,
    probabilities applied after the activation)."""
    seed_everything(1)
    stock = build_te_moe_layer(moe_config("allgather", activation))
    blaze = build_te_moe_layer(moe_config("moeblaze", activation))
    blaze.load_state_dict(stock.state_dict(), strict=True)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(24, 2, 32, generator=generator)
    upstream = torch.randn(24, 2, 32, generator=generator)
    results = {}
    for name, layer in (("stock", stock), ("moeblaze", blaze)):
        xx = x.clone().requires_grad_()
        out, _ = layer(xx)
        (out * upstream).sum().backward()
        fc1 = (torch.stack([getattr(layer.experts.linear_fc1, f"weight{i}").grad for i in range(6)])
               if name == "stock" else layer.experts.weight1.grad)
        results[name] = (out.detach(), xx.grad, fc1, layer.router.weight.grad)
    for got, want, what in zip(results["moeblaze"], results["stock"], ("output", "input grad", "fc1 grad", "router grad")):
        assert rel_error(got, want) < REL_TOL[torch.float32], what


@pytest.mark.usefixtures("cpu_megatron")
def test_plain_state_dicts_load_both_ways_strictly():
    seed_everything(3)
    stock = build_te_moe_layer(moe_config("allgather"))
    seed_everything(4)
    blaze = build_te_moe_layer(moe_config("moeblaze"))
    assert not torch.equal(blaze.experts.weight1[0], stock.experts.linear_fc1.weight0)
    blaze.load_state_dict(stock.state_dict(), strict=True)
    _assert_same_tensors(_tensors(blaze), _tensors(stock))
    seed_everything(5)
    fresh = build_te_moe_layer(moe_config("allgather"))
    fresh.load_state_dict(blaze.state_dict(), strict=True)
    _assert_same_tensors(_tensors(fresh), _tensors(blaze))
    assert fresh.experts.linear_fc1.extra_states_loaded == [None]  # ours is empty; TE ignores None


@pytest.mark.usefixtures("cpu_megatron")
def test_loads_single_grouped_weight_layout():
    """TEGroupedMLP with moe_single_grouped_weight saves one [E, out, in] tensor per linear."""
    seed_everything(6)
    stock = build_te_moe_layer(moe_config("allgather"))
    state = {k: v for k, v in stock.state_dict().items() if ".weight" not in k or "experts" not in k}
    for fc in ("linear_fc1", "linear_fc2"):
        state[f"experts.{fc}.weight"] = torch.stack([getattr(getattr(stock.experts, fc), f"weight{i}") for i in range(6)])
    blaze = build_te_moe_layer(moe_config("moeblaze"))
    blaze.load_state_dict(state, strict=True)
    _assert_same_tensors(_tensors(blaze), _tensors(stock))


def _te_gpt(dispatcher, seed):
    seed_everything(seed)
    return build_te_gpt(moe_config(dispatcher, num_layers=3, moe_layer_freq=[1, 0, 1]))


@pytest.mark.usefixtures("cpu_megatron")
def test_sharded_layout_is_te_grouped_mlps():
    """Every key, global shape and dtype of the torch_dist checkpoint is TEGroupedMLP's (and
    SequentialMLP's); only the chunking of the expert weights differs (one shard per stacked
    weight and SwiGLU half, against one per expert), which torch_dist reshards on load."""
    stock, blaze = _te_gpt("allgather", 7), _te_gpt("moeblaze", 8)
    stock_layout, our_layout = sharded_layout(stock.sharded_state_dict()), sharded_layout(blaze.sharded_state_dict())
    diff = compare_sharded_layouts(stock_layout, our_layout)
    assert diff["same"], diff
    # Megatron's expert keys (layer index kept with a dense layer in between): (experts, 2h, d).
    fc1 = "decoder.layers.2.mlp.experts.experts.linear_fc1.weight"
    assert stock_layout[fc1]["global_shape"] == (6, 48, 32)
    assert stock_layout[fc1]["chunks"] == 6 * 2 and our_layout[fc1]["chunks"] == 2
    assert our_layout["decoder.layers.0.mlp.experts.experts.linear_fc2._extra_state"]["numel"] == 6
    assert fc1 in diff["chunking_differs"]


def test_layout_comparison_reports_what_differs():
    base = {"a": {"kind": "tensor", "global_shape": (4, 2), "dtype": "torch.float32", "chunks": 4, "numel": 8},
            "b": {"kind": "object", "global_shape": (4,), "dtype": None, "chunks": 4, "numel": 4}}
    assert compare_sharded_layouts(base, {k: dict(v, chunks=1) for k, v in base.items()})["same"]
    other = {"a": dict(base["a"], global_shape=(2, 4)), "c": base["b"]}
    diff = compare_sharded_layouts(base, other)
    assert not diff["same"] and diff["only_stock"] == ["b"] and diff["only_ours"] == ["c"]
    assert diff["mismatched"][0]["key"] == "a" and diff["mismatched"][0]["fields"] == ["global_shape"]


@pytest.mark.usefixtures("cpu_megatron")
def test_dist_checkpoints_both_ways(tmp_path):
    from megatron.core import dist_checkpointing

    for writer, reader, path in ((_te_gpt("allgather", 9), _te_gpt("moeblaze", 10), tmp_path / "stock"),
                                 (_te_gpt("moeblaze", 11), _te_gpt("allgather", 12), tmp_path / "moeblaze")):
        assert not torch.equal(writer.state_dict()["decoder.layers.0.mlp.router.weight"],
                               reader.state_dict()["decoder.layers.0.mlp.router.weight"])
        path.mkdir()
        dist_checkpointing.save(writer.sharded_state_dict(), str(path))
        reader.load_state_dict(dist_checkpointing.load(reader.sharded_state_dict(), str(path)), strict=True)
        _assert_same_tensors(_tensors(reader), _tensors(writer))


@pytest.mark.usefixtures("cpu_megatron")
def test_te_state_renamed_for_a_local_spec_oracle():
    """A TEGroupedMLP model's state loaded into the local spec (SequentialMLP) gives the same
    loss; the layer norms TE fuses into its linears get the local names."""
    from megatron_testing import build_gpt

    te_model = _te_gpt("allgather", 13)
    seed_everything(14)
    local = build_gpt(moe_config("allgather", num_layers=3, moe_layer_freq=[1, 0, 1]))
    local.load_state_dict(te_to_local_state(te_model.state_dict(), local.state_dict().keys()), strict=True)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(15))
    positions = torch.arange(16)[None].expand(2, -1)
    causal = torch.ones(2, 1, 16, 16, dtype=torch.bool).tril().logical_not()
    losses = [m(tokens, positions, causal, labels=tokens).mean() for m in (te_model, local)]
    assert rel_error(losses[0], losses[1]) < REL_TOL[torch.float32]
    with pytest.raises(KeyError, match="missing"):
        te_to_local_state({k: v for k, v in te_model.state_dict().items() if "router" not in k}, local.state_dict().keys())
    extra = {"decoder.layers.0.self_attention.linear_qkv.bias": torch.empty(0)}
    assert te_to_local_state({**te_model.state_dict(), **extra}, local.state_dict().keys()).keys() == \
        local.state_dict().keys()
    with pytest.raises(KeyError, match="left over.*linear_qkv.bias"):
        te_to_local_state({**te_model.state_dict(), "decoder.layers.0.self_attention.linear_qkv.bias": torch.ones(3)},
                          local.state_dict().keys())
    assert rename_te_key("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.0.input_layernorm.weight"
    assert rename_te_key("decoder.layers.1.mlp.linear_fc1.layer_norm_weight") == "decoder.layers.1.pre_mlp_layernorm.weight"
    assert rename_te_key("layers.2.mlp.experts.linear_fc2.weight17") == "layers.2.mlp.experts.local_experts.17.linear_fc2.weight"
    for unchanged in ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc1.weight"):
        assert rename_te_key(unchanged) == unchanged


@pytest.mark.usefixtures("cpu_megatron")
def test_te_checks_run_on_the_stand_ins(monkeypatch):
    """benchlib.te_checks (what gpu_megatron_check.py --te runs on the GPU) end to end on the CPU
    with the TE spec's builders replaced by the local spec with TEGroupedMLP on stand-in linears
    (TE's fused options off: they need TE): the oracle renaming, the equivalence verdicts, the
    checkpoint directions and layout comparison, and the timing rows."""
    from benchlib import megatron_checks, te_checks

    from moeblaze_megatron.training.attention import SDPAttention, with_core_attention

    def gpt_builder(config, device, vocab, seq):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        # As the TE spec does: TEGroupedMLP experts only where the config asks for grouped GEMMs.
        layers = [dataclasses.replace(s, submodules=dataclasses.replace(
            s.submodules, mlp=with_te_grouped_experts(s.submodules.mlp) if config.moe_grouped_gemm else s.submodules.mlp))
            for s in block.layer_specs]
        block = with_core_attention(dataclasses.replace(block, layer_specs=layers), SDPAttention)
        return GPTModel(config=config, transformer_layer_spec=block, vocab_size=vocab, max_sequence_length=seq,
                        position_embedding_type="rope").to(config.params_dtype)

    # TE's fused options off (they need TE), the stock form's grouped GEMMs kept: its spec names
    # TEGroupedMLP, as on the GPU.
    monkeypatch.setattr(te_checks, "te_fields", lambda stock, router_fusion: {"moe_grouped_gemm": True} if stock else {})
    monkeypatch.setattr(te_checks, "build_te_layer", lambda config, device: build_te_moe_layer(config))
    monkeypatch.setattr(te_checks, "build_te_gpt", gpt_builder)
    shape = megatron_checks.SMOKE_LAYER_SHAPES["qwen3-like"]
    gpt = megatron_checks.SMOKE_GPT
    layer = te_checks.check_te_layer("qwen3-like", shape, 64, "cpu")
    assert layer["pass"], layer
    assert {"output", "input grad", "experts fc1", "experts fc2", "router"} <= set(layer["errors"]["moeblaze"])
    model = te_checks.check_te_gpt(gpt, "cpu")
    assert model["pass"], model
    checkpoints = te_checks.check_te_checkpoints(gpt, "cpu")
    assert checkpoints["pass"], checkpoints
    assert set(checkpoints["directions"]) == {"stock -> moeblaze", "moeblaze -> stock"}
    assert all(d["differed_before_load"] > 0 and not d["unequal_after_load"] for d in checkpoints["directions"].values())
    rows = te_checks.time_te_layer("qwen3-like", shape, 32, "cpu", 1, 1) + te_checks.time_te_gpt(gpt, "cpu", 1, 1)
    assert [r["impl"] for r in rows] == ["stock alltoall+TEGroupedMLP (TE spec)", "moeblaze (TE spec)"] * 2
    report = {"checks": [layer, model, checkpoints, {"check": "TE broken", "pass": False, "failed": ["raised"],
                                                     "error": "RuntimeError: x"}],
              "timings": rows, "timing_errors": [{"check": "TE GPTModel timing", "error": "OOM"}]}
    table = te_checks.format_te_table(report)
    assert "| TE broken | **verdict** | | FAIL: RuntimeError: x |" in table
    assert "same keys, shapes, dtypes" in table and "| TE GPTModel timing | not timed |" in table
