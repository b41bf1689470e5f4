"""The override under torchtitan's torch.compile (``--compile.enable``: each transformer block
compiled with fullgraph=True, then the loss): the MoE layer compiled whole meets the float64
oracle as the eager override does and gives its bits under aot_eager; a model trained through
torchtitan's own apply_compile (inductor) trains the same steps as eager; expert parallelism under
compile is refused by name."""

from __future__ import annotations

import types

import pytest
import torch

from titan_testing import (
    REL_TOL,
    bf16_bar,
    global_state,
    layer_inputs,
    make_moe_config,
    moe_oracle64,
    rel_error,
    run_moe,
    with_override,
)

SEED = 5
CPU = torch.device("cpu")


def _run_compiled(cfg, state, x, grad_y, backend):
    """run_moe's fields (no ids) with the whole MoE layer compiled, fullgraph."""
    torch._dynamo.reset()
    moe = cfg.build()
    moe.load_state_dict(state)
    moe.compile(backend=backend, fullgraph=True)
    x = x.clone().requires_grad_()
    y = moe(x)
    y.backward(grad_y)
    out = {"y": y.detach(), "dx": x.grad}
    for name, p in moe.named_parameters():
        out[name] = p.grad if p.grad is not None else torch.zeros_like(p)
    return out


@pytest.mark.parametrize("case", ["softmax_top2", "sigmoid_groups_shared", "topk_all"])
def test_compiled_layer_gives_the_eager_bits_and_meets_the_oracle(case):
    state = global_state(case, SEED)
    x, grad_y = layer_inputs(0, SEED)
    cfg = with_override(make_moe_config(case), backend="reference")
    eager = run_moe(cfg, state, x, grad_y)
    compiled = _run_compiled(cfg, state, x, grad_y, "aot_eager")
    oracle = moe_oracle64(state, case, x, eager["ids"], grad_y)
    stock = run_moe(make_moe_config(case), state, x, grad_y)
    for name, want in oracle.items():
        assert torch.equal(compiled[name], eager[name]), name
        assert rel_error(compiled[name], want) <= bf16_bar(rel_error(stock[name], want)), name


def test_inductor_compiled_layer_meets_the_oracle():
    case = "softmax_top2"
    state = global_state(case, SEED)
    x, grad_y = layer_inputs(0, SEED)
    cfg = with_override(make_moe_config(case), backend="reference", expert_dtype="input")
    eager = run_moe(cfg, state, x, grad_y)
    compiled = _run_compiled(cfg, state, x, grad_y, "inductor")
    oracle = moe_oracle64(state, case, x, eager["ids"], grad_y)
    for name, want in oracle.items():
        # Inductor fuses the router's float32 ops in its own order: the float32 bar.
        assert rel_error(compiled[name], want) <= REL_TOL[torch.float32], name


def _losses(compile_backend, activation_checkpoint, steps=3):
    from moeblaze_megatron.training.titan_loop import TitanRun, TitanTrainer

    torch._dynamo.reset()
    trainer = TitanTrainer(TitanRun(override={"backend": "reference"}, steps=steps, seed=3, loss="plain",
                                    compile=compile_backend, activation_checkpoint=activation_checkpoint), CPU)
    blocks = list(trainer.model.layers.values())
    losses = [trainer.train_step().loss for _ in range(steps)]
    trainer.close()
    return losses, blocks


@pytest.mark.parametrize("activation_checkpoint", ["none", "selective"])
def test_torchtitans_compile_trains_the_override_as_eager(activation_checkpoint):
    """Selective AC (the example's default) recomputes the custom op in backward, as it does the
    autograd Function in eager."""
    from moeblaze_megatron.training.titan_loop import single_process

    with single_process(CPU):
        eager, _ = _losses("off", activation_checkpoint)
        compiled, blocks = _losses("inductor", activation_checkpoint)
    # torchtitan's apply_compile wrapped every block (fullgraph: no graph break got through).
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    # Three optimizer steps in bfloat16 (FSDP's mixed precision) with inductor's own fusion
    # order: a few bf16 ulps of the loss apart, never a divergence.
    for a, b in zip(compiled, eager):
        assert abs(a - b) <= 16 * torch.finfo(torch.bfloat16).eps * abs(b), (compiled, eager)


def test_expert_parallel_under_compile_is_refused():
    from moeblaze_megatron.torchtitan import MoEBlazeRoutedExperts

    routed = with_override(make_moe_config("softmax_top2"), backend="reference").build().routed_experts
    assert isinstance(routed, MoEBlazeRoutedExperts)
    routed.ep_group = types.SimpleNamespace()  # as parallelize() sets it at EP > 1
    with pytest.raises(NotImplementedError, match="torch.compile of the model with expert parallelism > 1"):
        routed._run_compiled(*(torch.empty(0),) * 6)
