"""The row GEMM's persistent configs on the GPU: each gives the bits of the same tiles launched one
program per tile, for every epilogue (fc1 with the activation, fc2, dH with the activation
backward, dX), weights through TMA as the autotuner runs them, on plans with more row tiles than
multiprocessors and the awkward routings of tests/test_row_gemm_persistent.py. (tests/gpu runs
one per-tile config for everything else, MOEBLAZE_AUTOTUNE=0.)"""

import pytest
import torch
import triton

from conftest import make_topk_ids, row_gemm_layer
from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels import expert_gemm as eg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The persistent 128x256 entry of expert_gemm's autotuning list (BLOCK_M, BLOCK_N, warps,
# stages), and its 128-wide twin for the SwiGLU forward.
TILES = [(128, 256, 8, 4)]

# (kind, T, E, K, d, h): d and h multiples of 8, not of 16 nor of the tiles. All slot counts
# T*K multiples of 16 and all E below 16, so Triton's argument specialization compiles each
# kernel once for every case.
CASES = {
    "random": ("random", 9000, 12, 4, 520, 392),
    "empty_experts": ("empty_experts", 6000, 15, 2, 136, 264),
    "all_on_same_k_experts": ("one_expert", 4000, 8, 3, 264, 264),
    "k_equals_e": ("random", 3000, 6, 6, 136, 520),
    "unused_slots": ("unused", 7000, 12, 8, 264, 136),
    "no_tokens": ("random", 0, 8, 2, 264, 136),
}


def _config(bm, bn, warps, stages, persistent):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8, "PERSISTENT": persistent},
                         num_warps=warps, num_stages=stages)


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("activation,dtype", [("swiglu", torch.bfloat16), ("gelu", torch.float16)])
def test_persistent_configs_give_the_per_tile_bits(tiles, case, activation, dtype):
    kind, tokens, E, K, d, h = CASES[case]
    topk_ids = make_topk_ids(kind, tokens, E, K, torch.Generator().manual_seed(11)).cuda()
    plan = build_routing_plan(topk_ids, E)
    seed = hash((case, activation)) % 2**31
    # The SwiGLU forward runs at most 128 columns wide (both halves of the tile live at once).
    fc1_tiles = (tiles[0], min(tiles[1], 128), *tiles[2:]) if activation == "swiglu" else tiles
    outputs = [row_gemm_layer(plan, tokens, d, h, activation, dtype, seed, _config(*tiles, persistent), "cuda",
                              fc1_config=_config(*fc1_tiles, persistent))
               for persistent in (False, True)]
    per_tile, persistent = outputs
    used = int(plan.expert_token_offsets[-1])
    row_tiles = sum(-(-n // tiles[0]) for n in plan.expert_token_offsets.diff().tolist())
    assert used == 0 or row_tiles * -(-h // tiles[1]) > eg._sm_count(topk_ids.device)  # programs loop
    for want, got in zip(per_tile, persistent):
        assert torch.equal(got[:used], want[:used])
        assert not got[:used].isnan().any()
        assert got[used:].isnan().all()  # unused slots' rows are not written
