"""Shared test helpers: routing cases, the float64 dense MoE oracle, plan checks, the row-GEMM
layer under one tile config, the cases the kernel tests share and the saved-for-backward audit.

Plain functions and constants, imported as ``from moe_testing import ...`` (pytest puts tests/ on
sys.path), so every test file builds the same inputs and uses the same oracles. Fixtures live in
conftest.py.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import queue as queue_module
import socket
import traceback

import pytest
import torch
import torch.nn.functional as F
import triton


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Backends the moe_mlp tests run on. The fused Triton kernels join this list when they land; the
# tolerances below depend on the dtype only, so every backend is held to the same bar.
MOE_MLP_BACKENDS = ["reference", "triton"]

# Relative error ||got - want|| / ||want|| allowed against the float64 oracle.
# float32: unit roundoff u = 6e-8; a sum of n products carries an error growing like sqrt(n) * u
#   (n <= a few hundred here), and each output passes through three such sums (fc1, fc2, the
#   combine over k) plus the activation: the reference measures 2e-7 to 3e-7. 1e-5 leaves a 30x
#   margin (room for another summation order) while a wrong index, a missing probability or a
#   wrong activation derivative gives errors of order 1.
# bfloat16: u = 2**-9 = 2e-3. Inputs are rounded to bf16 before both paths see them, so the error
#   comes from rounding the intermediates (pre-activations, activations, expert outputs, and in
#   backward the scaled activation gradients): each rounding adds ~u/sqrt(3) relative error in
#   norm (uniform rounding error); about five of them in sequence, the result's own rounding to
#   bf16 included, give ~4e-3, and 4e-3 to 4.5e-3 is what the reference measures on every output
#   and gradient. 8 * u = 1.6e-2 bounds that with a 4x margin and still catches any structural
#   mistake (one wrong slot among a hundred already moves the norm by ~10%).
# float64: the only difference from the oracle is the order of summation.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 8 * 2.0**-9, torch.float64: 1e-12}

TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

def three_step_available(device: torch.device) -> bool:
    """The Triton build runs on CUDA tensors, or on CPU tensors under the interpreter."""
    return device.type == "cuda" or TRITON_INTERPRETED


def rel_error(got: torch.Tensor, want: torch.Tensor, scale: float | None = None) -> float:
    """||got - want|| / scale (default ||want||) in float64; 0 when both are zero, inf when only
    the scale is."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got - want).norm().item()
    scale = want.norm().item() if scale is None else scale
    if scale == 0:
        return 0.0 if diff == 0 else float("inf")
    return diff / scale


# ---------------------------------------------------------------------------------------------
# Routing inputs


def random_topk_ids(
    num_tokens: int,
    num_experts: int,
    topk: int,
    generator: torch.Generator,
    experts: list[int] | None = None,
) -> torch.Tensor:
    """int64 [T, K] ids, distinct in each row, drawn uniformly from ``experts`` (default all)."""
    pool = torch.tensor(experts if experts is not None else range(num_experts), dtype=torch.long)
    assert topk <= len(pool)
    scores = torch.rand(num_tokens, len(pool), generator=generator)
    return pool[scores.argsort(dim=1)[:, :topk]]


def drop_slots(topk_ids: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """Mark about ``fraction`` of the slots unused (-1), as a capacity limit or EP would."""
    drop = torch.rand(topk_ids.shape, generator=generator) < fraction
    return topk_ids.masked_fill(drop, -1)


def make_topk_ids(kind: str, num_tokens: int, num_experts: int, topk: int, generator: torch.Generator):
    """Routing ids of a named pattern (int64, CPU):

    ``random``: distinct uniform ids; ``empty_experts``: the first, a middle and the last expert get
    no tokens; ``one_expert``: every slot of every token names the same K experts in a random order
    per row (K = 1: every token on one expert); ``unused``: about 30% of slots -1 plus the first,
    a middle and the last row entirely unused; ``all_unused``: every slot -1.
    """
    if kind == "random":
        return random_topk_ids(num_tokens, num_experts, topk, generator)
    if kind == "empty_experts":
        empty = {0, num_experts // 2, num_experts - 1}
        rest = [e for e in range(num_experts) if e not in empty]
        return random_topk_ids(num_tokens, num_experts, topk, generator, experts=rest)
    if kind == "one_expert":
        chosen = torch.randperm(num_experts, generator=generator)[:topk]
        order = torch.rand(num_tokens, topk, generator=generator).argsort(dim=1)
        return chosen[order]
    if kind == "unused":
        ids = drop_slots(random_topk_ids(num_tokens, num_experts, topk, generator), 0.3, generator)
        if num_tokens:
            ids[[0, num_tokens // 2, num_tokens - 1]] = -1
        return ids
    if kind == "all_unused":
        return torch.full((num_tokens, topk), -1, dtype=torch.long)
    raise ValueError(f"unknown routing kind {kind!r}")


# (case id, kind, T, E, K). Sizes are chosen against the three-step build's tiles (512 tokens,
# 16 experts) and against 16/32/64, the usual GEMM tile sizes.
ROUTING_CASES = [
    ("random", "random", 37, 8, 2),
    ("multi_tile", "random", 1100, 40, 4),  # 3 token tiles x 3 expert blocks, ragged in both
    ("empty_experts", "empty_experts", 300, 16, 2),
    ("all_on_one_expert_k1", "one_expert", 200, 8, 1),
    ("all_on_same_k_experts", "one_expert", 200, 8, 3),
    ("top1", "random", 777, 16, 1),
    ("k_equals_e", "random", 100, 8, 8),
    ("t_not_multiple", "random", 1000, 24, 2),  # 1000 is not a multiple of 16, 32, 64 or 512
    ("single_token", "random", 1, 8, 2),
    ("single_expert", "random", 50, 1, 1),
    ("unused_slots", "unused", 300, 12, 3),
    ("all_unused", "all_unused", 20, 4, 2),
    ("no_tokens", "random", 0, 8, 2),
    ("e255_unused", "unused", 400, 255, 2),  # the widest uint8 sort key plus the -1 key
    ("e256", "random", 300, 256, 4),  # first expert count needing 16-bit sort keys
    # 300 experts (several expert blocks and search programs), > 4096 unused slots for the tail.
    ("scan_carry", "unused", 7000, 300, 2),
]
ROUTING_CASE_IDS = [case[0] for case in ROUTING_CASES]


def make_routing_case(case_id: str, seed: int = 0):
    """(topk_ids int64 on CPU, num_experts) of one of ROUTING_CASES."""
    _, kind, num_tokens, num_experts, topk = next(c for c in ROUTING_CASES if c[0] == case_id)
    generator = torch.Generator().manual_seed(seed)
    return make_topk_ids(kind, num_tokens, num_experts, topk, generator), num_experts


# ---------------------------------------------------------------------------------------------
# Routing plan oracle and invariants


def expected_plan(topk_ids: torch.Tensor, num_experts: int) -> dict[str, list]:
    """The plan's four fields as nested lists, built by plain Python loops from the definition."""
    ids = topk_ids.tolist()
    num_tokens, topk = topk_ids.shape
    per_expert = [[] for _ in range(num_experts)]
    for t, row in enumerate(ids):  # t ascending, so each expert's list ascends too
        for k, e in enumerate(row):
            if e >= 0:
                per_expert[e].append((t, k))
    expert_token_indices, offsets = [], [0]
    token_index_map = [[-1] * topk for _ in range(num_tokens)]
    for slots in per_expert:
        for t, k in slots:
            token_index_map[t][k] = len(expert_token_indices)
            expert_token_indices.append(t)
        offsets.append(len(expert_token_indices))
    expert_token_indices += [-1] * (num_tokens * topk - len(expert_token_indices))
    return {
        "expert_token_indices": expert_token_indices,
        "expert_token_offsets": offsets,
        "token_expert_indices": ids,
        "token_index_map": token_index_map,
    }


PLAN_FIELDS = ("expert_token_indices", "expert_token_offsets", "token_expert_indices", "token_index_map")


def assert_plan_invariants(plan, topk_ids: torch.Tensor, num_experts: int) -> None:
    """Check the properties that define a plan, vectorized (usable at any size)."""
    num_tokens, topk = topk_ids.shape
    ids = topk_ids.long().cpu()
    for name in PLAN_FIELDS:
        assert getattr(plan, name).device == topk_ids.device, f"{name} is not on the ids' device"
    eti = plan.expert_token_indices.cpu()
    offsets = plan.expert_token_offsets.cpu()
    tei = plan.token_expert_indices.cpu()
    tim = plan.token_index_map.cpu()
    for name, tensor, shape in (
        ("expert_token_indices", eti, (num_tokens * topk,)),
        ("expert_token_offsets", offsets, (num_experts + 1,)),
        ("token_expert_indices", tei, (num_tokens, topk)),
        ("token_index_map", tim, (num_tokens, topk)),
    ):
        assert tensor.dtype == torch.int32, f"{name} is {tensor.dtype}, expected int32"
        assert tuple(tensor.shape) == shape, f"{name} has shape {tuple(tensor.shape)}, expected {shape}"
    used = ids >= 0
    n_used = int(used.sum())
    # Offsets are the cumulative counts of each expert's used slots.
    counts = torch.bincount(ids[used], minlength=num_experts)
    assert offsets[0] == 0
    assert torch.equal(offsets.diff().long(), counts), "offsets are not the cumulative expert counts"
    assert int(offsets[-1]) == n_used
    assert torch.equal(tei.long(), torch.where(used, ids, -1)), "token_expert_indices != topk_ids"
    # Unused slots map nowhere; the tail past the used slots is -1.
    assert bool((tim[~used] == -1).all()), "an unused slot has a position"
    assert bool((eti[n_used:] == -1).all()), "the tail of expert_token_indices is not -1"
    # token_index_map is a bijection from used slots onto [0, n_used) and inverts
    # expert_token_indices: slot (t, k) sits at a position holding t, inside expert e's range.
    pos = tim[used].long()
    assert torch.equal(pos.sort().values, torch.arange(n_used)), "positions are not a permutation"
    tokens = torch.arange(num_tokens)[:, None].expand(-1, topk)[used]
    assert torch.equal(eti[pos].long(), tokens), "token_index_map does not invert expert_token_indices"
    experts = ids[used]
    assert bool(((offsets[experts] <= pos) & (pos < offsets[experts + 1])).all()), "slot outside its expert"
    # Token ids strictly ascend inside each expert's range (and so are distinct there).
    head = eti[:n_used].long()
    same_expert = torch.bucketize(torch.arange(n_used), offsets[1:].long(), right=True)
    step_ok = (head[1:] > head[:-1]) | (same_expert[1:] != same_expert[:-1])
    assert bool(step_ok.all()), "token ids do not ascend inside an expert"


def assert_plans_identical(got, want, label: str = "") -> None:
    """Bitwise equality of every field, dtype and shape included (RoutingPlan.__eq__ ignores dtype)."""
    for name in PLAN_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{label} {name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a.cpu(), b.cpu()), f"{label} {name} differs"


# ---------------------------------------------------------------------------------------------
# MoE MLP oracle and problems


def gather_gemm_layer(plan, tokens, d, h, activation, dtype, seed, config, device="cpu", fc1_config=None,
                   tma_rows=None):
    """fc1 with the activation, fc2, dH with the activation backward and dX through the row-GEMM
    kernel with one ``config`` (fc1 with ``fc1_config`` if given: the SwiGLU forward's tile must
    fit both halves), as the layer runs them, on fresh inputs drawn from ``seed``; every output
    poisoned with NaN first; ``tma_rows`` as gather_gemm takes it, for fc2 and dX. Returns (pre, h,
    fc2 out, dh, d pre, router-gradient partials, dx), one row per plan slot."""
    from moeblaze_megatron.kernels.gather_gemm import EPI_ACT_BWD, EPI_ACT_FWD, gather_gemm_ds_tiles
    from moeblaze_megatron.kernels.tuning import gather_gemm_with

    E = plan.num_experts
    width = 2 * h if activation == "swiglu" else h
    g = torch.Generator().manual_seed(seed)
    on = lambda t: t.to(dtype).to(device)  # noqa: E731
    x, dy = on(torch.randn(tokens, d, generator=g)), on(torch.randn(tokens, d, generator=g))
    fc1 = on(torch.randn(E, width, d, generator=g) * d**-0.5)
    fc2 = on(torch.randn(E, d, h, generator=g) * h**-0.5)
    rows = plan.expert_token_indices.shape[0]
    probs = on(torch.rand(rows, generator=g))
    nan = lambda *shape: torch.full(shape, float("nan"), dtype=dtype, device=device)  # noqa: E731
    pre, hid, out2, hs, dx = nan(rows, width), nan(rows, h), nan(rows, d), nan(rows, h), nan(rows, d)
    gather_gemm_with(fc1_config or config, x, fc1, hid, plan, transpose_weight=True, epilogue=EPI_ACT_FWD,
                  activation=activation, pre=pre, n=h)
    gather_gemm_with(config, hid, fc2, out2, plan, transpose_weight=True, gather_a=False, n=d, tma_rows=tma_rows)
    dpre = pre.clone()
    ds = torch.full((rows, gather_gemm_ds_tiles(h, config.kwargs["BLOCK_N"])), float("nan"), device=device)
    gather_gemm_with(config, dy, fc2, hs, plan, transpose_weight=False, epilogue=EPI_ACT_BWD, activation=activation,
                  pre=dpre, probs_sorted=probs, ds_partial=ds, n=h)
    gather_gemm_with(config, dpre, fc1, dx, plan, transpose_weight=False, gather_a=False, n=d, tma_rows=tma_rows)
    return pre, hid, out2, hs, dpre, ds, dx


# Pre-activations where the sigmoid saturates or its exponential leaves float32's range (2^128 at
# g = -88.7; denormal sigmoids below g = -87.3), and ordinary ones.
SATURATING_PRE = (-1e4, -200.0, -100.0, -90.0, -88.5, -87.0, -30.0, -5.0, -0.5, 0.0, 0.5, 5.0, 30.0, 90.0, 200.0, 1e4)


def check_saturated_activations(device, dtype, activation, config=None, warp_specialize=None, seed=0):
    """The fused activation epilogues at saturating pre-activations, element by element against
    float64: fc1's forward on pre-activations up to +-1000 (weights scaled up), then dH's backward
    on saved pre-activations holding every value of SATURATING_PRE. dH = dY @ fc2 has positive
    terms only (no cancellation), so every element holds to a relative bound. ``config``: one
    tile config (gather_gemm_with), else the hot path's launch with ``warp_specialize``."""
    from moeblaze_megatron import build_routing_plan
    from moeblaze_megatron.kernels.gather_gemm import EPI_ACT_BWD, EPI_ACT_FWD, gather_gemm_ds_tiles
    from moeblaze_megatron.kernels.tuning import gather_gemm_with

    # h off every tile width; d = 128 for the warp-specialized kernel (K at least two 64-wide stages).
    tokens, E, K, d, h = 24, 3, 2, 128 if warp_specialize else 64, 40
    g = torch.Generator().manual_seed(seed)
    plan = build_routing_plan(torch.rand(tokens, E, generator=g).topk(K, dim=1).indices.to(device), E)
    rows = plan.expert_token_indices.shape[0]
    width = 2 * h if activation == "swiglu" else h
    on = lambda t: t.to(dtype).to(device)  # noqa: E731
    extra = {} if config is not None else {"warp_specialize": warp_specialize}
    # rtol: the storage rounding of dH and of each output (2^-9 each in bf16), float32's sums.
    rtol, atol = (1e-5, 1e-30) if dtype == torch.float32 else (2.0**-6, 1e-30)

    def close(got, want, scale=None):
        want = want.to(got.device)
        bound = rtol * (want.abs() if scale is None else scale.to(got.device)) + atol
        err = (got.double() - want).abs()
        assert not got.isnan().any() and (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"

    src = plan.expert_token_indices.long()
    expert = torch.repeat_interleave(torch.arange(E, device=device), plan.expert_token_offsets.diff().long())
    x = on(torch.randn(tokens, d, generator=g))
    fc1 = on(torch.randn(E, width, d, generator=g) * (100.0 * d**-0.5))
    pre = torch.full((rows, width), float("nan"), dtype=dtype, device=device)
    hid = torch.full((rows, h), float("nan"), dtype=dtype, device=device)
    gather_gemm_with(config, x, fc1, hid, plan, transpose_weight=True, epilogue=EPI_ACT_FWD, activation=activation,
                  pre=pre, n=h, **extra)
    pre64 = torch.einsum("rk,rnk->rn", x.double()[src], fc1.double()[expert])
    close(pre, pre64, scale=torch.einsum("rk,rnk->rn", x.double().abs()[src], fc1.double().abs()[expert]))
    assert pre.double().abs().max() > 200  # the sigmoid saturates on some
    close(hid, _activation64(pre.double(), activation))

    dy = on(torch.rand(tokens, d, generator=g))
    fc2 = on(torch.rand(E, d, h, generator=g) * d**-0.5)
    saved = torch.randn(rows, width, generator=g)
    picks = torch.tensor(SATURATING_PRE)[torch.randperm(rows * h, generator=g) % len(SATURATING_PRE)]
    saved[:, :h] = picks.view(rows, h)
    saved = on(saved)
    probs = on(torch.rand(rows, generator=g))
    d_pre = saved.clone()
    c = torch.full((rows, h), float("nan"), dtype=dtype, device=device)
    ds = torch.zeros(rows, gather_gemm_ds_tiles(h), device=device)
    gather_gemm_with(config, dy, fc2, c, plan, transpose_weight=False, epilogue=EPI_ACT_BWD, activation=activation,
                  pre=d_pre, probs_sorted=probs, ds_partial=ds, n=h, **extra)
    dh64 = torch.einsum("rk,rkn->rn", dy.double()[src], fc2.double()[expert])
    pre64 = saved.double().requires_grad_()
    act64 = _activation64(pre64, activation)
    p64 = probs.double()[:, None]
    (d_pre64,) = torch.autograd.grad(act64, pre64, dh64 * p64)
    close(d_pre, d_pre64)
    close(c, p64 * act64.detach())
    terms = dh64 * act64.detach()
    close(ds.sum(1), terms.sum(1), scale=terms.abs().sum(1))


def per_expert_weight_grad64(tokens: torch.Tensor, rows: torch.Tensor, plan, gather_a: bool) -> torch.Tensor:
    """float64 oracle of a weight gradient with one gathered operand: for each expert e,
    ``tokens[idx(e)]^T @ rows(e)`` (gather_a) or ``rows(e)^T @ tokens[idx(e)]``; zeros for an
    expert with no rows."""
    offsets = plan.expert_token_offsets.tolist()
    idx = plan.expert_token_indices.long()
    out = []
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        t64, r64 = tokens.double()[idx[lo:hi]], rows.double()[lo:hi]
        out.append(t64.T @ r64 if gather_a else r64.T @ t64)
    return torch.stack(out)


# ---------------------------------------------------------------------------------------------
# Row-GEMM cases shared by the kernel tests

# Awkward plans for the gather GEMM's persistent launch and its TMA descriptors under the
# interpreter, (kind, T, E, K): small enough for the interpreter, each with more row tiles (of
# 16 rows) than the interpreter's 4 persistent programs.
PERSISTENT_CASES = {
    "random": ("random", 37, 8, 2),
    "empty_experts": ("empty_experts", 40, 16, 2),
    "all_on_same_k_experts": ("one_expert", 30, 8, 3),
    "k_equals_e": ("random", 20, 6, 6),
    "unused_slots": ("unused", 40, 12, 3),
    "no_tokens": ("random", 0, 8, 2),
}

# The same awkward plans at GPU size, (kind, T, E, K, d, h): d and h multiples of 8, not of 16 nor
# of the tiles. All slot counts T*K multiples of 16 and all E below 16, so Triton's argument
# specialization compiles each kernel once for every case.
GPU_PERSISTENT_CASES = {
    "random": ("random", 9000, 12, 4, 520, 392),
    "empty_experts": ("empty_experts", 6000, 15, 2, 136, 264),
    "all_on_same_k_experts": ("one_expert", 4000, 8, 3, 264, 264),
    "k_equals_e": ("random", 3000, 6, 6, 136, 520),
    "unused_slots": ("unused", 7000, 12, 8, 264, 136),
    "no_tokens": ("random", 0, 8, 2, 264, 136),
}


def gpu_row_config(bm, bn, warps, stages, persistent):
    """A GPU row-GEMM tile config as the autotuner's list has them (BLOCK_K 64, GROUP_M 8)."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8, "PERSISTENT": persistent},
                         num_warps=warps, num_stages=stages)


def _activation64(pre: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        gate, up = pre.chunk(2, dim=-1)  # Megatron's GLU layout: [gate | up]
        return gate * torch.sigmoid(gate) * up
    if activation == "silu":
        return pre * torch.sigmoid(pre)
    if activation == "gelu":
        return F.gelu(pre)  # the exact (erf) GELU, as Megatron's default
    raise ValueError(f"unknown activation {activation!r}")


def dense_moe_reference(x, topk_ids, topk_probs, fc1, fc2, activation: str) -> torch.Tensor:
    """The MoE MLP in float64 by its definition: every expert runs on every token, and a dense
    [T] weight (the token's probability for that expert, 0 if not chosen or unused) masks it.

    Independent of RoutingPlan; differentiable, so autograd through it gives the reference
    gradients of x, topk_probs, fc1 and fc2.
    """
    x, probs, fc1, fc2 = x.double(), topk_probs.double(), fc1.double(), fc2.double()
    y = torch.zeros(x.shape[0], fc2.shape[1], dtype=torch.float64, device=x.device)
    for e in range(fc1.shape[0]):
        weight = (probs * (topk_ids == e)).sum(dim=1)
        y = y + weight[:, None] * (_activation64(x @ fc1[e].t(), activation) @ fc2[e].t())
    return y


def make_moe_problem(
    num_tokens: int,
    hidden: int,
    ffn: int,
    num_experts: int,
    topk: int,
    activation: str,
    dtype: torch.dtype,
    generator: torch.Generator,
    routing: str = "random",
    probs_dtype: torch.dtype | None = None,
    device=DEVICE,
) -> dict:
    """Leaf tensors for moe_mlp, scaled so pre-activations and outputs are O(1); x, probs and the
    weights require grad. topk_ids are int64; probs have ``probs_dtype`` (default: ``dtype``)."""
    fc1_rows = 2 * ffn if activation == "swiglu" else ffn
    ids = make_topk_ids(routing, num_tokens, num_experts, topk, generator)
    probs = torch.rand(num_tokens, topk, generator=generator).softmax(dim=1)
    tensors = {
        "x": torch.randn(num_tokens, hidden, generator=generator),
        "topk_probs": probs,
        "fc1_weight": torch.randn(num_experts, fc1_rows, hidden, generator=generator) / hidden**0.5,
        "fc2_weight": torch.randn(num_experts, hidden, ffn, generator=generator) / ffn**0.5,
    }
    problem = {
        name: t.to(device=device, dtype=(probs_dtype or dtype) if name == "topk_probs" else dtype).requires_grad_()
        for name, t in tensors.items()
    }
    problem["topk_ids"] = ids.to(device)
    return problem


GRAD_INPUTS = ("x", "topk_probs", "fc1_weight", "fc2_weight")


def dense_reference_and_grads(problem: dict, activation: str, grad_y: torch.Tensor):
    """Oracle output and gradients (float64) for ``problem`` with upstream gradient ``grad_y``,
    and the scale each gradient's error is measured against.

    The scale is the gradient's norm, except for topk_probs: its gradient at slot (t, k) is one
    dot product <grad_y[t], out[t, k]> (out: the expert's unweighted output), whose rounding error
    grows with ||grad_y[t]|| * ||out[t, k]|| while cancellation can make the product itself
    arbitrarily small; with few tokens there are too few slots for the norm to average that out.
    """
    leaves = {n: problem[n].detach().double().requires_grad_() for n in GRAD_INPUTS}
    ids = problem["topk_ids"]
    y = dense_moe_reference(
        leaves["x"], ids, leaves["topk_probs"], leaves["fc1_weight"], leaves["fc2_weight"], activation
    )
    y.backward(grad_y.double())
    grads = {n: leaves[n].grad for n in GRAD_INPUTS}
    scales = {n: grads[n].norm().item() for n in GRAD_INPUTS}
    with torch.no_grad():
        out_norm = torch.zeros(ids.shape, dtype=torch.float64, device=ids.device)
        for e in range(leaves["fc1_weight"].shape[0]):
            out = _activation64(leaves["x"] @ leaves["fc1_weight"][e].t(), activation) @ leaves["fc2_weight"][e].t()
            out_norm = torch.where(ids == e, out.norm(dim=1)[:, None], out_norm)
        scales["topk_probs"] = (grad_y.double().norm(dim=1)[:, None] * out_norm).norm().item()
    return y.detach(), grads, scales


# ---------------------------------------------------------------------------------------------
# Multi-process runs (gloo on the CPU)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def _worker(rank, world_size, port, fn, args, queue, timeout):
    # A rank stuck in a collective prints where it is (pytest shows it as captured stderr).
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        result = fn(rank, world_size, port, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - the parent reports every rank's failure
        queue.put((rank, "error", traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0):
    """Run ``fn(rank, world_size, port, *args)`` in ``world_size`` spawned processes; returns the
    list of their results by rank, or fails with every failing rank's traceback.

    ``fn`` must be importable (a module-level function of a test module)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, queue, timeout))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        while len(results) + len(errors) < world_size:
            # Once a rank has failed the others may wait forever in a collective: give them a
            # few seconds to report their own failure, then stop.
            rank, status, payload = queue.get(timeout=5.0 if errors else timeout + 10)
            (results if status == "ok" else errors)[rank] = payload
    except queue_module.Empty:
        missing = sorted(set(range(world_size)) - set(results) - set(errors))
        errors.setdefault(-1, f"ranks {missing} did not finish (hung or killed)")
    finally:
        for p in procs:
            p.join(timeout=1 if errors else 10)
            if p.is_alive():
                p.kill()
    if errors:
        pytest.fail("\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r] for r in range(world_size)]


class RaiseInBackward(torch.autograd.Function):
    """Identity forward; its backward runs out of memory (a simulated one): a training step that
    fails half way down the model."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


def weight_grad_reference(a, b, plan, gathered: str) -> torch.Tensor:
    """The float64 per-expert reduction A[rows(e)]^T @ B[rows(e)], the token-row operand
    (``gathered``: "a" or "b") gathered through the plan: the weight-gradient kernel's oracle."""
    idx = plan.expert_token_indices.long()
    bounds = plan.expert_token_offsets.tolist()
    a64 = a.double()[idx] if gathered == "a" else a.double()
    b64 = b.double()[idx] if gathered == "b" else b.double()
    return torch.stack([a64[lo:hi].T @ b64[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])])
