"""The row GEMM's persistent launch (one program per multiprocessor looping over the row tiles,
``PERSISTENT``): every epilogue gives the one-program-per-tile launch's bits under the
interpreter, on plans with experts that get no rows, unused slots (their rows must stay
unwritten), every token on the same K experts, K = E and no tokens at all; fewer programs than tiles, so
each program runs several."""

from __future__ import annotations

import pytest
import torch
import triton

from conftest import make_topk_ids
from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels import expert_gemm as eg


def _config(persistent):
    return triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "PERSISTENT": persistent},
                         num_warps=4)


def _layer(plan, tokens, activation, dtype, gen, persistent):
    """fc1 with the activation, fc2, dH with the activation backward and dX, as the layer runs them
    (the row-order GEMMs through the kernel), outputs poisoned first."""
    E = plan.num_experts
    d, h = 40, 24  # neither a multiple of the 16-wide tile
    width = 2 * h if activation == "swiglu" else h
    g = torch.Generator().manual_seed(gen)
    x, dy = torch.randn(tokens, d, generator=g).to(dtype), torch.randn(tokens, d, generator=g).to(dtype)
    fc1 = (torch.randn(E, width, d, generator=g) * d**-0.5).to(dtype)
    fc2 = (torch.randn(E, d, h, generator=g) * h**-0.5).to(dtype)
    rows = plan.expert_token_indices.shape[0]
    probs = torch.rand(rows, generator=g).to(dtype)
    nan = lambda *shape: torch.full(shape, float("nan"), dtype=dtype)  # noqa: E731
    pre, hid, out2, hs, dx = nan(rows, width), nan(rows, h), nan(rows, d), nan(rows, h), nan(rows, d)
    kw = dict(plan=plan, config=_config(persistent))
    eg.row_gemm(x, fc1, hid, transpose_weight=True, epilogue=eg.EPI_ACT_FWD, activation=activation, pre=pre,
                n=h, **kw)
    eg.row_gemm(hid, fc2, out2, transpose_weight=True, gather_a=False, n=d, **kw)
    dpre = pre.clone()
    ds = torch.full((rows, eg.row_gemm_ds_tiles(h)), float("nan"))
    eg.row_gemm(dy, fc2, hs, transpose_weight=False, epilogue=eg.EPI_ACT_BWD, activation=activation, pre=dpre,
                probs_sorted=probs, ds_partial=ds, n=h, **kw)
    eg.row_gemm(dpre, fc1, dx, transpose_weight=False, gather_a=False, n=d, **kw)
    return pre, hid, out2, hs, dpre, ds, dx


# (kind, T, E, K): small enough for the interpreter, each with more row tiles than programs.
CASES = {
    "random": ("random", 37, 8, 2),
    "empty_experts": ("empty_experts", 40, 16, 2),
    "all_on_same_k_experts": ("one_expert", 30, 8, 3),
    "k_equals_e": ("random", 20, 6, 6),
    "unused_slots": ("unused", 40, 12, 3),
    "no_tokens": ("random", 0, 8, 2),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("activation,dtype", [("swiglu", torch.bfloat16), ("gelu", torch.float32)])
def test_persistent_launch_gives_the_per_tile_launchs_bits(case, activation, dtype):
    kind, tokens, E, K = CASES[case]
    topk_ids = make_topk_ids(kind, tokens, E, K, torch.Generator().manual_seed(7))
    plan = build_routing_plan(topk_ids, E)
    gen = hash((case, activation)) % 2**31
    per_tile = _layer(plan, tokens, activation, dtype, gen, persistent=False)
    persistent = _layer(plan, tokens, activation, dtype, gen, persistent=True)
    used = int(plan.expert_token_offsets[-1])
    row_tiles = sum(-(-n // 16) for n in plan.expert_token_offsets.diff().tolist())
    assert used == 0 or row_tiles > eg._sm_count(torch.device("cpu"))  # programs loop over tiles
    for want, got in zip(per_tile, persistent):
        assert torch.equal(got[:used], want[:used])
        assert not got[:used].isnan().any()
        assert got[used:].isnan().all()  # unused slots' rows are not written

