"""The weight-gradient kernel's persistent configs on the GPU: each gives the bits of the same
tile launched one program per tile, with the expert-order operand through its ragged TMA
descriptor as the layer runs it, both orientations (dW1: the token rows gathered as B; dW2: as A),
on the awkward plans of tests/kernels/test_weight_grad_persistent.py at GPU size
(moe_testing.GPU_PERSISTENT_CASES: experts without rows, unused slots, every token on the same
experts, K = E, no tokens), the random one with more work items than multiprocessors."""

import pytest
import torch
import triton

from moe_testing import GPU_PERSISTENT_CASES, make_topk_ids, rel_error, weight_grad_reference
from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels.configs import sm_count
from moeblaze_megatron.kernels.tuning import weight_grad_with

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the persistent entries of the autotuning list.
TILES = [(256, 128, 32, 8, 8), (128, 256, 64, 8, 5)]


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("case", list(GPU_PERSISTENT_CASES))
@pytest.mark.parametrize("gathered", ["a", "b"])
def test_persistent_configs_give_the_per_tile_bits(tiles, case, gathered):
    kind, tokens, E, K, d, h = GPU_PERSISTENT_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(hash((case, gathered)) % 2**31)
    plan = build_routing_plan(make_topk_ids(kind, tokens, E, K, torch.Generator().manual_seed(5)).cuda(), E)
    # dW1-like (b gathered: [E, 2h, d]) and dW2-like (a gathered: [E, d, h]).
    M, N = (2 * h, d) if gathered == "b" else (d, h)
    token_rows = torch.randn(tokens, N if gathered == "b" else M, device="cuda", generator=gen).to(torch.bfloat16)
    ordered = torch.randn(tokens * K, M if gathered == "b" else N, device="cuda", generator=gen).to(torch.bfloat16)
    a, b = (ordered, token_rows) if gathered == "b" else (token_rows, ordered)
    bm, bn, bk, warps, stages = tiles
    outs = []
    for persistent in (False, True):
        config = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PERSISTENT": persistent},
                               num_warps=warps, num_stages=stages)
        out = torch.full((E, M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        weight_grad_with(config, a, b, out, plan, gather_a=gathered == "a", gather_b=gathered == "b", tma=True)
        outs.append(out)
    if case == "random":
        assert -(-M // bm) * -(-N // bn) * E > sm_count(out.device)  # programs loop over work items
    assert torch.equal(outs[1], outs[0])
    assert not outs[1].isnan().any()
    expected = weight_grad_reference(a, b, plan, gathered)
    assert rel_error(outs[1], expected) < 1e-2
