"""build_routing_plan: every method gives the plan its definition fixes, on random and adversarial
routing; ids of every integer width; clear errors; determinism."""

from __future__ import annotations

import pytest
import torch

from moe_testing import (
    DEVICE,
    PLAN_FIELDS,
    ROUTING_CASE_IDS,
    assert_plan_invariants,
    assert_plans_identical,
    drop_slots,
    expected_plan,
    make_routing_case,
    make_topk_ids,
    random_topk_ids,
    three_step_available,
)
from moeblaze_megatron import RoutingPlan, build_routing_plan
from moeblaze_megatron.routing import choose_routing_method, gpu_routing_method

METHODS = ["torch", "sort", "three_step", "auto"]


def assert_matches_definition(plan, topk_ids, num_experts, label=""):
    want = expected_plan(topk_ids.cpu(), num_experts)
    for name in PLAN_FIELDS:
        assert getattr(plan, name).tolist() == want[name], f"{label} {name} differs from the definition"


def build(topk_ids, num_experts, method, **kwargs):
    triton_method = method in ("sort", "three_step")
    if triton_method and isinstance(topk_ids, torch.Tensor) and not three_step_available(topk_ids.device):
        pytest.skip(f"{method} needs CUDA tensors or TRITON_INTERPRET=1")
    return build_routing_plan(topk_ids, num_experts, method=method, **kwargs)


@pytest.mark.parametrize("case_id", ROUTING_CASE_IDS)
@pytest.mark.parametrize("method", METHODS)
def test_plan_matches_definition(method, case_id):
    topk_ids, num_experts = make_routing_case(case_id)
    topk_ids = topk_ids.to(DEVICE)
    plan = build(topk_ids, num_experts, method)
    assert isinstance(plan, RoutingPlan)
    assert_plan_invariants(plan, topk_ids, num_experts)
    assert_matches_definition(plan, topk_ids, num_experts, method)
    assert_plans_identical(plan, build_routing_plan(topk_ids, num_experts, method="torch"), method)


# The three-step build with many token tiles per expert (a tile holds 8192 cells: 512 tokens x 16
# experts, 1024 x 8 for E <= 8, up to 4096 x 2 for E <= 2). (case id, kind, T, E, K)
MANY_TILE_CASES = [
    ("e6_unused", "unused", 20000, 6, 2),  # 20 tiles of 1024 tokens; the -1 tail spans many tiles
    ("e72_empty_experts", "empty_experts", 9000, 72, 3),  # 18 tiles x 5 expert blocks, E > 64
    ("e1_unused", "unused", 12000, 1, 1),  # 3 tiles of 4096 tokens, one expert
    ("all_on_one_expert_k1", "one_expert", 10000, 24, 1),
    ("k_equals_e", "random", 9000, 4, 4),
    ("all_unused", "all_unused", 9000, 5, 2),
]


@pytest.mark.parametrize("scan", ["three_launches", "small_blocks", "folded", "folded_small_loads"])
@pytest.mark.parametrize("case", MANY_TILE_CASES, ids=[c[0] for c in MANY_TILE_CASES])
def test_three_step_many_tiles(case, scan, monkeypatch):
    """Per-expert tile scans and the expert offsets each scatter program sums itself; with
    ``small_blocks`` both loop over several blocks (4 tile counts, 16 expert totals at a time);
    ``folded``: step (b) inside the scatter (``FOLD_CELLS``), reading the counts in loads of
    ``FOLD_LOAD`` cells (4: a row or less per load with ``folded_small_loads``)."""
    from moeblaze_megatron.kernels import plan_three_step as kernels
    from moeblaze_megatron.kernels.calls import recording_into

    _, kind, num_tokens, num_experts, topk = case
    topk_ids = make_topk_ids(kind, num_tokens, num_experts, topk, torch.Generator().manual_seed(5)).to(DEVICE)
    monkeypatch.setattr(kernels, "FOLD_CELLS", 2**20 if scan.startswith("folded") else 0)
    if scan == "small_blocks":
        monkeypatch.setattr(kernels, "SCAN_BLOCK", 4)
        monkeypatch.setattr(kernels, "TOTALS_BLOCK", 16)
    if scan == "folded_small_loads":
        monkeypatch.setattr(kernels, "FOLD_LOAD", 4)
    launched, launch = [], kernels.launch

    def counted(kernel, *rest):
        if recording_into() is None:  # not the compile prefetch's dry run (on a GPU)
            launched.append(kernel)
        launch(kernel, *rest)

    monkeypatch.setattr(kernels, "launch", counted)
    plan = build(topk_ids, num_experts, "three_step")
    assert (kernels._tile_offsets_kernel in launched) == (not scan.startswith("folded"))
    assert len(launched) == (2 if scan.startswith("folded") else 3)
    assert_plan_invariants(plan, topk_ids, num_experts)
    assert_matches_definition(plan, topk_ids, num_experts)


@pytest.mark.parametrize("fanout", [2, 4])
@pytest.mark.parametrize("case_id", ROUTING_CASE_IDS)
def test_sort_kernel_small_blocks(case_id, fanout, monkeypatch):
    """The sort path's plan kernel with blocks small enough that every case spans many programs:
    32 sorted positions per scatter program, 4 experts per search program, and a 2- or 4-way
    search (31 or 16 levels)."""
    from moeblaze_megatron.kernels import plan_sort

    monkeypatch.setattr(plan_sort, "BLOCK", 32)
    monkeypatch.setattr(plan_sort, "SEARCH_BLOCK_E", 4)
    monkeypatch.setattr(plan_sort, "FANOUT", fanout)
    topk_ids, num_experts = make_routing_case(case_id, seed=4)
    topk_ids = topk_ids.to(DEVICE)
    plan = build(topk_ids, num_experts, "sort")
    assert_matches_definition(plan, topk_ids, num_experts)


# The sort's key type follows E (uint8 up to 255 experts, int16 up to 32767, int32 past it) and the
# unused slot's key is the type's largest value, made by masking the ids in their own type; ids
# narrower than the key are widened first. (E, id dtype): E at each key type's edges, ids of every
# width that can name some of its experts; the expert pool holds the largest id the dtype allows.
KEY_WIDTH_CASES = [
    (E, dtype)
    for E in (255, 256, 32767, 32768)
    for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
]


@pytest.mark.parametrize(
    "num_experts,dtype", KEY_WIDTH_CASES, ids=[f"e{e}-{str(d).split('.')[1]}" for e, d in KEY_WIDTH_CASES]
)
def test_sort_key_widths(num_experts, dtype, generator, monkeypatch):
    from moeblaze_megatron.kernels import plan_sort

    monkeypatch.setattr(plan_sort, "SEARCH_BLOCK_E", 2048)  # fewer interpreted search programs
    top = min(num_experts, torch.iinfo(dtype).max + 1) - 1
    pool = sorted({0, 1, top // 2, top - 1, top})
    topk_ids = random_topk_ids(300, num_experts, 3, generator, experts=pool)
    if dtype != torch.uint8:  # uint8 cannot hold -1
        topk_ids = drop_slots(topk_ids, 0.2, generator)
    topk_ids = topk_ids.to(device=DEVICE, dtype=dtype)
    plan = build(topk_ids, num_experts, "sort")
    assert_matches_definition(plan, topk_ids, num_experts)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
@pytest.mark.parametrize("case_id", ["multi_tile", "unused_slots"])
@pytest.mark.parametrize("method", METHODS)
def test_id_dtypes_give_the_same_plan(method, case_id, dtype):
    topk_ids, num_experts = make_routing_case(case_id, seed=1)
    want = build_routing_plan(topk_ids.to(DEVICE), num_experts, method="torch")
    got = build(topk_ids.to(device=DEVICE, dtype=dtype), num_experts, method)
    assert_plans_identical(got, want, f"{method} {dtype}")


@pytest.mark.parametrize("method", METHODS)
def test_non_contiguous_ids(method, generator):
    wide = make_topk_ids("unused", 700, 20, 6, generator).to(DEVICE)
    topk_ids = wide[:, ::2]  # every other column: a strided view, rows still distinct
    assert not topk_ids.is_contiguous()
    got = build(topk_ids, 20, method)
    assert_plans_identical(got, build_routing_plan(topk_ids.contiguous(), 20, method="torch"), method)


@pytest.mark.parametrize("method", METHODS)
def test_deterministic(method):
    topk_ids, num_experts = make_routing_case("multi_tile", seed=2)
    topk_ids = topk_ids.to(DEVICE)
    first = build(topk_ids, num_experts, method)
    second = build(topk_ids.clone(), num_experts, method)
    assert_plans_identical(first, second, method)


@pytest.mark.parametrize("method", METHODS)
def test_validate_false_gives_the_same_plan_for_valid_ids(method):
    topk_ids, num_experts = make_routing_case("unused_slots", seed=3)
    topk_ids = topk_ids.to(DEVICE)
    assert_plans_identical(
        build(topk_ids, num_experts, method, validate=False),
        build(topk_ids, num_experts, method, validate=True),
        method,
    )


def test_plan_helpers(generator):
    topk_ids = make_topk_ids("unused", 90, 7, 3, generator).to(DEVICE)
    plan = build_routing_plan(topk_ids, 7)
    assert (plan.num_tokens, plan.topk, plan.num_experts) == (90, 3, 7)
    used = topk_ids >= 0
    assert torch.equal(plan.tokens_per_expert.long(), torch.bincount(topk_ids[used], minlength=7))
    probs = torch.rand(90, 3, generator=generator).to(DEVICE)
    permuted = plan.permute_probs(probs)
    pos = plan.token_index_map.long()
    assert torch.equal(permuted[pos[used]], probs[used])
    assert bool((permuted[int(used.sum()):] == 0).all())
    rows = torch.randn(90 * 3, 5, generator=generator).to(DEVICE)
    back = plan.unpermute_rows(rows)
    assert back.shape == (90, 3, 5)
    assert torch.equal(back[used], rows[pos[used]])
    assert bool((back[~used] == 0).all())
    assert_plans_identical(plan.to("cpu"), build_routing_plan(topk_ids.cpu(), 7))


def _set_slot(token, k, value):
    def make(ids):
        ids = ids.clone()
        ids[token, k] = ids[token, 0] if value == "repeat" else value
        return ids

    return make


# (case, make ids from valid int64 [T=10, K=3] ids over E=8, num_experts, error, message pattern)
ERROR_CASES = [
    ("float_ids", lambda ids: ids.float(), 8, TypeError, r"topk_ids must have an integer dtype"),
    ("bool_ids", lambda ids: ids > 2, 8, TypeError, r"topk_ids must have an integer dtype"),
    ("not_a_tensor", lambda ids: ids.tolist(), 8, TypeError, r"topk_ids must be a torch.Tensor"),
    ("one_dim_ids", lambda ids: ids[:, 0], 8, ValueError, r"topk_ids must be 2-D"),
    ("three_dim_ids", lambda ids: ids[None], 8, ValueError, r"topk_ids must be 2-D"),
    ("id_equals_e", _set_slot(4, 1, 8), 8, ValueError, r"topk_ids.*\[0, 8\)"),
    ("id_minus_two", _set_slot(9, 2, -2), 8, ValueError, r"topk_ids.*\[0, 8\)"),
    ("repeated_expert", _set_slot(3, 2, "repeat"), 8, ValueError, r"topk_ids.*same expert"),
    ("k_above_e", lambda ids: ids, 2, ValueError, r"topk_ids has topk=3.*num_experts=2"),
    ("k_zero", lambda ids: ids[:, :0], 8, ValueError, r"topk_ids has topk=0"),
    ("zero_experts", lambda ids: ids, 0, ValueError, r"num_experts must be a positive int"),
    ("negative_experts", lambda ids: ids, -3, ValueError, r"num_experts must be a positive int"),
    ("float_experts", lambda ids: ids, 8.0, ValueError, r"num_experts must be a positive int"),
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "make_ids,num_experts,error,pattern", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_bad_input_names_the_argument(method, make_ids, num_experts, error, pattern, generator):
    topk_ids = make_ids(make_topk_ids("random", 10, 8, 3, generator))
    if isinstance(topk_ids, torch.Tensor):
        topk_ids = topk_ids.to(DEVICE)
    with pytest.raises(error, match=pattern):
        build(topk_ids, num_experts, method)


def test_unknown_method_names_the_argument(generator):
    with pytest.raises(ValueError, match=r"method must be one of"):
        build_routing_plan(make_topk_ids("random", 4, 8, 2, generator).to(DEVICE), 8, method="radix")


def test_three_step_topk_limit(generator):
    """The dense map stores k + 1 in an int8; past that the build must refuse, not wrap around."""
    topk_ids = make_topk_ids("random", 3, 130, 127, generator).to(DEVICE)
    with pytest.raises(ValueError, match=r"topk <= 126.*method='sort'"):
        build(topk_ids, 130, "three_step")
    assert_plan_invariants(build_routing_plan(topk_ids, 130), topk_ids, 130)


M = 2**20
# (T, E, K, what auto runs on the GPU): the build with the lower predicted GPU time (the cost model
# in moeblaze_megatron/routing.py), the sort past the three-step build's MAX_TOPK. The comments give
# the CUDA-graph times (ms, three-step vs sort) of benchmarks/results/2026-11-29-h200-v3.
AUTO_CASES = [
    (0, 8, 2, "three_step"),  # the three-step build's launch floor is below the sort's
    (4096, 8, 2, "three_step"),  # 0.017 vs 0.029
    (4096, 512, 8, "three_step"),  # few tokens, many experts: 0.024 vs 0.041
    (65536, 32, 1, "three_step"),  # 0.019 vs 0.032
    (65536, 64, 1, "sort"),  # 0.028 vs 0.032: the model's miss, by 11%
    (262144, 128, 1, "sort"),  # 0.157 vs 0.038
    (M, 8, 8, "three_step"),  # few experts, many tokens: 0.109 vs 0.307
    (M, 32, 8, "three_step"),  # 0.243 vs 0.369
    (4 * M, 32, 8, "three_step"),  # both grow with T: the same pick
    (M, 64, 8, "sort"),  # 0.445 vs 0.388
    (M, 8, 1, "three_step"),  # 0.049 vs 0.054
    (M, 9, 1, "sort"),  # the dense map's cost passes the sort's at K = 1
    (M, 16, 1, "sort"),  # 0.086 vs 0.056
    (M, 64, 1, "sort"),  # 0.312 vs 0.062
    (M, 512, 1, "sort"),  # 2.40 vs 0.085
    (M, 512, 8, "sort"),  # 3.28 vs 0.509
    (16384, 255, 1, "sort"),  # uint8 keys ...
    (16384, 256, 1, "three_step"),  # ... int16 keys cost the sort 0.012 ms more: 0.028 vs 0.041
    (16384, 512, 1, "sort"),  # 0.046 vs 0.042
    (3, 130, 127, "sort"),  # past the three-step build's MAX_TOPK
    (3, 512, 126, "three_step"),
]


@pytest.mark.parametrize("num_tokens,num_experts,topk,want", AUTO_CASES)
def test_auto_rule_on_the_gpu(num_tokens, num_experts, topk, want):
    assert gpu_routing_method(num_tokens, num_experts, topk) == want


def test_auto_runs_the_torch_path_on_the_cpu(generator):
    assert choose_routing_method(make_topk_ids("random", 4, 8, 2, generator), 8) == "torch"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: a 2**31-cell dense map")
def test_dense_map_beyond_int32_cells():
    """E * T > 2**31: the dense map's cell index e * T + t must not wrap in 32 bits."""
    num_experts, num_tokens = 64, 2**25 + 1000
    first = torch.randint(0, num_experts, (num_tokens,), device="cuda")
    second = (first + torch.randint(1, num_experts, (num_tokens,), device="cuda")) % num_experts
    topk_ids = torch.stack([first, second], dim=1)
    got = build_routing_plan(topk_ids, num_experts, method="three_step", validate=False)
    assert_plans_identical(got, build_routing_plan(topk_ids, num_experts, method="sort"), "three_step")
    assert_plan_invariants(got, topk_ids, num_experts)


@pytest.mark.parametrize("method", ["torch", "sort", "three_step"])
def test_trimmed_plan_keeps_the_used_slots(method, generator):
    """Every method puts the used slots first, so a plan cut to their count is the same plan for
    the op: bitwise the same output and gradients (reference, and the kernels where they run)."""
    topk_ids = drop_slots(random_topk_ids(40, 6, 3, generator), 0.4, generator).to(DEVICE)
    plan = build(topk_ids, 6, method)
    used = int((topk_ids >= 0).sum())
    trimmed = plan.trimmed(used)
    assert trimmed.expert_token_indices.shape == (used,)
    assert torch.equal(trimmed.expert_token_indices, plan.expert_token_indices[:used])
    assert bool((plan.expert_token_indices[used:] == -1).all())
    assert int(plan.expert_token_offsets[-1]) == used
    from moeblaze_megatron import moe_mlp

    x = torch.randn(40, 16, generator=generator).to(DEVICE)
    probs = torch.rand(40, 3, generator=generator).to(DEVICE)
    fc1 = torch.randn(6, 24, 16, generator=generator).to(DEVICE)
    fc2 = torch.randn(6, 16, 12, generator=generator).to(DEVICE)
    backends = ["reference"] + (["triton"] if three_step_available(x.device) else [])
    for backend in backends:
        results = []
        for p in (plan, trimmed):
            leaves = [t.clone().requires_grad_() for t in (x, probs, fc1, fc2)]
            y = moe_mlp(leaves[0], topk_ids, *leaves[1:], "swiglu", plan=p, backend=backend)
            y.backward(torch.ones_like(y))
            results.append([y.detach(), *(t.grad for t in leaves)])
        assert all(torch.equal(a, b) for a, b in zip(*results)), backend
    with pytest.raises(ValueError, match="num_rows must be in"):
        plan.trimmed(40 * 3 + 1)
