"""The override under torchtitan's torch.compile (``--compile.enable``: each transformer block
compiled with fullgraph=True, then the loss): the MoE layer compiled whole meets the float64
oracle as the eager override does and gives its bits under aot_eager, on one rank and at expert
parallelism 2 and 4 (gloo: the exchange, both rings, the per-layer choice); a model trained
through torchtitan's own apply_compile (inductor) trains the same steps as eager."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_testing import TRITON_INTERPRETED, run_distributed
from titan_testing import (
    REL_TOL,
    bf16_bar,
    expert_parallel_dims,
    global_state,
    layer_inputs,
    make_moe_config,
    moe_oracle64,
    oracle_for_rank,
    rel_error,
    run_moe,
    titan_world,
    with_override,
)

SEED = 5
CPU = torch.device("cpu")


@pytest.mark.parametrize("case", ["softmax_top2", "sigmoid_groups_shared", "topk_all"])
def test_compiled_layer_gives_the_eager_bits_and_meets_the_oracle(case):
    state = global_state(case, SEED)
    x, grad_y = layer_inputs(0, SEED)
    cfg = with_override(make_moe_config(case), backend="reference")
    eager = run_moe(cfg, state, x, grad_y)
    compiled = run_moe(cfg, state, x, grad_y, compile_backend="aot_eager")
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
    compiled = run_moe(cfg, state, x, grad_y, compile_backend="inductor")
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


# Per EP size, (SPMD backend, case, compile backend): every rank busy (top-k = E), a shared expert
# with grouped routing, and three of four ranks receiving nothing ("skewed"); inductor once.
_EP_RUNS = {
    2: [("spmd_types", "softmax_top2", "aot_eager"), ("partial_dtensor", "sigmoid_groups_shared", "aot_eager"),
        ("spmd_types", "topk_all", "inductor")],
    4: [("spmd_types", "skewed", "aot_eager")],
}


# The rings run per entry of _EP_RUNS (by index).
_RINGS = [("expert",), ("token",), ("auto",)]


def _ep_compile_worker(rank, world_size, port):
    failures = []
    with titan_world(rank, world_size, port):
        for index, (spmd_backend, case, compile_backend) in enumerate(_EP_RUNS[world_size]):
            parallel_dims, context = expert_parallel_dims(world_size, spmd_backend)
            state = global_state(case, seed=index)
            x, grad_y = layer_inputs(rank, index)
            cfg = make_moe_config(case, expert_parallel=True)
            tag = f"{spmd_backend}/{case}/{compile_backend}"
            variants = [("bf16", dict(backend="reference")), ("fp32", dict(backend="reference", expert_dtype="input"))]
            # Both rings (the ring's own "auto" choice of ring too), and the per-layer choice
            # (ep_mode="auto", made at trace time from the rank's token count), in float32.
            variants += [(f"ring_{ring}_fp32", dict(backend="reference", expert_dtype="input", ep_mode="ring",
                                                   ring_mode=ring, recompute="fc1")) for ring in _RINGS[index]]
            variants.append(("auto_fp32", dict(backend="reference", expert_dtype="input", ep_mode="auto",
                                                recompute="fc1")))
            if index == 0 and TRITON_INTERPRETED:
                # The kernels on the received rows, their expert-order buffers cut to the slots.
                variants.append(("triton_fp32", dict(backend="triton", expert_dtype="input")))
            for dtype_label, options in variants:
                eager = run_moe(with_override(cfg, **options), state, x, grad_y, parallel_dims, context)
                compiled = run_moe(with_override(cfg, **options), state, x, grad_y, parallel_dims, context,
                                   compile_backend=compile_backend)
                oracle = oracle_for_rank(state, case, x, eager["ids"], grad_y, rank, world_size)
                for name, want in oracle.items():
                    if compile_backend == "aot_eager" and not torch.equal(compiled[name], eager[name]):
                        failures.append(f"{tag}/{dtype_label}/{name}: compiled differs from eager")
                    # Inductor fuses the router's float32 ops in its own order: the eager run's
                    # error against the oracle, or the float32 bar, whichever is larger.
                    bar = max(REL_TOL[torch.float32], 2 * rel_error(eager[name], want))
                    err = rel_error(compiled[name], want)
                    if not err <= bar:
                        failures.append(f"{tag}/{dtype_label}/{name}: relative error {err:.3e} > {bar:.3e}")
        failures += _choices_checked(rank, world_size)
    return failures


def _choices_checked(rank, world_size):
    """``check_same_choice``: ranks that chose alike pass; ranks that did not all raise, naming
    the fix (none is left waiting in a collective)."""
    from moeblaze_megatron.parallel.compiled_exchange import check_same_choice

    group = dist.group.WORLD
    check_same_choice(1, 10, group, CPU)
    try:
        check_same_choice(rank % 2, 10 + rank, group, CPU)
    except RuntimeError as error:
        if "name the mode" not in str(error) or "[10, 11" not in str(error):
            return [f"check_same_choice raised without the token counts or the fix: {error}"]
        return []
    return ["check_same_choice let ranks with different choices through"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_under_compile_matches_eager_and_the_oracle(world_size):
    """The token exchange and the rings as custom ops (``parallel/compiled_exchange.py``,
    ``compiled_ring.py``), and ep_mode="auto" choosing between them, at EP = 2 and 4, the layer
    compiled whole with fullgraph=True as torchtitan compiles a block: aot_eager gives eager's
    bits; every run meets the float64 oracle; ranks that chose differently all raise."""
    reports = run_distributed(_ep_compile_worker, world_size, timeout=500)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(reports) for f in fs]
    assert not failures, "\n".join(failures)
