"""The recipe Megatron users run on Hopper, on the CPU: CUDA graph settings accepted at
expert-parallel size 1 (the whole MoE layer included) and refused by name at EP > 1; the
shared-expert overlap numerically the sequential order; the preprocessing graph's hand-over
(TE's moe_preprocess scope) as Megatron's transformer layer replays it. Capture itself and the
host-synchronization check run on the GPU (tests/gpu/test_megatron_recipe_gpu.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moe_testing import run_distributed
from megatron_testing import build_moe_layer, cpu_megatron, megatron_on_cpu, moe_config, seed_everything  # noqa: F401
from moeblaze_megatron.config import MoEBlazeConfig, set_moeblaze_config
from moeblaze_megatron.megatron_plugin import check_moeblaze_config

SCOPES = [["moe"], [], ["attn", "moe_router", "moe_preprocess"], ["attn", "moe_router"], "full"]


@pytest.mark.usefixtures("cpu_megatron")
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
@pytest.mark.parametrize("modules", SCOPES)
def test_every_capture_scope_accepted_at_ep1(impl, modules):
    config = moe_config("moeblaze", cuda_graph_impl=impl, cuda_graph_modules=modules)
    check_moeblaze_config(config)
    assert type(config.cuda_graph_modules) is list  # Megatron's own type again after its checks
    assert ("moe" in [m.name for m in config.cuda_graph_modules]) == (modules == ["moe"])


@pytest.mark.usefixtures("cpu_megatron")
def test_full_iteration_accepted_at_ep1_and_stock_check_kept():
    check_moeblaze_config(moe_config("moeblaze", cuda_graph_impl="full_iteration", cuda_graph_modules=[]))
    # Megatron's drop-and-pad rule is lifted for MoEBlaze layers only.
    with pytest.raises(AssertionError, match="drop-padding"):
        moe_config("alltoall", cuda_graph_impl="local", cuda_graph_modules=["moe"])
    with pytest.raises(ValueError, match="only works with alltoall or flex"):
        moe_config("allgather", moe_shared_expert_intermediate_size=16, moe_shared_expert_overlap=True)


@pytest.mark.usefixtures("cpu_megatron")
@pytest.mark.parametrize("impl,modules,refused", [
    ("local", ["moe"], True), ("transformer_engine", [], True), ("full_iteration", [], True),
    ("transformer_engine", ["attn", "moe_router", "moe_preprocess"], True),
    ("transformer_engine", ["attn", "moe_router"], False), ("local", ["attn"], False),
])
def test_capture_of_the_exchange_refused_at_ep_above_1(impl, modules, refused):
    config = moe_config("moeblaze", cuda_graph_impl=impl, cuda_graph_modules=modules, expert_model_parallel_size=2)
    if not refused:
        check_moeblaze_config(config)
        return
    with pytest.raises(ValueError, match="CUDA graphs over the MoE dispatch at expert-parallel size 2") as error:
        check_moeblaze_config(config)
    assert "capture only attn and moe_router" in str(error.value)


@pytest.mark.usefixtures("cpu_megatron")
def test_capture_rules_megatron_no_longer_checks_are_ours():
    with pytest.raises(ValueError, match="both moe and moe_router"):
        check_moeblaze_config(moe_config("moeblaze", cuda_graph_impl="local", cuda_graph_modules=["moe", "moe_router"]))
    with pytest.raises(ValueError, match="MoE-layer recompute"):
        check_moeblaze_config(moe_config("moeblaze", cuda_graph_impl="local", cuda_graph_modules=["moe"],
                                         recompute_granularity="selective", recompute_modules=["moe"]))
    # Recompute of the experts' fc1 inside the op is not Megatron's recompute: it is captured too.
    config = moe_config("moeblaze", cuda_graph_impl="local", cuda_graph_modules=[])
    check_moeblaze_config(set_moeblaze_config(config, MoEBlazeConfig(recompute="fc1")))


def _pair(**overrides):
    """The same MoE layer with and without the shared-expert overlap, one set of weights."""
    layers = {}
    for overlap in (False, True):
        config = moe_config("moeblaze", moe_shared_expert_intermediate_size=16, moe_shared_expert_overlap=overlap,
                            **overrides)
        seed_everything(3)
        layers[overlap] = build_moe_layer(config)
    layers[True].load_state_dict(layers[False].state_dict())
    return layers


def _step(layer, x, upstream):
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    (out * upstream).sum().backward()
    return out.detach(), x.grad, {k: p.grad for k, p in layer.named_parameters()}


def _assert_overlap_is_sequential(layers, x, upstream, tag):
    sequential, overlapped = _step(layers[False], x, upstream), _step(layers[True], x, upstream)
    # The output adds the same two terms in the same order; so does every weight gradient.
    assert torch.equal(sequential[0], overlapped[0]), f"{tag}: output"
    for name, grad in sequential[2].items():
        assert torch.equal(grad, overlapped[2][name]), f"{tag}: {name} gradient"
    # The input gradient sums the router's, the shared expert's and the routed experts' parts in
    # an order autograd picks (Megatron documents the same for its overlap): equal to rounding.
    torch.testing.assert_close(sequential[1], overlapped[1], rtol=1e-6, atol=1e-7, msg=f"{tag}: input gradient")


@pytest.mark.usefixtures("cpu_megatron")
@pytest.mark.parametrize("overrides", [
    {}, dict(moe_shared_expert_gate=True), dict(recompute_granularity="selective", recompute_modules=["moe"]),
    dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_expert_capacity_factor=0.5, moe_aux_loss_coeff=0.01),
])
def test_shared_expert_overlap_equals_sequential_ep1(overrides):
    layers = _pair(**overrides)
    assert layers[True].token_dispatcher.shared_experts is layers[True].shared_experts
    assert layers[False].token_dispatcher.shared_experts is None
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(10, 2, 32, generator=generator)
    _assert_overlap_is_sequential(layers, x, torch.randn(10, 2, 32, generator=generator), str(overrides))
    # A second step: the shared expert's overlap state machine went back to its start.
    _assert_overlap_is_sequential(layers, x * 0.5, torch.randn(10, 2, 32, generator=generator), "second step")


def _overlap_ep_worker(rank, world_size, port):
    with megatron_on_cpu(rank, world_size, port, expert_model_parallel_size=world_size):
        for options in (MoEBlazeConfig(), MoEBlazeConfig(ep_mode="ring", ring_mode="expert", recompute="fc1"),
                        MoEBlazeConfig(ep_mode="ring", ring_mode="token", recompute="fc1")):
            layers = {}
            for overlap in (False, True):
                config = moe_config("moeblaze", moe_shared_expert_intermediate_size=16, num_moe_experts=4,
                                    moe_shared_expert_overlap=overlap, expert_model_parallel_size=world_size)
                set_moeblaze_config(config, options)
                seed_everything(5)
                layers[overlap] = build_moe_layer(config)
            layers[True].load_state_dict(copy.deepcopy(layers[False].state_dict()))
            generator = torch.Generator().manual_seed(20 + rank)
            x = torch.randn(6 + rank, 2, 32, generator=generator)
            _assert_overlap_is_sequential(layers, x, torch.randn(6 + rank, 2, 32, generator=generator),
                                          f"rank {rank} {options.ep_mode}/{options.ring_mode}")
            dist.barrier()
    return True


def test_shared_expert_overlap_equals_sequential_ep2():
    """Beside the exchange (alltoall) and beside the ring, at EP = 2 on gloo."""
    assert all(run_distributed(_overlap_ep_worker, 2))


@pytest.mark.usefixtures("cpu_megatron")
def test_preprocess_graph_hand_over_replays_eager():
    """TE's moe_preprocess scope: in capture the layer returns after dispatch_preprocess with
    the dispatcher's cudagraph_attrs as extra outputs; in replay Megatron's transformer layer puts
    them back and resumes the layer from the dispatch. The resumed layer gives eager's output."""
    from megatron.core.transformer import cuda_graphs

    config = moe_config("moeblaze", cuda_graph_impl="transformer_engine",
                        cuda_graph_modules=["attn", "moe_router", "moe_preprocess"])
    seed_everything(9)
    layer = build_moe_layer(config)
    x = torch.randn(8, 2, 32)
    want, _ = layer(x)
    cuda_graphs._set_capture_start()
    try:
        outputs = layer(x)
    finally:
        cuda_graphs._set_capture_end()
    dispatcher = layer.token_dispatcher
    assert dispatcher.valid_cudagraph_attrs == ["topk_ids"] and len(outputs) == 3
    hidden, probs, topk_ids = outputs
    dispatcher.topk_ids = None
    # What TransformerLayer._te_cuda_graph_replay does with the graph's outputs.
    dispatcher.topk_ids = topk_ids
    layer.cudagraph_tensor_store.set(hidden_states=hidden, probs=probs)
    got, _ = layer(x * 0)  # the input is not read again: the store holds the graph's outputs
    layer.cudagraph_tensor_store.clear()
    assert torch.equal(got, want)


def test_training_loop_runs_the_recipe_as_megatrons_train_does(monkeypatch):
    """The comparison's training loop: TE's graphs captured once --cuda-graph-warmup-steps steps
    have run (not before, not twice), deleted at the end; --manual-gc turns the collector off and
    runs it every --manual-gc-interval steps; full_iteration wraps the schedule once."""
    import argparse
    import gc

    from megatron.core import full_cuda_graph
    from megatron.core.transformer import cuda_graphs

    from moeblaze_megatron.training.train_loop import TrainingLoopRecipe

    events = []

    class Helper:
        def __init__(self, **kwargs):
            events.append(("helper", kwargs["seq_length"], kwargs["micro_batch_size"]))
            self.done = False

        def capture_finished(self):
            return self.done

        def create_cudagraphs(self):
            events.append("capture")
            self.done = True

        def graphs_created(self):
            return self.done

        def delete_cuda_graphs(self):
            events.append("delete")

    monkeypatch.setattr(cuda_graphs, "TECudaGraphHelper", Helper)
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1))
    args = argparse.Namespace(cuda_graph_impl="transformer_engine", cuda_graph_warmup_steps=2, seq_length=64,
                              micro_batch_size=2, manual_gc=True, manual_gc_interval=3, iteration=0)
    was_enabled = gc.isenabled()
    recipe = TrainingLoopRecipe(args, model=[], config=None, optimizer=None)
    try:
        assert not gc.isenabled() and collected == [1]
        schedule = object()
        assert recipe.schedule(schedule) is schedule
        for iteration in range(6):
            recipe.before_step(iteration)
            events.append(f"step {iteration}")
            recipe.after_step(iteration + 1)
        assert events[:4] == [("helper", 64, 2), "step 0", "step 1", "capture"] and events.count("capture") == 1
        assert len(collected) == 1 + 2  # at start, after steps 3 and 6
    finally:
        recipe.close()
        if was_enabled:
            gc.enable()
    assert events[-1] == "delete" and gc.isenabled() == was_enabled

    wrapped = []
    monkeypatch.setattr(full_cuda_graph, "FullCudaGraphWrapper",
                        lambda func, cuda_graph_warmup_steps: wrapped.append(cuda_graph_warmup_steps)
                        or ("graph", func))
    full = TrainingLoopRecipe(argparse.Namespace(cuda_graph_impl="full_iteration", cuda_graph_warmup_steps=1,
                                                 manual_gc=False, iteration=0), [], None, None)
    assert full.schedule("schedule") == ("graph", "schedule") and full.schedule("schedule") == ("graph", "schedule")
    assert wrapped == [1]
    with pytest.raises(ValueError, match="--manual-gc-interval must be >= 0"):
        TrainingLoopRecipe(argparse.Namespace(cuda_graph_impl="none", manual_gc=True, manual_gc_interval=-1,
                                              iteration=0), [], None, None)
