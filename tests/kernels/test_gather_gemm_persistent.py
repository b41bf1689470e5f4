"""The gather GEMM's persistent launch (one program per multiprocessor looping over the row tiles,
``PERSISTENT``): every epilogue gives the one-program-per-tile launch's bits under the
interpreter, on plans with experts that get no rows, unused slots (their rows must stay
unwritten), every token on the same K experts, K = E and no tokens at all; fewer programs than tiles, so
each program runs several."""

from __future__ import annotations

import pytest
import torch
import triton

from moe_testing import PERSISTENT_CASES, make_topk_ids, gather_gemm_layer
from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels.configs import sm_count


def _config(persistent):
    return triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "PERSISTENT": persistent},
                         num_warps=4)


@pytest.mark.parametrize("case", list(PERSISTENT_CASES))
@pytest.mark.parametrize("activation,dtype", [("swiglu", torch.bfloat16), ("gelu", torch.float32)])
def test_persistent_launch_gives_the_per_tile_launchs_bits(case, activation, dtype):
    kind, tokens, E, K = PERSISTENT_CASES[case]
    topk_ids = make_topk_ids(kind, tokens, E, K, torch.Generator().manual_seed(7))
    plan = build_routing_plan(topk_ids, E)
    gen = hash((case, activation)) % 2**31
    # d = 40, h = 24: neither a multiple of the 16-wide tile.
    per_tile = gather_gemm_layer(plan, tokens, 40, 24, activation, dtype, gen, _config(False))
    persistent = gather_gemm_layer(plan, tokens, 40, 24, activation, dtype, gen, _config(True))
    used = int(plan.expert_token_offsets[-1])
    row_tiles = sum(-(-n // 16) for n in plan.expert_token_offsets.diff().tolist())
    assert used == 0 or row_tiles > sm_count(torch.device("cpu"))  # programs loop over tiles
    for want, got in zip(per_tile, persistent):
        assert torch.equal(got[:used], want[:used])
        assert not got[:used].isnan().any()
        assert got[used:].isnan().all()  # unused slots' rows are not written

