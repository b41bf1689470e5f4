"""The override's MoE layer at EP = 1 against a float64 oracle of torchtitan's MoE layer, next to
torchtitan's stock layer with the same weights: output, input, router and expert (and shared
expert) gradients, across router options and awkward routing (top-1, top-k = E, every token on
two experts, node-limited groups, shared experts, 74 tokens: off every tile); bitwise the same
on a second run; what the routed experts keep for backward; and the refusals.

Stock torchtitan computes its experts in bfloat16 (GroupedExperts casts to it): the override's
default does too and is held to the bfloat16 bar (or twice stock's error where the router's
softmax Jacobian amplifies rounding); with ``expert_dtype="input"`` it computes in float32 and is
held to the float32 bar.
"""

from __future__ import annotations

import types

import pytest
import torch

from moe_testing import TRITON_INTERPRETED
from moeblaze_megatron.training.audit import saved_bytes_for_backward
from titan_testing import (
    BATCH,
    CASES,
    DIM,
    HIDDEN,
    NUM_EXPERTS,
    REL_TOL,
    SEQ,
    bf16_bar,
    global_state,
    layer_inputs,
    make_moe_config,
    moe_oracle64,
    rel_error,
    run_moe,
    with_override,
)

SEED = 3


def _compare(case, got, oracle, bar, label):
    """Failures of ``got`` against the oracle: every field above its bar (``bar(field)``)."""
    failures = []
    for name, want in oracle.items():
        err = rel_error(got[name], want)
        if not err <= bar(name):
            failures.append(f"{case}/{label}/{name}: relative error {err:.3e} > {bar(name):.3e}")
    return failures


def _stock_and_oracle(case):
    """The case's inputs, stock torchtitan's run, the oracle and stock's error on each field."""
    state = global_state(case, SEED)
    x, grad_y = layer_inputs(0, SEED)
    cfg = make_moe_config(case)
    stock = run_moe(cfg, state, x, grad_y)
    oracle = moe_oracle64(state, case, x, stock["ids"], grad_y)
    return cfg, state, x, grad_y, stock, oracle, {name: rel_error(stock[name], w) for name, w in oracle.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_the_oracle_as_stock_does(case):
    cfg, state, x, grad_y, stock, oracle, stock_err = _stock_and_oracle(case)
    # The oracle is torchtitan's layer: stock meets it at its own precision on the output.
    assert stock_err["y"] <= REL_TOL[torch.bfloat16], stock_err
    failures = []
    for label, options, bar in (
        ("bf16", dict(backend="reference"), lambda n: bf16_bar(stock_err[n])),
        ("fp32", dict(backend="reference", expert_dtype="input"), lambda n: REL_TOL[torch.float32]),
        ("fp32_fc1", dict(backend="reference", expert_dtype="input", recompute="fc1"),
         lambda n: REL_TOL[torch.float32]),
    ):
        got = run_moe(with_override(cfg, **options), state, x, grad_y)
        assert torch.equal(got["ids"], stock["ids"]), "the router chose other experts"
        failures += _compare(case, got, oracle, bar, label)
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not (TRITON_INTERPRETED or torch.cuda.is_available()), reason="needs the Triton kernels")
@pytest.mark.parametrize("case", ["softmax_top2", "skewed"])
def test_fused_kernels_match_the_oracle(case):
    """The fused Triton kernels (interpreted on the CPU) behind the override, bf16 and fp32."""
    cfg, state, x, grad_y, _, oracle, stock_err = _stock_and_oracle(case)
    failures = []
    for label, options, bar in (
        ("triton_bf16", dict(backend="triton"), lambda n: bf16_bar(stock_err[n])),
        ("triton_fp32", dict(backend="triton", expert_dtype="input"), lambda n: REL_TOL[torch.float32]),
    ):
        got = run_moe(with_override(cfg, **options), state, x, grad_y)
        failures += _compare(case, got, oracle, bar, label)
        again = run_moe(with_override(cfg, **options), state, x, grad_y)
        failures += [f"{case}/{label}/{n}: a second run differs" for n in oracle if not torch.equal(got[n], again[n])]
    assert not failures, "\n".join(failures)


def test_bitwise_deterministic():
    state = global_state("sigmoid_groups_shared", SEED)
    x, grad_y = layer_inputs(0, SEED)
    cfg = with_override(make_moe_config("sigmoid_groups_shared"), backend="reference")
    first, second = (run_moe(cfg, state, x, grad_y) for _ in range(2))
    for name, value in first.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, second[name]), name


def test_weights_and_keys_are_torchtitans():
    """The override keeps torchtitan's GroupedExperts module: same parameters, buffers, keys and
    shapes; a stock state dict loads strictly and comes back unchanged."""
    cfg = make_moe_config("softmax_top2")
    stock, ours = cfg.build(), with_override(cfg).build()
    assert type(ours.routed_experts.inner_experts) is type(stock.routed_experts.inner_experts)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in stock.state_dict().items()}
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in stock.named_parameters()]
    state = global_state("softmax_top2", SEED)
    ours.load_state_dict(state, strict=True)
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in state.items())


def test_routed_experts_keep_the_floor_for_backward():
    """What the routed experts save for backward (the parameters excluded): the bf16 input and
    the pre-activations (2Td + 4TKh bytes) plus O(T*K) indices and probabilities; with
    recompute="fc1" only the input. Stock keeps the expert-sorted copy of the tokens and more."""
    T, K = BATCH * SEQ, CASES["softmax_top2"]["top_k"]
    state = global_state("softmax_top2", SEED)
    x, _ = layer_inputs(0, SEED)
    saved = {}
    for label, cfg in (("stock", make_moe_config("softmax_top2")),
                       ("activation", with_override(make_moe_config("softmax_top2"), backend="reference")),
                       ("fc1", with_override(make_moe_config("softmax_top2"), backend="reference", recompute="fc1"))):
        moe = cfg.build()
        moe.load_state_dict(state)
        with torch.no_grad():
            scores, ids, _ = moe.router(x, moe.expert_bias_E)
        xs = x.clone().requires_grad_()
        scores = scores.clone().requires_grad_()
        counts = torch.bincount(ids.reshape(-1), minlength=NUM_EXPERTS)
        _, saved[label] = saved_bytes_for_backward(lambda: moe.routed_experts(xs, scores, ids, counts),
                                                   list(moe.parameters()))
    per_slot = 16 * T * K + 4 * (NUM_EXPERTS + 1)
    floor = 2 * T * DIM + 4 * T * K * HIDDEN
    assert saved["activation"] <= 1.05 * floor + per_slot, saved
    assert saved["fc1"] <= 2 * T * DIM + per_slot, saved
    # Stock keeps at least the (T*K, D) bf16 copy of the tokens and the fp32 expert outputs.
    assert saved["stock"] >= 2 * T * K * DIM + 4 * T * K * DIM, saved


def test_refusals_name_what_is_not_supported():
    from torchtitan.models.common.token_dispatcher import TorchAOTokenDispatcher
    from torchtitan.overrides.fused_swiglu import fused_grouped_experts

    from moeblaze_megatron.torchtitan import MoEBlazeRoutedExperts, moeblaze_experts

    cfg = make_moe_config("softmax_top2").routed_experts
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['recompte'\]"):
        moeblaze_experts(cfg, recompte="fc1")
    with pytest.raises(ValueError, match=r"recompute must be one of \('activation', 'fc1'\), got 'all'"):
        moeblaze_experts(cfg, recompute="all")
    with pytest.raises(ValueError, match=r"expert_dtype must be one of \('bfloat16', 'input'\)"):
        moeblaze_experts(cfg, expert_dtype="float16")
    fused = make_moe_config("softmax_top2").routed_experts
    fused.inner_experts = fused_grouped_experts(fused.inner_experts)
    with pytest.raises(ValueError, match="inner_experts is FusedGroupedExperts.Config"):
        moeblaze_experts(fused)
    padded = make_moe_config("softmax_top2").routed_experts
    padded.token_dispatcher = TorchAOTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=2, pad_multiple=16)
    with pytest.raises(ValueError, match="token_dispatcher is TorchAOTokenDispatcher.Config"):
        moeblaze_experts(padded)
    experts = moeblaze_experts(cfg).build()
    assert isinstance(experts, MoEBlazeRoutedExperts)
    with pytest.raises(ValueError, match="tensor_parallel_degree=2 without expert parallelism"):
        experts.parallelize(types.SimpleNamespace(tp=2, ep=1))


def test_fused_kernels_take_w1_and_w3_where_they_are(monkeypatch):
    """The kernels read torchtitan's w1 and w3 themselves (a (gate, up) pair): no stacked copy of
    the weights in either pass, and the gradients come back as two tensors of the parameters'
    layout (nothing for autograd to copy into place)."""
    from moeblaze_megatron import fused

    seen = []
    for name, fc1_at in (("fused_forward", 2), ("fused_backward", 3)):
        original = getattr(fused, name)

        def spy(*args, _original=original, _at=fc1_at, **kwargs):
            seen.append(args[_at])
            return _original(*args, **kwargs)

        monkeypatch.setattr(fused, name, spy)
    state = global_state("softmax_top2", SEED)
    x, grad_y = layer_inputs(0, SEED)
    moe = with_override(make_moe_config("softmax_top2"), backend="triton", expert_dtype="input").build()
    moe.load_state_dict(state)
    moe(x.clone().requires_grad_()).backward(grad_y)
    experts = moe.routed_experts.inner_experts
    w1, w3 = experts.w1_EFD, experts.w3_EFD
    assert len(seen) == 2 and all(isinstance(fc1, tuple) and fc1[0] is w1 and fc1[1] is w3 for fc1 in seen)
    assert w1.grad.is_contiguous() and w3.grad.is_contiguous() and torch.isfinite(w1.grad).all()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_option_runs_the_experts_in_fp8(fmt):
    """{"fp8": ...}: the routed experts' GEMMs under the blockwise recipe, within FP8's error of
    the float64 oracle (the router and the shared experts stay as they are), not the bf16 bits."""
    cfg, state, x, grad_y, _, oracle, _ = _stock_and_oracle("softmax_top2")
    got = run_moe(with_override(cfg, backend="reference", fp8=fmt), state, x, grad_y)
    bf16 = run_moe(with_override(cfg, backend="reference"), state, x, grad_y)
    tol = {"e4m3": 0.12, "hybrid": 0.2}[fmt]
    failures = _compare("softmax_top2", got, oracle, lambda name: tol, fmt)
    assert not failures, "\n".join(failures)
    assert not torch.equal(got["y"], bf16["y"])
    assert got["module"].routed_experts.options.fp8 == fmt


def test_torchtitans_float8_experts_are_refused_with_the_fp8_option_named():
    from torchtitan.components.quantization.float8 import _get_float8_grouped_experts_cls
    from torchtitan.models.common.moe import GroupedExperts

    from moeblaze_megatron.torchtitan import moeblaze_experts

    cfg = make_moe_config("softmax_top2").routed_experts
    quantized = _get_float8_grouped_experts_cls(GroupedExperts).Config
    cfg.inner_experts = quantized(**{f: getattr(cfg.inner_experts, f) for f in cfg.inner_experts.__slots__
                                     if hasattr(cfg.inner_experts, f)})
    with pytest.raises(ValueError, match=r"inner_experts is Float8GroupedExperts.Config.*\{\"fp8\": \"e4m3\"\}"):
        moeblaze_experts(cfg)
