"""moe_mlp(fp8=...): the blockwise FP8 recipe. The PyTorch reference of the quantized math is the
oracle: the kernels (under the interpreter here) give its bits; both stay within FP8's error of
the float64 dense result; bitwise the same run to run; the same saved-for-backward bytes as the
op in the model's dtype; the weights' quantized copies cached until an optimizer step or an
in-place change; the awkward routings (an expert with no rows, all rows on one expert, top-k = E,
unused slots, widths off the 128 blocks); the errors."""

from __future__ import annotations

import pytest
import torch

from moe_testing import TRITON_INTERPRETED, dense_reference_and_grads, rel_error
from moeblaze_megatron import fp8 as fp8_module
from moeblaze_megatron import moe_mlp
from moeblaze_megatron.config import MoEBlazeConfig, OptionError
from moeblaze_megatron.training.audit import saved_bytes_for_backward

needs_kernels = pytest.mark.skipif(not TRITON_INTERPRETED, reason="the kernels run on CPU under TRITON_INTERPRET=1")
GRADS = ("x", "topk_probs", "fc1", "fc2")
# Norm-relative error of the FP8 layer against the float64 dense one: each GEMM operand carries
# E4M3's rounding (3 mantissa bits: ~2.7% rms per quantization, measured), the SwiGLU product and
# fc2's quantized input add theirs; E5M2 gradients (2 bits) about double the gradients' share.
FP8_TOL = {"e4m3": 0.12, "hybrid": 0.2}


def problem(tokens=40, hidden=160, ffn=136, experts=5, topk=2, activation="swiglu", seed=0, routing="random",
            pair=False):
    g = torch.Generator().manual_seed(seed)
    if routing == "one_expert":
        ids = torch.stack([torch.full((tokens,), 2), torch.full((tokens,), 0)], 1)[:, :topk]
    elif routing == "all_experts":
        ids = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)])
    else:
        # The last expert gets no rows; one token has an unused slot.
        ids = torch.stack([torch.randperm(experts - 1, generator=g)[:topk] for _ in range(tokens)])
        ids[3, -1] = -1
    width = 2 * ffn if activation == "swiglu" else ffn
    fc1 = (torch.randn(experts, width, hidden, generator=g) * 0.08).bfloat16()
    return dict(
        x=torch.randn(tokens, hidden, generator=g).bfloat16().requires_grad_(),
        topk_ids=ids.int(),
        topk_probs=torch.rand(tokens, ids.shape[1], generator=g).requires_grad_(),
        fc1=tuple(w.contiguous().requires_grad_() for w in fc1.chunk(2, dim=1)) if pair else fc1.requires_grad_(),
        fc2=(torch.randn(experts, hidden, ffn, generator=g) * 0.08).bfloat16().requires_grad_(),
        grad_y=torch.randn(tokens, hidden, generator=g).bfloat16(),
        activation=activation,
    )


def run(p, backend, fp8, recompute="activation"):
    """(y, {name: gradient}) for fresh copies of the problem's leaves."""
    fc1 = tuple(w.detach().clone().requires_grad_() for w in p["fc1"]) if isinstance(p["fc1"], tuple) else \
        p["fc1"].detach().clone().requires_grad_()
    leaves = dict(x=p["x"].detach().clone().requires_grad_(), topk_probs=p["topk_probs"].detach().clone().requires_grad_(),
                  fc1=fc1, fc2=p["fc2"].detach().clone().requires_grad_())
    y = moe_mlp(leaves["x"], p["topk_ids"], leaves["topk_probs"], leaves["fc1"], leaves["fc2"], p["activation"],
                recompute=recompute, backend=backend, fp8=fp8)
    y.backward(p["grad_y"])
    grads = {name: (tuple(w.grad for w in t) if isinstance(t, tuple) else t.grad) for name, t in leaves.items()}
    return y.detach(), grads


def _flat(t):
    return torch.cat([w.reshape(-1) for w in t]) if isinstance(t, tuple) else t


CASES = [
    ("swiglu", "e4m3", "activation", False, "random"),
    ("swiglu", "hybrid", "fc1", True, "random"),
    ("silu", "e4m3", "fc1", False, "one_expert"),
    ("gelu", "hybrid", "activation", False, "all_experts"),
]


@pytest.mark.parametrize("activation,fmt,recompute,pair,routing", CASES)
def test_reference_is_within_fp8_error_of_float64(activation, fmt, recompute, pair, routing):
    p = problem(activation=activation, pair=pair, routing=routing, topk=5 if routing == "all_experts" else 2)
    y, grads = run(p, "reference", fmt, recompute)
    oracle = dict(x=p["x"], topk_ids=p["topk_ids"], topk_probs=p["topk_probs"],
                  fc1_weight=torch.cat(p["fc1"], dim=1) if pair else p["fc1"], fc2_weight=p["fc2"])
    want_y, want, scales = dense_reference_and_grads(oracle, activation, p["grad_y"])
    assert y.dtype == torch.bfloat16
    assert rel_error(y, want_y) <= FP8_TOL[fmt], rel_error(y, want_y)
    names = dict(x="x", topk_probs="topk_probs", fc1="fc1_weight", fc2="fc2_weight")
    for name, key in names.items():
        got = torch.cat(grads[name], dim=1) if isinstance(grads[name], tuple) else grads[name]
        leaf = p[name][0] if isinstance(p[name], tuple) else p[name]
        assert got.dtype == leaf.dtype, name
        error = rel_error(got, want[key], scales[key])
        assert error <= FP8_TOL[fmt], (name, error)
    # FP8 is not the bf16 op under another name.
    y16, _ = run(p, "reference", None, recompute)
    assert rel_error(y, y16) > 1e-3


@needs_kernels
@pytest.mark.parametrize("activation,fmt,recompute,pair,routing", CASES)
def test_kernels_give_the_references_bits(activation, fmt, recompute, pair, routing):
    p = problem(activation=activation, pair=pair, routing=routing, topk=5 if routing == "all_experts" else 2)
    y_ref, ref = run(p, "reference", fmt, recompute)
    y, got = run(p, "triton", fmt, recompute)
    assert torch.equal(y, y_ref)
    for name in ("x", "fc1", "fc2"):
        assert torch.equal(_flat(got[name]), _flat(ref[name])), name
    # The router gradient's partial sums run per 128 columns in the kernels, in one sum in the reference.
    assert rel_error(got["topk_probs"], ref["topk_probs"]) <= 1e-6


@needs_kernels
def test_kernels_are_bitwise_deterministic():
    p = problem(seed=4)
    first, second = run(p, "triton", "e4m3"), run(p, "triton", "e4m3")
    assert torch.equal(first[0], second[0])
    for name in GRADS:
        assert torch.equal(_flat(first[1][name]), _flat(second[1][name])), name


@pytest.mark.parametrize("recompute", ["activation", "fc1"])
def test_fp8_keeps_the_bf16_floor_for_backward(recompute):
    p = problem()
    sizes = {}
    for fmt in (None, "e4m3"):
        x = p["x"].detach().clone().requires_grad_()
        _, sizes[fmt] = saved_bytes_for_backward(lambda: moe_mlp(
            x, p["topk_ids"], p["topk_probs"], p["fc1"], p["fc2"], recompute=recompute, backend="reference", fp8=fmt),
            parameters=(p["fc1"], p["fc2"]))
    assert sizes["e4m3"] == sizes[None] > 0, sizes


def test_weight_copies_are_cached_until_the_optimizer_steps():
    p = problem()
    fc1, fc2 = p["fc1"], p["fc2"]
    first = fp8_module.expert_weights(fc1, fc2, 0)
    assert fp8_module.expert_weights(fc1, fc2, 0) is first  # every micro-batch of a step
    optimizer = torch.optim.SGD([fc1, fc2], lr=0.0)
    fc1.grad = torch.zeros_like(fc1)
    fc2.grad = torch.zeros_like(fc2)
    optimizer.step()
    after_step = fp8_module.expert_weights(fc1, fc2, 0)
    assert after_step is not first
    assert torch.equal(after_step.fc2.codes, first.fc2.codes)  # lr 0: the same values, quantized anew
    with torch.no_grad():
        fc2.mul_(2)
    changed = fp8_module.expert_weights(fc1, fc2, 0)
    assert changed is not after_step
    assert torch.equal(changed.fc2.codes, first.fc2.codes)  # a power of two moves the scales only
    assert torch.equal(changed.fc2.inv_scales, 2 * first.fc2.inv_scales)


def test_quantized_weights_are_the_blocks_of_each_half():
    p = problem(hidden=200, ffn=72)
    weights = fp8_module.expert_weights(p["fc1"], p["fc2"], 0)
    gate, up = p["fc1"].detach().chunk(2, dim=1)
    for part, half in zip(weights.fc1, (gate, up)):
        codes, inv = fp8_module.quantize_blocks(half, 0)
        assert torch.equal(part.codes, codes) and torch.equal(part.inv_scales, inv)
        assert part.inv_scales.shape == (5, 1, 2)
    for part, t_part in zip(weights.fc1, weights.fc1_t):
        assert torch.equal(t_part.codes, part.codes.transpose(1, 2))
    back = weights.fc2.dequantized(0)
    assert rel_error(back, p["fc2"].detach().double()) <= 0.04


def test_block_scales_are_powers_of_two_with_the_block_max_in_range():
    amax = torch.tensor([0.0, 1.0, 3.5, 448.0, 449.0, 1e-30, 1e30])
    scale, inv = fp8_module.block_scales(amax, 0)
    assert torch.equal(scale * inv, torch.ones_like(amax))
    assert torch.equal(scale[:5], torch.tensor([1.0, 256.0, 128.0, 1.0, 0.5]))
    assert ((amax * scale) <= 448).all()
    assert ((amax[1:5] * scale[1:5]) > 224).all()  # the largest such power of two


def test_rows_quantize_per_128_columns_and_round_trip():
    x = torch.randn(9, 300) * torch.logspace(-6, 6, 9)[:, None]
    x[2] = 0
    codes, inv = fp8_module.quantize_rows(x, 0)
    assert codes.dtype == torch.uint8 and codes.shape == (9, 300) and inv.shape == (9, 3)
    back = fp8_module.dequantize_rows(codes, inv, 0)
    assert torch.equal(back[2], torch.zeros(300, dtype=torch.float64))
    assert rel_error(back, x.double()) <= 0.04
    # Each block's largest magnitude, scaled, lands in (224, 448]: the largest power-of-two scale.
    blocks = back[:, :256].abs().view(9, 2, 128).amax(-1) / inv[:, :2].double()
    nonzero = blocks[[0, 1, 3, 4, 5, 6, 7, 8]]
    assert ((nonzero >= 224) & (nonzero <= 448)).all(), nonzero


def test_errors_name_the_option():
    p = problem()
    with pytest.raises(ValueError, match=r"fp8 must be one of \(None, 'e4m3', 'hybrid'\), got 'e5m2'"):
        moe_mlp(p["x"], p["topk_ids"], p["topk_probs"], p["fc1"], p["fc2"], fp8="e5m2")
    with pytest.raises(OptionError, match="use --moeblaze-ep-mode alltoall"):
        MoEBlazeConfig(fp8="hybrid", ep_mode="ring", recompute="fc1")
    assert MoEBlazeConfig(fp8="hybrid", ep_mode="alltoall").fp8 == "hybrid"


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_kernels)])
def test_torch_compile_gives_the_eager_bits(backend):
    """Under torch.compile(fullgraph=True) the FP8 op runs as the op's custom ops, over the same
    passes: the eager bits, forward and every gradient (the (gate, up) pair form, as torchtitan's)."""
    p = problem(seed=6, pair=True, tokens=24)
    eager = run(p, backend, "hybrid")
    torch._dynamo.reset()

    def layer(x, probs, gate, up, fc2):
        return moe_mlp(x, p["topk_ids"], probs, (gate, up), fc2, backend=backend, fp8="hybrid", validate=False)

    leaves = [p["x"].detach().clone().requires_grad_(), p["topk_probs"].detach().clone().requires_grad_(),
              *(w.detach().clone().requires_grad_() for w in p["fc1"]), p["fc2"].detach().clone().requires_grad_()]
    y = torch.compile(layer, backend="aot_eager", fullgraph=True)(*leaves)
    y.backward(p["grad_y"])
    assert torch.equal(y.detach(), eager[0])
    want = [eager[1]["x"], eager[1]["topk_probs"], *eager[1]["fc1"], eager[1]["fc2"]]
    for leaf, grad in zip(leaves, want):
        assert torch.equal(leaf.grad, grad)
