"""Checkpoint compatibility of MoEBlazeGroupedMLP with Megatron's stock experts: plain state dicts
both ways, TEGroupedMLP's key layout, identical initialization, parameter attributes, and torch_dist
distributed checkpoints saved by one and loaded by the other (world size 1, and EP = 2 <-> EP = 1
on two processes)."""

from __future__ import annotations

import os

import pytest
import torch

from moe_testing import run_distributed
from megatron_testing import (
    build_gpt,
    build_moe_layer,
    cpu_megatron,  # noqa: F401 - fixture
    megatron_on_cpu,
    moe_config,
    seed_everything,
)
from moeblaze_megatron.experts import MoEBlazeGroupedMLP


def _expert_state(layer_or_model):
    return {k: v for k, v in layer_or_model.state_dict().items() if "experts" in k and torch.is_tensor(v)}


def _assert_same_tensors(got: dict, want: dict):
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.usefixtures("cpu_megatron")
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_plain_state_dict_both_ways(activation):
    seed_everything(1)
    stock = build_moe_layer(moe_config("allgather", activation))
    seed_everything(2)
    blaze = build_moe_layer(moe_config("moeblaze", activation))
    assert blaze.state_dict().keys() == stock.state_dict().keys(), "not SequentialMLP's key set"
    blaze.load_state_dict(stock.state_dict(), strict=True)
    _assert_same_tensors(_expert_state(blaze), _expert_state(stock))
    fc1 = torch.stack([e.linear_fc1.weight for e in stock.experts.local_experts])
    assert torch.equal(blaze.experts.weight1, fc1)

    seed_everything(3)
    fresh_stock = build_moe_layer(moe_config("allgather", activation))
    fresh_stock.load_state_dict(blaze.state_dict(), strict=True)
    _assert_same_tensors(_expert_state(fresh_stock), _expert_state(blaze))


@pytest.mark.usefixtures("cpu_megatron")
def test_loads_te_grouped_mlp_layout():
    """TEGroupedMLP's plain keys: experts.linear_fc1.weight{i} / experts.linear_fc2.weight{i},
    plus Transformer Engine's _extra_state entries."""
    seed_everything(4)
    stock = build_moe_layer(moe_config("allgather"))
    te_state = {k: v for k, v in stock.state_dict().items() if "experts" not in k}
    for i, expert in enumerate(stock.experts.local_experts):
        te_state[f"experts.linear_fc1.weight{i}"] = expert.linear_fc1.weight.detach().clone()
        te_state[f"experts.linear_fc2.weight{i}"] = expert.linear_fc2.weight.detach().clone()
    te_state["experts.linear_fc1._extra_state"] = None
    te_state["experts.linear_fc2._extra_state"] = None
    blaze = build_moe_layer(moe_config("moeblaze"))
    blaze.load_state_dict(te_state, strict=True)
    _assert_same_tensors(_expert_state(blaze), _expert_state(stock))


@pytest.mark.usefixtures("cpu_megatron")
@pytest.mark.parametrize("cpu_init", [True, False], ids=["cpu_init", "rng_tracker_init"])
def test_same_initialization_as_sequential_mlp(cpu_init):
    layers = {}
    for dispatcher in ("allgather", "moeblaze"):
        seed_everything(5)
        layers[dispatcher] = build_moe_layer(moe_config(dispatcher, use_cpu_initialization=cpu_init))
    _assert_same_tensors(_expert_state(layers["moeblaze"]), _expert_state(layers["allgather"]))
    assert layers["moeblaze"].experts.weight1.abs().sum() > 0


@pytest.mark.usefixtures("cpu_megatron")
def test_expert_parameter_attributes_match_stock():
    stock = build_moe_layer(moe_config("allgather"))
    blaze = build_moe_layer(moe_config("moeblaze"))
    reference = stock.experts.local_experts[0]
    for ours, theirs in ((blaze.experts.weight1, reference.linear_fc1.weight), (blaze.experts.weight2, reference.linear_fc2.weight)):
        for attr in ("allreduce", "tensor_model_parallel", "partition_stride"):
            assert getattr(ours, attr) == getattr(theirs, attr), attr


def _save_and_load(source, target, directory):
    from megatron.core import dist_checkpointing

    directory.mkdir()
    dist_checkpointing.save(source.sharded_state_dict(), str(directory))
    loaded = dist_checkpointing.load(target.sharded_state_dict(), str(directory))
    target.load_state_dict(loaded, strict=True)


@pytest.mark.usefixtures("cpu_megatron")
def test_dist_checkpoint_interchange(tmp_path):
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    models = {}
    for dispatcher in ("allgather", "moeblaze"):
        seed_everything(6 if dispatcher == "allgather" else 7)
        models[dispatcher] = build_gpt(moe_config(dispatcher, num_layers=3, moe_layer_freq=[1, 0, 1]))
    stock, blaze = models["allgather"], models["moeblaze"]
    assert not torch.equal(blaze.state_dict()["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"],
                           stock.state_dict()["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"])
    _save_and_load(stock, blaze, tmp_path / "stock")
    _assert_same_tensors(_expert_state(blaze), _expert_state(stock))

    seed_everything(8)
    fresh_stock = build_gpt(moe_config("allgather", num_layers=3, moe_layer_freq=[1, 0, 1]))
    _save_and_load(blaze, fresh_stock, tmp_path / "moeblaze")
    _assert_same_tensors(_expert_state(fresh_stock), _expert_state(blaze))

    # The distributed optimizer finds every parameter, the stacked expert weights included.
    params = list(blaze.parameters())
    mapping = get_param_id_to_sharded_param_map(blaze.sharded_state_dict(), params)
    assert len(mapping) == len(params)


def _ep_checkpoint_worker(rank, world_size, port, directory):
    """Save at EP = 2 with one implementation, load at EP = 1 (two data-parallel replicas) with the
    other, both ways; every rank checks it holds all global experts."""
    from megatron.core import dist_checkpointing, parallel_state

    config_overrides = dict(num_layers=2, moe_layer_freq=[1, 1])
    saved = {}
    with megatron_on_cpu(rank, world_size, port, expert_model_parallel_size=2):
        for dispatcher in ("allgather", "moeblaze"):
            seed_everything(30 + (dispatcher == "moeblaze"))
            model = build_gpt(moe_config(dispatcher, expert_model_parallel_size=2, **config_overrides))
            for module in model.modules():
                if isinstance(module, MoEBlazeGroupedMLP):
                    assert module.weight1.allreduce is False and module.weight2.allreduce is False
            path = f"{directory}/{dispatcher}"
            if rank == 0:
                os.makedirs(path)
            torch.distributed.barrier()
            dist_checkpointing.save(model.sharded_state_dict(), path)
            # This rank's experts, by global index: rank r holds experts 3r, 3r+1, 3r+2.
            saved[dispatcher] = {
                k.replace(f"local_experts.{i}.", f"local_experts.{3 * rank + i}."): v
                for k, v in _expert_state(model).items()
                for i in range(3)
                if f"local_experts.{i}." in k
            }
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(expert_model_parallel_size=1)
        gathered = [None] * world_size
        torch.distributed.all_gather_object(gathered, saved)
        for writer, reader in (("allgather", "moeblaze"), ("moeblaze", "allgather")):
            seed_everything(40)
            model = build_gpt(moe_config(reader, **config_overrides))
            loaded = dist_checkpointing.load(model.sharded_state_dict(), f"{directory}/{writer}")
            model.load_state_dict(loaded, strict=True)
            want = {k: v for part in gathered for k, v in part[writer].items()}
            got = _expert_state(model)
            assert got.keys() == want.keys()
            for key in want:
                assert torch.equal(got[key], want[key]), f"{writer} -> {reader}: {key}"
        assert parallel_state.get_expert_model_parallel_world_size() == 1
    return True


def test_dist_checkpoint_across_expert_parallel_sizes(tmp_path):
    run_distributed(_ep_checkpoint_worker, 2, str(tmp_path))
