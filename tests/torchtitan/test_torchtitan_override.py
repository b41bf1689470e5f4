"""The override through torchtitan's own config system: ``--override.imports`` parsed by its
ConfigManager (the README's ``torchtitan.train`` command line, with the repository's config module
``training.titan_example``) and applied as its Trainer applies it; every MoE layer replaced, the
rest of the config and of the built model untouched; options and conflicts reported by name.
And the example's data: torchtitan's batch format from the built-in corpus."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

MODULE = "moeblaze_megatron.training.titan_example"
TARGET = "moeblaze_megatron.torchtitan.moeblaze_experts"


def _parse(*extra):
    """torchtitan.train's config parsing and what its Trainer does before building the model."""
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides

    config = ConfigManager().parse_args(["--module", MODULE, "--config", "tiny", *extra])
    config.model_spec.model.update_from_config(config=config)
    lines = apply_overrides(config.override, config) if config.override.imports else []
    return config, lines


def _without_routed_experts(tree) -> str:
    """The config dict as text with every MoE layer's routed-experts entry and the override list
    left out (and the addresses in the reprs of initializer closures, built anew per parse)."""
    tree = copy.deepcopy(tree)
    for layer in tree["model_spec"]["model"]["layers"]:
        layer["moe"].pop("routed_experts")
    tree.pop("override")
    return re.sub(r" at 0x[0-9a-f]+", "", json.dumps(tree, sort_keys=True, default=repr))


def test_override_replaces_every_moe_layer_and_nothing_else():
    from moeblaze_megatron.torchtitan import MoEBlazeRoutedExperts

    stock, _ = _parse()
    ours, lines = _parse("--override.imports", f'{TARGET}={json.dumps({"recompute": "fc1", "backend": "reference"})}')
    layers = ours.model_spec.model.layers
    assert len(lines) == len(layers) == 2
    for stock_layer, layer in zip(stock.model_spec.model.layers, layers):
        routed = layer.moe.routed_experts
        assert type(routed) is MoEBlazeRoutedExperts.Config
        assert (routed.moeblaze.recompute, routed.moeblaze.backend) == ("fc1", "reference")
        # torchtitan's expert weights, dispatcher config and sharding configs are carried over.
        # (to_dict: the initializers are partials, equal by their repr only)
        assert routed.inner_experts.to_dict() == stock_layer.moe.routed_experts.inner_experts.to_dict()
        assert routed.token_dispatcher == stock_layer.moe.routed_experts.token_dispatcher
        assert routed.sharding_config == stock_layer.moe.routed_experts.sharding_config
    assert _without_routed_experts(ours.to_dict()) == _without_routed_experts(stock.to_dict())
    with torch.device("meta"):
        stock_model, our_model = stock.model_spec.model.build(), ours.model_spec.model.build()
    our_model.verify_module_protocol()
    stock_modules, our_modules = dict(stock_model.named_modules()), dict(our_model.named_modules())
    assert stock_modules.keys() == our_modules.keys()
    changed = {name for name in stock_modules if type(stock_modules[name]) is not type(our_modules[name])}
    assert changed == {f"layers.{i}.moe.routed_experts" for i in range(len(layers))}
    for named in ("named_parameters", "named_buffers"):
        assert [(n, t.shape, t.dtype) for n, t in getattr(our_model, named)()] == \
               [(n, t.shape, t.dtype) for n, t in getattr(stock_model, named)()]


def test_options_and_conflicts_are_named():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'reference'\), got 'cuda'"):
        _parse("--override.imports", f'{TARGET}={{"backend": "cuda"}}')
    # torchtitan's own fused-gate/up override claims the inner experts the override replaces.
    with pytest.raises(ValueError, match="ancestor"):
        _parse("--override.imports", f"{TARGET},torchtitan.overrides.fused_swiglu.fused_grouped_experts")


def test_example_dataloader_gives_torchtitans_batches():
    from moeblaze_megatron.training.corpus import EOD_ID
    from moeblaze_megatron.training.titan_example import BuiltinCorpusDataLoader, ByteTokenizer

    tokenizer = ByteTokenizer.Config().build(tokenizer_path=".")
    assert tokenizer.encode("hé", add_eos=True) == [104, 195, 169, EOD_ID] and tokenizer.decode([104, 105]) == "hi"
    loader = BuiltinCorpusDataLoader.Config().build(dp_world_size=2, dp_rank=1, tokenizer=tokenizer, seq_len=512,
                                                    local_batch_size=3)
    batches = iter(loader)
    inputs, labels = next(batches)
    assert inputs["input"].shape == inputs["positions"].shape == labels.shape == (3, 512)
    for row_in, row_lab, row_pos in zip(inputs["input"], labels, inputs["positions"]):
        # Labels are the next token inside a document, a document's last label is EOD, and
        # positions count from 0 within each document (from the sample's start for the first).
        same_doc = row_pos[1:] == row_pos[:-1] + 1
        assert torch.equal(row_lab[:-1][same_doc], row_in[1:][same_doc])
        assert bool((row_lab[:-1][~same_doc] == EOD_ID).all()) and bool((row_pos[1:][~same_doc] == 0).all())
        assert int(row_pos[0]) == 0
    state = loader.state_dict()
    after = next(batches)
    resumed = BuiltinCorpusDataLoader.Config().build(dp_world_size=2, dp_rank=1, tokenizer=tokenizer, seq_len=512,
                                                     local_batch_size=3)
    resumed.load_state_dict(state)
    again = next(iter(resumed))
    assert torch.equal(again[1], after[1]) and torch.equal(again[0]["positions"], after[0]["positions"])


def test_packed_samples_pack_as_torchtitan(tmp_path):
    """Two documents "ab" and "cde" (bytes, then EOD) in samples of 3: inputs and labels shift
    inside each document, positions restart per document and at a sample's start."""
    from moeblaze_megatron.training.corpus import EOD_ID, PackedSamples

    files = []
    for name, text in (("a.py", b"ab"), ("b.py", b"cde")):
        (tmp_path / name).write_bytes(text)
        files.append(tmp_path / name)
    a, b, c, d, e = b"abcde"
    samples = PackedSamples(files, seq_len=3)
    got = [tuple(x.tolist() for x in samples.next_sample()) for _ in range(3)]
    assert got == [
        ([a, b, c], [b, EOD_ID, d], [0, 1, 0]),
        ([d, e, a], [e, EOD_ID, b], [0, 1, 0]),  # "cde" continued: its positions start at 0 again
        ([b, c, d], [EOD_ID, d, e], [0, 0, 1]),
    ]
    with pytest.raises(ValueError, match="seq_len must be positive"):
        PackedSamples(files, seq_len=0)
