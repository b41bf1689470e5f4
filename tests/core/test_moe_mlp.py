"""moe_mlp: forward and all four gradients against the float64 dense oracle, gradcheck, the
saved-for-backward audit, argument errors, empty batches, unused slots and determinism.

Every test that runs the op takes ``backend`` from MOE_MLP_BACKENDS, so the fused kernels are
held to the same checks and the same per-dtype tolerances as the reference.
"""

from __future__ import annotations

import pytest
import torch

from moe_testing import (
    DEVICE,
    GRAD_INPUTS,
    MOE_MLP_BACKENDS,
    REL_TOL,
    dense_reference_and_grads,
    make_moe_problem,
    rel_error,
)
from moeblaze_megatron import build_routing_plan, moe_mlp
from moeblaze_megatron.training.audit import saved_bytes_for_backward
from moeblaze_megatron.kernels.settings import SETTINGS

ACTIVATIONS = ["swiglu", "silu", "gelu"]
RECOMPUTE = ["activation", "fc1"]


def call(problem, activation, backend, recompute="activation", plan=None):
    return moe_mlp(
        problem["x"],
        problem["topk_ids"],
        problem["topk_probs"],
        problem["fc1_weight"],
        problem["fc2_weight"],
        activation,
        plan,
        recompute=recompute,
        backend=backend,
    )


def forward_backward(problem, activation, backend, grad_y, recompute="activation", plan=None):
    """(y, {input name: gradient}) with fresh gradients."""
    for name in GRAD_INPUTS:
        problem[name].grad = None
    y = call(problem, activation, backend, recompute, plan)
    y.backward(grad_y)
    return y.detach(), {name: problem[name].grad for name in GRAD_INPUTS}


def assert_matches_oracle(problem, activation, backend, recompute, generator):
    dtype = problem["x"].dtype
    tol = REL_TOL[dtype]
    grad_y = torch.randn(problem["x"].shape, generator=generator).to(device=DEVICE, dtype=dtype)
    want_y, want_grads, scales = dense_reference_and_grads(problem, activation, grad_y)
    y, grads = forward_backward(problem, activation, backend, grad_y, recompute)
    assert y.dtype == dtype and y.shape == problem["x"].shape
    assert rel_error(y, want_y) <= tol, f"y: relative error {rel_error(y, want_y):.2e} > {tol:.1e}"
    for name in GRAD_INPUTS:
        got = grads[name]
        assert got is not None, f"no gradient for {name}"
        assert got.dtype == problem[name].dtype and got.shape == problem[name].shape, name
        err = rel_error(got, want_grads[name], scales[name])
        assert err <= tol, f"grad {name}: relative error {err:.2e} > {tol:.1e}"
    # Exact zeros where nothing flows: unused slots' probabilities, experts without tokens.
    unused = problem["topk_ids"] < 0
    assert bool((grads["topk_probs"][unused] == 0).all()), "an unused slot got a probability gradient"
    used_experts = problem["topk_ids"][~unused].unique()
    idle = torch.ones(problem["fc1_weight"].shape[0], dtype=torch.bool, device=DEVICE)
    idle[used_experts] = False
    assert bool((grads["fc1_weight"][idle] == 0).all()) and bool((grads["fc2_weight"][idle] == 0).all())


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_matches_dense_reference(backend, dtype, activation, recompute, generator):
    # T = 67 and d, h not multiples of 16; ~30% unused slots and three rows with none used.
    problem = make_moe_problem(67, 48, 40, 6, 2, activation, dtype, generator, routing="unused")
    assert_matches_oracle(problem, activation, backend, recompute, generator)


# (routing kind, T, E, K)
ROUTING_SHAPES = [
    pytest.param("empty_experts", 50, 8, 2, id="empty_experts"),
    pytest.param("one_expert", 40, 4, 1, id="all_tokens_one_expert"),
    pytest.param("one_expert", 40, 6, 3, id="all_tokens_same_k_experts"),
    pytest.param("random", 45, 5, 1, id="top1"),
    pytest.param("random", 30, 4, 4, id="k_equals_e"),
    pytest.param("random", 1, 4, 2, id="single_token"),
    pytest.param("random", 133, 8, 2, id="t_not_multiple"),
    # No used slot at all: the expert-order buffers are never written, so nothing may read them.
    pytest.param("all_unused", 12, 4, 2, id="all_unused"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,num_tokens,num_experts,topk", ROUTING_SHAPES)
@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_routing_patterns(backend, kind, num_tokens, num_experts, topk, dtype, generator):
    problem = make_moe_problem(num_tokens, 24, 20, num_experts, topk, "swiglu", dtype, generator, routing=kind)
    assert_matches_oracle(problem, "swiglu", backend, "activation", generator)


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_float64(activation, recompute, generator):
    # The kernels take 16- and 32-bit floats only; they are held to the float64 oracle above.
    backend = "reference"
    problem = make_moe_problem(6, 4, 3, 3, 2, activation, torch.float64, generator)
    ids = problem["topk_ids"]
    ids[1, 1] = -1
    ids[4] = -1

    def fn(x, probs, fc1, fc2):
        return moe_mlp(x, ids, probs, fc1, fc2, activation, recompute=recompute, backend=backend)

    assert torch.autograd.gradcheck(fn, tuple(problem[n] for n in GRAD_INPUTS))


def test_triton_backend_refuses_float64(generator):
    problem = make_moe_problem(4, 8, 4, 3, 2, "swiglu", torch.float64, generator)
    with pytest.raises(ValueError, match="backend='triton' takes float16, bfloat16 or float32"):
        call(problem, "swiglu", "triton")


def test_second_backward_through_the_graph(generator):
    """The Triton backward overwrites the saved pre-activations with their gradient; a second
    backward (retain_graph=True) must recompute them and give the same gradients."""
    problem = make_moe_problem(20, 16, 8, 4, 2, "swiglu", torch.float32, generator)
    y = call(problem, "swiglu", "triton")
    grad_y = torch.randn_like(y)
    first = torch.autograd.grad(y, [problem[n] for n in GRAD_INPUTS], grad_y, retain_graph=True)
    second = torch.autograd.grad(y, [problem[n] for n in GRAD_INPUTS], grad_y)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# Bytes per (token, k) slot besides the floor: the plan's three int32 [T*K] maps
# (expert_token_indices, token_expert_indices, token_index_map) = 12, plus the saved probabilities,
# at most 4 (float32). The plan's offsets add 4 * (E + 1).
SLOT_BYTES = 3 * 4 + 4


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_saved_bytes_for_backward_at_the_floor(backend, recompute, generator):
    """SwiGLU in bf16 keeps x (2Td bytes, held by the caller anyway) and at most the pre-activations
    (T*K*2h bf16 = 4TKh bytes), plus O(T*K) indices and probabilities. Sizes are picked so one
    saved (T*K, d) or (T*K, h) buffer would break the bound by far more than the slack."""
    T, d, h, E, K = 256, 128, 64, 8, 4
    problem = make_moe_problem(
        T, d, h, E, K, "swiglu", torch.bfloat16, generator, routing="empty_experts", probs_dtype=torch.float32
    )
    weights = [problem["fc1_weight"], problem["fc2_weight"]]
    y, saved = saved_bytes_for_backward(lambda: call(problem, "swiglu", backend, recompute), weights)
    indices = SLOT_BYTES * T * K + 4 * (E + 1)
    if recompute == "activation":
        bound = 1.05 * (2 * T * d + 4 * T * K * h) + indices
    else:
        bound = 2 * T * d + indices
    assert saved <= bound, f"saved {saved} bytes for backward, bound {bound:.0f}"
    # The audit must see the op at all: at least x and the plan are saved.
    assert saved >= 2 * T * d + 4 * T * K
    y.sum().backward()  # what was saved is enough for backward


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures the CUDA allocator")
@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_memory_held_until_backward_cuda(backend, recompute, generator):
    """Allocator view of the same bound: catches tensors kept on ctx outside save_for_backward,
    which saved_tensors_hooks cannot see."""
    T, d, h, E, K = 4096, 512, 256, 8, 4
    problem = make_moe_problem(
        T, d, h, E, K, "swiglu", torch.bfloat16, generator, routing="random", probs_dtype=torch.float32
    )
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = call(problem, "swiglu", backend, recompute)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    indices = SLOT_BYTES * T * K + 4 * (E + 1) + 8 * 512  # the allocator rounds each block up to 512 bytes
    bound = (1.05 * 4 * T * K * h if recompute == "activation" else 0) + indices
    assert held <= bound, f"{held} bytes held until backward besides x and y, bound {bound:.0f}"


@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_unused_slots_contribute_nothing(backend, generator):
    problem = make_moe_problem(40, 16, 12, 5, 3, "swiglu", torch.float32, generator, routing="unused")
    unused = problem["topk_ids"] < 0
    grad_y = torch.randn(40, 16, generator=generator).to(DEVICE)
    y, grads = forward_backward(problem, "swiglu", backend, grad_y)
    with torch.no_grad():
        problem["topk_probs"][unused] = 1e3
    y_big, grads_big = forward_backward(problem, "swiglu", backend, grad_y)
    assert torch.equal(y, y_big)
    for name in GRAD_INPUTS:
        assert torch.equal(grads[name], grads_big[name]), name
    assert bool((grads["topk_probs"][unused] == 0).all())


@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_unused_slot_is_isolated_from_non_finite_rows(backend, generator):
    problem = make_moe_problem(6, 8, 4, 3, 2, "swiglu", torch.float32, generator)
    with torch.no_grad():
        problem["topk_ids"][0] = torch.tensor([0, 1])  # token 0's row comes first in expert order
        problem["topk_ids"][3, 1] = -1
        problem["x"][0] = 1e30  # overflows token 0's expert outputs
    y, grads = forward_backward(problem, "swiglu", backend, torch.ones(6, 8, device=DEVICE))
    assert bool(y[1:].isfinite().all()), "an overflow in token 0 leaked into other tokens' outputs"
    assert grads["topk_probs"][3, 1] == 0
    assert bool(grads["x"][1:].isfinite().all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_no_tokens(backend, dtype, generator):
    problem = make_moe_problem(0, 16, 8, 4, 2, "swiglu", dtype, generator)
    y = call(problem, "swiglu", backend)
    assert y.shape == (0, 16) and y.dtype == dtype and y.device == problem["x"].device
    y.sum().backward()
    for name in ("topk_probs", "fc1_weight", "fc2_weight"):
        grad = problem[name].grad
        assert grad is not None and grad.shape == problem[name].shape and bool((grad == 0).all()), name


@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_no_tokens_gives_x_a_gradient(backend, generator):
    problem = make_moe_problem(0, 16, 8, 4, 2, "swiglu", torch.float32, generator)
    call(problem, "swiglu", backend).sum().backward()
    assert problem["x"].grad is not None and problem["x"].grad.shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_deterministic(backend, dtype, generator):
    problem = make_moe_problem(150, 32, 24, 8, 3, "swiglu", dtype, generator, routing="unused")
    grad_y = torch.randn(150, 32, generator=generator).to(device=DEVICE, dtype=dtype)
    y1, g1 = forward_backward(problem, "swiglu", backend, grad_y)
    y2, g2 = forward_backward(problem, "swiglu", backend, grad_y)
    assert torch.equal(y1, y2)
    for name in GRAD_INPUTS:
        assert torch.equal(g1[name], g2[name]), name


@pytest.mark.parametrize("method", ["torch", "sort"])
@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_given_plan_equals_built_plan(backend, method, generator):
    problem = make_moe_problem(70, 16, 12, 6, 2, "silu", torch.float32, generator, routing="unused")
    grad_y = torch.randn(70, 16, generator=generator).to(DEVICE)
    plan = build_routing_plan(problem["topk_ids"], 6, method=method)
    y1, g1 = forward_backward(problem, "silu", backend, grad_y, plan=plan)
    y2, g2 = forward_backward(problem, "silu", backend, grad_y)
    assert torch.equal(y1, y2)
    for name in GRAD_INPUTS:
        assert torch.equal(g1[name], g2[name]), name


@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_validate_false_skips_only_the_value_check(backend, monkeypatch, generator):
    import sys

    import moeblaze_megatron.routing as routing_module

    moe_mlp_module = sys.modules["moeblaze_megatron.moe_mlp"]  # the package re-exports the function

    problem = make_moe_problem(33, 16, 12, 6, 3, "swiglu", torch.float32, generator, routing="unused")
    args = {n: problem[n].detach() for n in ("x", "topk_ids", "topk_probs", "fc1_weight", "fc2_weight")}
    expected = moe_mlp(**args, backend=backend)
    seen = []
    real = routing_module.check_topk_ids

    def spy(topk_ids, num_experts, *, check_values=True):
        seen.append(check_values)
        real(topk_ids, num_experts, check_values=check_values)

    monkeypatch.setattr(moe_mlp_module, "check_topk_ids", spy)
    monkeypatch.setattr(routing_module, "check_topk_ids", spy)
    assert torch.equal(moe_mlp(**args, backend=backend, validate=False), expected)
    assert seen and not any(seen), seen  # the shape checks ran, the value check (a sync) did not
    seen.clear()
    moe_mlp(**args, backend=backend)
    assert seen.count(True) == 1, seen  # validated once, not again when the plan is built
    # validate=False still refuses what no plan can describe.
    with pytest.raises(ValueError, match="topk_ids has 2 rows"):
        moe_mlp(**{**args, "topk_ids": args["topk_ids"][:2]}, backend=backend, validate=False)


# ---------------------------------------------------------------------------------------------
# Bad input. Each case edits the arguments of a valid call (T=10, d=8, h=4, E=4, K=2, SwiGLU,
# float32) and names the argument the error must mention.


def _with(**changes):
    def edit(args):
        for name, change in changes.items():
            args[name] = change(args) if callable(change) else change
        return args

    return edit


def _set_id(token, k, value):
    def change(args):
        ids = args["topk_ids"].clone()
        ids[token, k] = ids[token, 0] if value == "repeat" else value
        return ids

    return change


def _plan_for(num_tokens, num_experts, topk):
    def change(args):
        return build_routing_plan(torch.arange(topk, device=DEVICE).repeat(num_tokens, 1), num_experts)

    return change


ERROR_CASES = [
    pytest.param(_with(x=lambda a: a["x"].tolist()), TypeError, r"x must be a torch.Tensor", id="x_not_tensor"),
    pytest.param(_with(x=lambda a: a["x"].long()), TypeError, r"x must have a floating-point dtype", id="x_integer"),
    pytest.param(_with(x=lambda a: a["x"][:, 0]), ValueError, r"x must be 2-D", id="x_one_dim"),
    pytest.param(_with(x=lambda a: a["x"][:, :6]), ValueError, r"fc1_weight has shape .* x of width 6", id="x_width"),
    pytest.param(
        _with(fc1_weight=lambda a: a["fc1_weight"].double()),
        TypeError,
        r"fc1_weight and fc2_weight must share a dtype, got torch.float64, torch.float32",
        id="fc1_dtype",
    ),
    pytest.param(
        _with(fc2_weight=lambda a: a["fc2_weight"].bfloat16()),
        TypeError,
        r"fc2_weight must share a dtype, got .*, torch.bfloat16",
        id="fc2_dtype",
    ),
    pytest.param(
        _with(fc1_weight=lambda a: a["fc1_weight"].int()),
        TypeError,
        r"fc1_weight must have a floating",
        id="fc1_integer",
    ),
    pytest.param(
        _with(fc1_weight=lambda a: a["fc1_weight"][0]),
        ValueError,
        r"fc1_weight and fc2_weight must be 3-D",
        id="fc1_two_dim",
    ),
    pytest.param(
        _with(fc1_weight=lambda a: a["fc1_weight"][:, :4]),
        ValueError,
        r"fc1_weight has shape \(4, 4, 8\); expected \[4, 8, 8\]",
        id="fc1_rows_not_2h",
    ),
    pytest.param(_with(activation="silu"), ValueError, r"fc1_weight .*activation='silu'", id="fc1_rows_2h_for_silu"),
    pytest.param(
        _with(fc1_weight=lambda a: a["fc1_weight"][:, :, :5]),
        ValueError,
        r"fc1_weight has shape",
        id="fc1_in_dim",
    ),
    pytest.param(
        _with(fc2_weight=lambda a: a["fc2_weight"][:3]),
        ValueError,
        r"fc2_weight has shape \(3, 8, 4\)",
        id="fc2_experts",
    ),
    pytest.param(
        _with(fc2_weight=lambda a: a["fc2_weight"][:, :7]),
        ValueError,
        r"fc2_weight has shape \(4, 7, 4\)",
        id="fc2_hidden",
    ),
    pytest.param(
        _with(topk_ids=lambda a: a["topk_ids"].float()),
        TypeError,
        r"topk_ids must have an integer dtype",
        id="ids_float",
    ),
    pytest.param(_with(topk_ids=lambda a: a["topk_ids"][:9]), ValueError, r"topk_ids has 9 rows", id="ids_rows"),
    pytest.param(_with(topk_ids=lambda a: a["topk_ids"][:, 0]), ValueError, r"topk_ids must be 2-D", id="ids_one_dim"),
    pytest.param(_with(topk_ids=_set_id(2, 1, 4)), ValueError, r"topk_ids.*\[0, 4\)", id="ids_equal_e"),
    pytest.param(_with(topk_ids=_set_id(5, 0, -2)), ValueError, r"topk_ids.*\[0, 4\)", id="ids_minus_two"),
    pytest.param(_with(topk_ids=_set_id(7, 1, "repeat")), ValueError, r"topk_ids.*same expert", id="ids_repeated"),
    pytest.param(
        _with(
            topk_ids=lambda a: torch.arange(5, device=DEVICE).repeat(10, 1),
            topk_probs=lambda a: torch.rand(10, 5, device=DEVICE),
        ),
        ValueError,
        r"topk_ids has topk=5",
        id="k_above_e",
    ),
    pytest.param(
        _with(topk_probs=lambda a: a["topk_probs"].long()),
        TypeError,
        r"topk_probs must have a floating",
        id="probs_integer",
    ),
    pytest.param(
        _with(topk_probs=lambda a: a["topk_probs"][:, :1]),
        ValueError,
        r"topk_probs has shape \(10, 1\)",
        id="probs_shape",
    ),
    pytest.param(
        _with(topk_probs=lambda a: a["topk_probs"][:9]),
        ValueError,
        r"topk_probs has shape \(9, 2\)",
        id="probs_rows",
    ),
    pytest.param(_with(activation="relu"), ValueError, r"activation must be one of", id="unknown_activation"),
    pytest.param(_with(recompute="all"), ValueError, r"recompute must be one of", id="unknown_recompute"),
    pytest.param(_with(backend="cuda"), ValueError, r"backend must be one of", id="unknown_backend"),
    pytest.param(_with(plan=lambda a: (1, 2)), TypeError, r"plan must be a RoutingPlan", id="plan_not_a_plan"),
    pytest.param(_with(plan=_plan_for(9, 4, 2)), ValueError, r"plan was built for 9 tokens", id="plan_other_tokens"),
    pytest.param(
        _with(plan=_plan_for(10, 5, 2)),
        ValueError,
        r"plan was built for .* 5 experts",
        id="plan_other_experts",
    ),
    pytest.param(_with(plan=_plan_for(10, 4, 1)), ValueError, r"plan was built for .* topk 1", id="plan_other_topk"),
]
ERROR_CASES += [
    pytest.param(
        _with(**{name: lambda a, n=name: a[n].to("meta")}),
        ValueError,
        rf"one device.*{name}: meta",
        id=f"{name}_on_meta",
    )
    for name in ("x", "topk_probs", "fc1_weight", "fc2_weight")
]
ERROR_CASES.append(
    pytest.param(
        _with(topk_ids=lambda a: a["topk_ids"].to("meta")),
        ValueError,
        r"one device.*topk_ids: meta",
        id="topk_ids_on_meta",
    )
)


@pytest.mark.parametrize("edit,error,pattern", ERROR_CASES)
@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_bad_input_names_the_argument(backend, edit, error, pattern, generator):
    problem = make_moe_problem(10, 8, 4, 4, 2, "swiglu", torch.float32, generator)
    args = {n: problem[n].detach() for n in ("x", "topk_ids", "topk_probs", "fc1_weight", "fc2_weight")}
    args.update(activation="swiglu", plan=None, recompute="activation", backend=backend)
    args = edit(args)
    with pytest.raises(error, match=pattern):
        moe_mlp(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors only")
def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch, generator):
    monkeypatch.setattr(SETTINGS, "interpret", False)
    problem = make_moe_problem(10, 8, 4, 4, 2, "swiglu", torch.float32, generator)
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1"):
        call(problem, "swiglu", "triton")


@pytest.mark.parametrize("wanted", [("x",), ("topk_probs",), ("fc1_weight",), ("fc2_weight",), ("topk_probs", "fc2_weight")])
@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_gradients_of_some_inputs_only(backend, wanted, generator):
    """Only the inputs that require grad get one, and it is the oracle's: the Triton backward
    computes the probability gradient with dx's launch, so without dx it takes another path."""
    problem = make_moe_problem(41, 24, 16, 5, 2, "swiglu", torch.float32, generator, routing="unused")
    grad_y = torch.randn(41, 24, generator=generator).to(DEVICE)
    _, want_grads, scales = dense_reference_and_grads(problem, "swiglu", grad_y)
    for name in GRAD_INPUTS:
        problem[name].requires_grad_(name in wanted)
    call(problem, "swiglu", backend).backward(grad_y)
    for name in GRAD_INPUTS:
        got = problem[name].grad
        if name not in wanted:
            assert got is None, name
            continue
        assert rel_error(got, want_grads[name], scales[name]) <= REL_TOL[torch.float32], name
    if "topk_probs" in wanted:
        assert bool((problem["topk_probs"].grad[problem["topk_ids"] < 0] == 0).all())


@pytest.mark.parametrize("backend", MOE_MLP_BACKENDS)
def test_strided_inputs(backend, generator):
    """Views that are not contiguous (every other column of wider tensors, a transposed weight
    stack) give the contiguous inputs' results and gradients."""
    problem = make_moe_problem(37, 24, 16, 5, 3, "swiglu", torch.float32, generator, routing="unused")
    grad_y = torch.randn(37, 24, generator=generator).to(DEVICE)
    want_y, want_grads = forward_backward(problem, "swiglu", backend, grad_y)
    wide = {name: torch.zeros(*problem[name].shape[:-1], 2 * problem[name].shape[-1], device=DEVICE)
            for name in ("x", "topk_probs")}
    leaves = {}
    for name, buf in wide.items():
        buf[..., ::2] = problem[name].detach()
        leaves[name] = buf.requires_grad_()
    ids = torch.zeros(37, 6, dtype=torch.long, device=DEVICE)
    ids[:, ::2] = problem["topk_ids"]
    fc2_t = problem["fc2_weight"].detach().transpose(1, 2).contiguous().requires_grad_()
    views = {name: leaves[name][..., ::2] for name in leaves}
    assert not any(v.is_contiguous() for v in views.values()) and not ids[:, ::2].is_contiguous()
    y = moe_mlp(views["x"], ids[:, ::2], views["topk_probs"], problem["fc1_weight"], fc2_t.transpose(1, 2),
                "swiglu", backend=backend)
    y.backward(grad_y)
    assert rel_error(y, want_y) <= REL_TOL[torch.float32]
    for name in ("x", "topk_probs"):
        got = leaves[name].grad
        assert rel_error(got[..., ::2], want_grads[name]) <= REL_TOL[torch.float32], name
        assert bool((got[..., 1::2] == 0).all()), name
    assert rel_error(fc2_t.grad.transpose(1, 2), want_grads["fc2_weight"]) <= REL_TOL[torch.float32]
