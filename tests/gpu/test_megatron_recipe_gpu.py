"""The Megatron recipe on one GPU (skipped without CUDA or megatron-core): the MoEBlaze MoE layer
makes no host synchronization (``torch.cuda.set_sync_debug_mode("error")`` around eager steps);
``torch.cuda.graph`` captures its forward and backward whole and the replay gives eager's bits;
Megatron's own local CUDA graphs over the whole layer, the MoE layer alone and the router scopes
train a GPTModel to eager's losses and gradients; the shared-expert overlap runs the shared
expert beside the routed experts (two streams at once in the profiler's timeline).

Each test writes what it measured to $OUT/recipe_gpu.json (or benchmarks/results/latest) when
MOEBLAZE_RECIPE_JSON names a file, so a device call brings the figures back."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from benchlib.timing import cuda_time

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
megatron = pytest.importorskip("megatron.core")

REPORT = os.environ.get("MOEBLAZE_RECIPE_JSON")


def _record(key, value):
    if not REPORT:
        return
    data = json.load(open(REPORT)) if os.path.exists(REPORT) else {}
    data[key] = value
    json.dump(data, open(REPORT, "w"), indent=1)


@pytest.fixture(scope="module")
def gpu_megatron():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import moeblaze_megatron
    from moe_testing import free_port

    moeblaze_megatron.install()
    torch.cuda.set_device(0)
    own = not torch.distributed.is_initialized()
    if own:
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                             world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(123, use_cudagraphable_rng=True)
    yield
    parallel_state.destroy_model_parallel()
    if own:
        torch.distributed.destroy_process_group()


def _config(dispatcher="moeblaze", **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=2, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=2048, moe_ffn_hidden_size=512,
                  num_moe_experts=32, moe_router_topk=4, moe_token_dispatcher_type=dispatcher, add_bias_linear=False,
                  gated_linear_unit=True, activation_func=torch.nn.functional.silu, hidden_dropout=0.0,
                  attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16, moe_router_dtype="fp32",
                  init_method_std=0.02, moe_aux_loss_coeff=0.0, gradient_accumulation_fusion=False,
                  persist_layer_norm=False, masked_softmax_fusion=False, bias_swiglu_fusion=False,
                  apply_rope_fusion=False)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _moe_layer(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    torch.manual_seed(5)
    return spec.submodules.mlp(config=config).cuda().to(torch.bfloat16)


def _layer_step(layer, x, upstream):
    out, _ = layer(x)
    (out * upstream).sum().backward()
    return out


def _grads(module):
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


SHARED = dict(moe_shared_expert_intermediate_size=1024)


@pytest.mark.parametrize("overrides", [{}, dict(moe_aux_loss_coeff=0.01), SHARED,
                                       dict(SHARED, moe_shared_expert_overlap=True)],
                         ids=["plain", "aux_loss", "shared", "shared_overlap"])
def test_moe_layer_makes_no_host_synchronization(gpu_megatron, overrides):
    layer = _moe_layer(_config(**overrides))
    x = torch.randn(4096, 2, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn_like(x)
    for _ in range(2):  # kernels compiled, caches filled
        _layer_step(layer, x, upstream)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            _layer_step(layer, x, upstream)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    _record(f"no_sync/{'+'.join(overrides) or 'plain'}", True)


def test_torch_cuda_graph_replays_eager_bitwise(gpu_megatron):
    """The whole MoE layer, router to combine, forward and backward in one graph."""
    layer = _moe_layer(_config(**SHARED))
    x = torch.randn(4096, 2, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            _layer_step(layer, x, upstream)
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    eager_out = _layer_step(layer, x, upstream).detach().clone()
    eager_dx, eager_grads = x.grad.clone(), _grads(layer)

    layer.zero_grad(set_to_none=True)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = _layer_step(layer, x, upstream)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, eager_out)
    assert torch.equal(x.grad, eager_dx)
    got = _grads(layer)
    assert set(got) == set(eager_grads)
    for name, grad in eager_grads.items():
        assert torch.equal(got[name], grad), name

    # Timing: eager step against replay, same layer (median of 20 between CUDA events).
    def eager():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        _layer_step(layer, x, upstream)

    eager_ms, replay_ms = cuda_time(eager, 3, 20)[0], cuda_time(graph.replay, 3, 20)[0]
    _record("torch_graph_layer", dict(eager_ms=eager_ms, replay_ms=replay_ms, shape="T=8192 d=1024 h=512 E=32 K=4"))


def _gpt(config, seq):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    torch.manual_seed(7)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=1024, max_sequence_length=seq,
                    position_embedding_type="rope").cuda().to(torch.bfloat16)


@pytest.mark.parametrize("modules", [[], ["moe"], ["attn", "moe_router", "moe_preprocess"]],
                         ids=["whole_layer", "moe", "attn_router_preprocess"])
def test_megatron_local_cuda_graphs_train_like_eager(gpu_megatron, modules):
    """Megatron's local CUDA graphs (its CudaGraphManager; create_cudagraphs() after each step, as
    its schedule calls it): warm-up steps, capture, then replays, against the same model eager."""
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord, create_cudagraphs, delete_cuda_graphs

    seq, batch, steps = 1024, 2, 6
    eager = _gpt(_config(**SHARED), seq)
    graphed = _gpt(_config(cuda_graph_impl="local", cuda_graph_modules=modules, cuda_graph_warmup_steps=1, **SHARED),
                   seq)
    graphed.load_state_dict(eager.state_dict())
    generator = torch.Generator(device="cuda").manual_seed(3)
    tokens = torch.randint(0, 1024, (batch, seq), device="cuda", generator=generator)
    positions = torch.arange(seq, device="cuda")[None].expand(batch, seq)
    losses = {"eager": [], "graphed": []}
    try:
        for step in range(steps):
            for label, model in (("eager", eager), ("graphed", graphed)):
                model.zero_grad(set_to_none=True)
                loss = model(tokens, positions, None, labels=tokens).float().mean()
                loss.backward()
                losses[label].append(loss.item())
                if label == "graphed":
                    create_cudagraphs()
            want, got = _grads(eager), _grads(graphed)
            for name, grad in want.items():
                assert torch.equal(got[name], grad), f"step {step}: {name}"
        assert losses["eager"] == losses["graphed"], losses
        managers = sum(getattr(m, "cudagraph_manager", None) is not None for m in graphed.modules())
        created = bool(_CudagraphGlobalRecord.cudagraph_created)
    finally:
        delete_cuda_graphs()
    _record(f"local_graphs/{'+'.join(modules) or 'whole_layer'}", dict(losses=losses, managers=managers,
                                                                         graphs_created=created))
    if not modules:
        assert managers == 2 and created, (managers, created)


def test_shared_expert_overlap_runs_beside_the_routed_experts(gpu_megatron):
    """The profiler's timeline: some kernel of the shared expert's stream runs while a kernel of
    the layer's stream runs; the step times with and without the overlap."""
    from torch.profiler import ProfilerActivity, profile

    layers = {overlap: _moe_layer(_config(moe_shared_expert_intermediate_size=4096, moe_shared_expert_overlap=overlap))
              for overlap in (False, True)}
    layers[True].load_state_dict(layers[False].state_dict())
    x = torch.randn(4096, 2, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn_like(x)
    times = {}
    for overlap, layer in layers.items():
        times["overlap" if overlap else "sequential"] = cuda_time(lambda: _layer_step(layer, x, upstream), 3, 20)[0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _layer_step(layers[True], x, upstream)
        torch.cuda.synchronize()
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(trace)
    by_stream = {}
    for event in json.load(open(trace))["traceEvents"]:
        if event.get("cat") == "kernel" and event.get("dur", 0) > 0:
            by_stream.setdefault(event["args"].get("stream"), []).append((event["ts"], event["ts"] + event["dur"]))
    streams = sorted(by_stream, key=str)
    overlap_us = 0.0
    for i, a in enumerate(streams):
        for b in streams[i + 1:]:
            for s0, e0 in by_stream[a]:
                for s1, e1 in by_stream[b]:
                    overlap_us += max(0.0, min(e0, e1) - max(s0, s1))
    _record("shared_overlap", dict(step_ms=times, kernels_per_stream={str(k): len(v) for k, v in by_stream.items()},
                                   concurrent_kernel_us=overlap_us))
    assert len(streams) >= 2 and overlap_us > 0, ({str(k): len(v) for k, v in by_stream.items()}, overlap_us)
