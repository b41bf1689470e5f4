"""fc2's and dX's rows in expert order (A and the output) through ragged TMA descriptors on the
GPU: bitwise the pointer form's result, per-tile and persistent, on the awkward plans of
test_gather_gemm_persistent_gpu.py (moe_testing.GPU_PERSISTENT_CASES: the hardware's clipping at each
tile's expert must stand in for the masks; unused slots' rows stay unwritten)."""

import pytest
import torch

from moe_testing import GPU_PERSISTENT_CASES, gpu_row_config, make_topk_ids, gather_gemm_layer
from moeblaze_megatron import build_routing_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# The configs the autotuner runs with descriptors on the H200: persistent 128x256 at three stages
# (four leave no room for C's store buffer), and 128x256 per tile at four.
@pytest.mark.parametrize("persistent,stages", [(True, 3), (False, 4)], ids=["persistent", "per_tile"])
@pytest.mark.parametrize("case", list(GPU_PERSISTENT_CASES))
def test_rows_through_descriptors_give_the_pointer_bits(case, persistent, stages):
    kind, tokens, E, K, d, h = GPU_PERSISTENT_CASES[case]
    plan = build_routing_plan(make_topk_ids(kind, tokens, E, K, torch.Generator().manual_seed(12)).cuda(), E)
    config = gpu_row_config(128, 256, 8, stages, persistent)
    fc1_config = gpu_row_config(128, 128, 8, stages, persistent)
    # No tokens: nothing for a descriptor to take (tma_rows=True would refuse); both run pointers.
    pointers, descriptors = (gather_gemm_layer(plan, tokens, d, h, "swiglu", torch.bfloat16, 5, config, "cuda",
                                            fc1_config=fc1_config, tma_rows=tma and tokens > 0)
                             for tma in (False, True))
    used = int(plan.expert_token_offsets[-1])
    for want, got in zip(pointers, descriptors):
        assert torch.equal(got[:used], want[:used])
        assert not got[:used].isnan().any()
        assert got[used:].isnan().all()
