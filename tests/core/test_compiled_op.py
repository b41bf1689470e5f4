"""The op's torch.library custom ops (compiled_op.py), which moe_mlp runs under torch.compile:
called eagerly they give moe_mlp's eager bits, in both fc1 forms ([gate | up] stacked, or the
(gate, up) pair) and both recompute modes; moe_mlp under torch.compile(fullgraph=True) the same
bits again; against the float64 oracle on awkward routing (experts with no tokens, unused slots,
top-k = E, no tokens); the ops' registrations (schema, autograd, fake tensors) pass
torch.library.opcheck; bad arguments are named under compile too.
"""

from __future__ import annotations

import pytest
import torch

from moe_testing import (
    GRAD_INPUTS,
    REL_TOL,
    TRITON_INTERPRETED,
    dense_reference_and_grads,
    make_moe_problem,
    rel_error,
)
from moeblaze_megatron import moe_mlp
from moeblaze_megatron.compiled_op import compiled_moe_mlp
from moeblaze_megatron.passes import pass_options

BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not (TRITON_INTERPRETED or torch.cuda.is_available()), reason="needs the Triton kernels"))]


def _problem(routing="random", T=37, E=8, K=2, dtype=torch.float32, activation="swiglu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    return make_moe_problem(T, 24, 16, E, K, activation, dtype, generator, routing=routing)


def _pair(problem):
    """torchtitan's form of the same weights: w1 (gate) and w3 (up) [E, F, D] as leaves."""
    gate, up = problem["fc1_weight"].detach().chunk(2, dim=1)
    return gate.contiguous().requires_grad_(), up.contiguous().requires_grad_()


def _run(fn, leaves, grad_y):
    for t in leaves:
        t.grad = None
    y = fn()
    y.backward(grad_y)
    return [y.detach()] + [t.grad.clone() for t in leaves]


def expert_mlp(x, ids, probs, w1, w3, w2, activation="swiglu", *, recompute="activation", backend="auto",
               used_slots=None):
    """The custom ops, called eagerly or traced: fc1 as ``w1`` alone or the (w1, w3) pair."""
    fc1 = w1 if w3 is None else (w1, w3)
    if torch.compiler.is_compiling():
        return moe_mlp(x, ids, probs, fc1, w2, activation, recompute=recompute, backend=backend, validate=False,
                       used_slots=used_slots)
    return compiled_moe_mlp(x, ids, probs, fc1, w2, pass_options(x, activation, recompute, backend), used_slots)


def _eager_and_op(problem, activation, recompute, backend, compile_backend=None, used_slots=None):
    """(moe_mlp's eager y and gradients, the ops' over the (gate, up) pair or the stacked fc1:
    called eagerly, or moe_mlp compiled with ``compile_backend``), the fc1 gradient of the pair
    stacked back."""
    p = problem
    grad_y = torch.randn(p["x"].shape, generator=torch.Generator().manual_seed(1)).to(p["x"])
    leaves = [p["x"], p["topk_probs"], p["fc1_weight"], p["fc2_weight"]]
    want = _run(lambda: moe_mlp(p["x"], p["topk_ids"], p["topk_probs"], p["fc1_weight"], p["fc2_weight"], activation,
                                recompute=recompute, backend=backend), leaves, grad_y)
    paired = activation == "swiglu"
    w1, w3 = _pair(p) if paired else (p["fc1_weight"], None)

    def op(x, ids, probs, w1, w3, w2):
        return expert_mlp(x, ids, probs, w1, w3, w2, activation, recompute=recompute, backend=backend,
                          used_slots=used_slots)

    if compile_backend is not None:
        torch._dynamo.reset()
        op = torch.compile(op, backend=compile_backend, fullgraph=True)
    op_leaves = [p["x"], p["topk_probs"], w1, p["fc2_weight"]] + ([w3] if paired else [])
    got = _run(lambda: op(p["x"], p["topk_ids"], p["topk_probs"], w1, w3, p["fc2_weight"]), op_leaves, grad_y)
    if paired:
        got = got[:3] + [torch.cat([got[3], got[5]], dim=1), got[4]]
    return want, got, grad_y


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recompute", ["activation", "fc1"])
@pytest.mark.parametrize("activation", ["swiglu", "silu"])
def test_eager_calls_are_moe_mlps_bits(activation, recompute, backend):
    want, got, _ = _eager_and_op(_problem(activation=activation), activation, recompute, backend)
    for name, a, b in zip(("y", *GRAD_INPUTS), got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recompute", ["activation", "fc1"])
def test_compiled_fullgraph_gives_the_same_bits(recompute, backend):
    want, got, _ = _eager_and_op(_problem(), "swiglu", recompute, backend, compile_backend="aot_eager")
    for name, a, b in zip(("y", *GRAD_INPUTS), got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compile_backend", [None, "aot_eager"])
def test_used_slots_cut_the_expert_order_buffers(compile_backend, backend):
    """Rows with unused (-1) slots, as an expert-parallel exchange receives them: given how many
    slots are used, the expert-order buffers hold those alone (their size data-dependent under
    compile), and every result keeps moe_mlp's bits."""
    p = _problem("unused", T=40, E=6, K=3)
    used = int((p["topk_ids"] >= 0).sum())
    assert 0 < used < p["topk_ids"].numel()
    w1, w3 = _pair(p)
    _, probs_sorted, pre, expert_token_indices, *_ = torch.ops.moeblaze.moe_mlp_forward(
        p["x"], p["topk_ids"], p["topk_probs"], w1, w3, p["fc2_weight"], "swiglu", True, backend, "auto",
        torch.tensor(used))
    # The reference keeps the probabilities in slot order: nothing in expert order.
    assert probs_sorted.shape == ((used,) if backend == "triton" else (0,))
    assert pre.shape == (used, 2 * w1.shape[1])
    assert expert_token_indices.shape == (used,)
    want, got, _ = _eager_and_op(p, "swiglu", "activation", backend, compile_backend, used_slots=torch.tensor(used))
    for name, a, b in zip(("y", *GRAD_INPUTS), got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("routing,T,E,K", [("empty_experts", 50, 16, 2), ("unused", 40, 6, 3),
                                           ("random", 20, 4, 4), ("one_expert", 30, 8, 1), ("random", 0, 8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_op_matches_the_float64_oracle(routing, T, E, K, dtype):
    problem = _problem(routing, T, E, K, dtype, seed=T + E)
    _, got, grad_y = _eager_and_op(problem, "swiglu", "activation", "reference", compile_backend="aot_eager")
    if T == 0:
        assert got[0].shape == (0, 24) and all(g.abs().sum() == 0 for g in got[1:])
        return
    want_y, want_grads, scales = dense_reference_and_grads(problem, "swiglu", grad_y)
    assert rel_error(got[0], want_y) <= REL_TOL[dtype]
    for name, grad in zip(GRAD_INPUTS, got[1:]):
        assert rel_error(grad, want_grads[name], scales[name]) <= REL_TOL[dtype], name


def test_registrations_pass_opcheck():
    p = _problem()
    w1, w3 = _pair(p)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    # Ids and probabilities as column-major views (what a compiled graph may hand over): the
    # outputs still have the fake implementation's contiguous strides.
    ids = p["topk_ids"].t().contiguous().t()
    probs = p["topk_probs"].detach().t().contiguous().t().requires_grad_()
    args = (p["x"], ids, probs, w1, w3, p["fc2_weight"], "swiglu", True, "reference", "auto", None)
    torch.library.opcheck(torch.ops.moeblaze.moe_mlp_forward.default, args, test_utils=tests)
    outputs = torch.ops.moeblaze.moe_mlp_forward(*args)
    backward_args = (torch.randn_like(p["x"]), p["x"].detach(), p["topk_probs"].detach(), outputs[1], w1.detach(),
                     w3.detach(), p["fc2_weight"].detach(), outputs[2].clone(), list(outputs[3:]), "swiglu", True,
                     "reference", [True] * 5)
    # Not test_autograd_registration: the backward is not differentiated again.
    torch.library.opcheck(torch.ops.moeblaze.moe_mlp_backward.default, backward_args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"])
def test_bad_arguments_are_named(compile_backend):
    p = _problem()
    w1, w3 = _pair(p)

    def call(*args, **kwargs):
        fn = moe_mlp
        if compile_backend is not None:
            torch._dynamo.reset()
            fn = torch.compile(moe_mlp, backend=compile_backend, fullgraph=True)
        return fn(*args, **kwargs)

    def refused(kind, match):
        # Under compile dynamo reraises the op's own error as its Unsupported, message kept.
        return pytest.raises(kind if compile_backend is None else Exception, match=match)

    x, ids, probs, w2 = p["x"], p["topk_ids"], p["topk_probs"], p["fc2_weight"]
    for bad in (5.0, torch.tensor([5]), torch.tensor(5, dtype=torch.int32)):
        with refused(TypeError, "used_slots must be an int or a 0-d int64 CPU tensor"):
            call(x, ids, probs, (w1, w3), w2, used_slots=bad)
    with refused(ValueError, r"\(gate, up\) pair of a SwiGLU expert MLP.*activation='silu'"):
        call(x, ids, probs, (w1, w3), w2, "silu")
    with refused(ValueError, r"\(gate, up\) halves must be 3-D .* of one shape"):
        call(x, ids, probs, (w1, w3[:, :-1]), w2)
    with refused(ValueError, "recompute must be one of"):
        call(x, ids, probs, (w1, w3), w2, recompute="none")
    with refused(ValueError, "topk_probs has shape"):
        call(x, ids, probs[:, :1], (w1, w3), w2)


def test_a_plan_is_refused_under_compile():
    from moeblaze_megatron import build_routing_plan

    p = _problem()
    plan = build_routing_plan(p["topk_ids"], 8)
    torch._dynamo.reset()
    compiled = torch.compile(moe_mlp, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="builds the routing plan inside its custom op: pass plan=None"):
        compiled(p["x"], p["topk_ids"], p["topk_probs"], p["fc1_weight"], p["fc2_weight"], "swiglu", plan)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inductor_keeps_the_op_whole(backend):
    """Inductor (what torchtitan's --compile.enable uses) around the op: the same bits as eager."""
    want, got, _ = _eager_and_op(_problem(), "swiglu", "activation", backend, compile_backend="inductor")
    for name, a, b in zip(("y", *GRAD_INPUTS), got, want):
        assert torch.equal(a, b), name



@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_backward_is_refused_not_wrong(backend):
    """retain_graph: the backward op declares the saved pre-activations mutated (the kernels turn
    them into their gradient), so autograd's version check refuses a second backward instead of
    reading a gradient as pre-activations."""
    p = _problem()
    w1, w3 = _pair(p)
    y = expert_mlp(p["x"], p["topk_ids"], p["topk_probs"], w1, w3, p["fc2_weight"], backend=backend)
    grad_y = torch.randn_like(y)
    leaves = (p["x"], p["topk_probs"], w1, w3, p["fc2_weight"])
    torch.autograd.grad(y, leaves, grad_y, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y, leaves, grad_y)
