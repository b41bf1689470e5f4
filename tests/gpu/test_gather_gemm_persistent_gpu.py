"""The gather GEMM's persistent configs on the GPU: each gives the bits of the same tiles launched one
program per tile, for every epilogue (fc1 with the activation, fc2, dH with the activation
backward, dX), weights through TMA as the autotuner runs them, on plans with more row tiles than
multiprocessors and the awkward routings of tests/kernels/test_gather_gemm_persistent.py (at GPU size:
moe_testing.GPU_PERSISTENT_CASES). (tests/gpu runs one per-tile config for everything else,
MOEBLAZE_AUTOTUNE=0.)"""

import pytest
import torch

from moe_testing import GPU_PERSISTENT_CASES, gpu_row_config, make_topk_ids, gather_gemm_layer
from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels.configs import sm_count

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The persistent 128x256 entry of the gather GEMM's autotuning list (BLOCK_M, BLOCK_N, warps,
# stages), and its 128-wide twin for the SwiGLU forward.
TILES = [(128, 256, 8, 4)]


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("case", list(GPU_PERSISTENT_CASES))
@pytest.mark.parametrize("activation,dtype", [("swiglu", torch.bfloat16), ("gelu", torch.float16)])
def test_persistent_configs_give_the_per_tile_bits(tiles, case, activation, dtype):
    kind, tokens, E, K, d, h = GPU_PERSISTENT_CASES[case]
    topk_ids = make_topk_ids(kind, tokens, E, K, torch.Generator().manual_seed(11)).cuda()
    plan = build_routing_plan(topk_ids, E)
    seed = hash((case, activation)) % 2**31
    # The SwiGLU forward runs at most 128 columns wide (both halves of the tile live at once).
    fc1_tiles = (tiles[0], min(tiles[1], 128), *tiles[2:]) if activation == "swiglu" else tiles
    outputs = [gather_gemm_layer(plan, tokens, d, h, activation, dtype, seed, gpu_row_config(*tiles, persistent),
                              "cuda", fc1_config=gpu_row_config(*fc1_tiles, persistent))
               for persistent in (False, True)]
    per_tile, persistent = outputs
    used = int(plan.expert_token_offsets[-1])
    row_tiles = sum(-(-n // tiles[0]) for n in plan.expert_token_offsets.diff().tolist())
    assert used == 0 or row_tiles * -(-h // tiles[1]) > sm_count(topk_ids.device)  # programs loop
    for want, got in zip(per_tile, persistent):
        assert torch.equal(got[:used], want[:used])
        assert not got[:used].isnan().any()
        assert got[used:].isnan().all()  # unused slots' rows are not written
