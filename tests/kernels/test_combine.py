"""The combine kernel (per-token sum of expert-order rows) and its router-probability side
outputs, against float64 sums over the plan: weighted and unweighted, unused slots, K = 1 and
K = E, widths and token counts that are not multiples of the tile."""

from __future__ import annotations

import pytest
import torch

from moe_testing import DEVICE, REL_TOL, make_topk_ids
from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels.combine import BLOCK_D, BLOCK_T, combine

CASES = [  # kind, T, E, K, D
    ("random", 2 * BLOCK_T + 5, 6, 2, BLOCK_D + 24),
    ("unused", 47, 5, 3, 40),
    ("one_expert", 33, 4, 1, 16),
    ("random", 19, 4, 4, 72),  # K = E
    ("all_unused", 9, 3, 2, 8),
]


def rel_error(got, want):
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()


def _problem(kind, T, E, K, D, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = make_topk_ids(kind, T, E, K, gen).to(DEVICE)
    plan = build_routing_plan(ids, E)
    rows = torch.randn(T * K, D, generator=gen).to(dtype).to(DEVICE)
    probs = torch.rand(T, K, generator=gen).to(dtype).to(DEVICE)
    return ids, plan, rows, probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,T,E,K,D", CASES)
def test_weighted_combine_and_probs_in_expert_order(kind, T, E, K, D, dtype):
    ids, plan, rows, probs = _problem(kind, T, E, K, D, dtype, seed=hash((kind, T, str(dtype))) % 2**31)
    used = ids >= 0
    pos = plan.token_index_map.long()
    probs_sorted = torch.full((T * K,), float("nan"), dtype=dtype, device=DEVICE)
    y = combine(rows, plan.token_index_map, probs, dtype, probs_sorted=probs_sorted)
    gathered = rows.double()[pos.clamp(min=0)] * (probs.double() * used)[..., None]
    want = gathered.sum(dim=1)
    assert y.dtype == dtype and y.shape == (T, D)
    if used.any():
        assert rel_error(y, want) < REL_TOL[dtype]
    else:
        assert bool((y == 0).all())
    # Every used slot's probability lands, unchanged, on its row; the rows past them are untouched.
    assert torch.equal(probs_sorted[pos[used]], probs[used])
    assert bool(probs_sorted[int(used.sum()):].isnan().all())


@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,T,E,K,D", CASES)
def test_unweighted_combine_and_probability_gradient(kind, T, E, K, D, probs_dtype):
    ids, plan, rows, _ = _problem(kind, T, E, K, D, torch.bfloat16, seed=hash((kind, T, D)) % 2**31)
    gen = torch.Generator().manual_seed(T * 31 + D)
    used = ids >= 0
    pos = plan.token_index_map.long()
    tiles = 3  # not a power of two: the kernel masks its pow2 block
    ds = torch.randn(T * K, tiles, generator=gen).to(DEVICE)
    ds[int(used.sum()):] = float("nan")  # rows of no used slot are never written by the epilogue
    grad_probs = torch.full((T, K), float("nan"), dtype=probs_dtype, device=DEVICE)
    y = combine(rows, plan.token_index_map, None, torch.bfloat16, ds_partial=ds, grad_probs=grad_probs)
    want = (rows.double()[pos.clamp(min=0)] * used[..., None]).sum(dim=1)
    if used.any():
        assert rel_error(y, want) < REL_TOL[torch.bfloat16]
    want_probs = torch.where(used, ds.double()[pos.clamp(min=0)].sum(dim=-1), 0.0)
    assert grad_probs.dtype == probs_dtype and bool(grad_probs.isfinite().all())
    assert bool((grad_probs[~used] == 0).all())
    if used.any():
        assert rel_error(grad_probs[used], want_probs[used]) < REL_TOL[probs_dtype]


def test_side_outputs_are_deterministic():
    ids, plan, rows, probs = _problem("random", 70, 5, 3, 48, torch.float32, seed=5)
    ds = torch.randn(70 * 3, 7, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    runs = []
    for _ in range(2):
        grad_probs = torch.empty(70, 3, device=DEVICE)
        y = combine(rows, plan.token_index_map, None, torch.float32, ds_partial=ds, grad_probs=grad_probs)
        runs.append((y, grad_probs))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(probs=None, probs_sorted=True), "probs_sorted needs probs"),
    (dict(probs=None, ds_partial=True), "ds_partial and grad_probs come together"),
    (dict(probs=True, probs_sorted=True, ds_partial=True, grad_probs=True), "one of probs_sorted and grad_probs"),
])
def test_bad_side_output_combinations_name_the_argument(kwargs, pattern):
    _, plan, rows, probs = _problem("random", 8, 3, 2, 8, torch.float32, seed=1)
    ds = torch.zeros(16, 2, device=DEVICE)
    given = dict(probs=probs, probs_sorted=torch.empty(16, device=DEVICE), ds_partial=ds,
                 grad_probs=torch.empty(8, 2, device=DEVICE))
    call = {k: given[k] if v is True else v for k, v in kwargs.items()}
    probs_arg = call.pop("probs")
    with pytest.raises(ValueError, match=pattern):
        combine(rows, plan.token_index_map, probs_arg, torch.float32, **call)
