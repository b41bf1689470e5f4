"""build_routing_plan: every method gives the plan its definition fixes, on random and adversarial
routing; ids of every integer width; clear errors; determinism."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DEVICE,
    PLAN_FIELDS,
    ROUTING_CASE_IDS,
    assert_plan_invariants,
    assert_plans_identical,
    expected_plan,
    make_routing_case,
    make_topk_ids,
    three_step_available,
)

from moeblaze_megatron import RoutingPlan, build_routing_plan

# "three_step_multi" is the three-step build forced onto its three-launch path, which it takes
# only past ONE_LAUNCH_MAX_TOKENS tokens or ONE_LAUNCH_MAX_EXPERTS experts otherwise.
METHODS = ["torch", "sort", "three_step", "three_step_multi", "auto"]


def build(topk_ids, num_experts, method, **kwargs):
    if method.startswith("three_step") and isinstance(topk_ids, torch.Tensor) and not three_step_available(topk_ids.device):
        pytest.skip("three_step needs CUDA tensors or TRITON_INTERPRET=1")
    if method != "three_step_multi":
        return build_routing_plan(topk_ids, num_experts, method=method, **kwargs)
    from moeblaze_megatron.kernels import routing as kernels

    saved = kernels.ONE_LAUNCH_MAX_TOKENS
    kernels.ONE_LAUNCH_MAX_TOKENS = -1
    try:
        return build_routing_plan(topk_ids, num_experts, method="three_step", **kwargs)
    finally:
        kernels.ONE_LAUNCH_MAX_TOKENS = saved


@pytest.mark.parametrize("case_id", ROUTING_CASE_IDS)
@pytest.mark.parametrize("method", METHODS)
def test_plan_matches_definition(method, case_id):
    topk_ids, num_experts = make_routing_case(case_id)
    topk_ids = topk_ids.to(DEVICE)
    plan = build(topk_ids, num_experts, method)
    assert isinstance(plan, RoutingPlan)
    assert_plan_invariants(plan, topk_ids, num_experts)
    want = expected_plan(topk_ids.cpu(), num_experts)
    for name in PLAN_FIELDS:
        assert getattr(plan, name).tolist() == want[name], f"{method}: {name} differs from the definition"
    assert_plans_identical(plan, build_routing_plan(topk_ids, num_experts, method="torch"), method)


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
