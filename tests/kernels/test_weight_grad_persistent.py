"""The weight-gradient kernel's persistent launch (one program per multiprocessor walking its work
items in one flat loop of reduction steps, ``PERSISTENT``): the one-program-per-tile launch's bits
under the interpreter, and a float64 reduction's values, on plans with experts that get no rows
(their tiles must be zeros), unused slots, every token on the same K experts, K = E and no tokens
at all; more work items than programs, so each program runs several."""

from __future__ import annotations

import pytest
import torch
import triton

from moe_testing import PERSISTENT_CASES, make_topk_ids, rel_error, weight_grad_reference
from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels.configs import sm_count
from moeblaze_megatron.kernels.tuning import weight_grad_with


def _config(persistent):
    return triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "PERSISTENT": persistent}, num_warps=4)


@pytest.mark.parametrize("case", list(PERSISTENT_CASES))
@pytest.mark.parametrize("gathered,tma", [("a", True), ("b", True), ("b", False)])
def test_persistent_launch_gives_the_per_tile_launchs_bits(case, gathered, tma):
    kind, tokens, E, K = PERSISTENT_CASES[case]
    gen = torch.Generator().manual_seed(hash((case, gathered, tma)) % 2**31)
    plan = build_routing_plan(make_topk_ids(kind, tokens, E, K, gen), E)
    M, N = 40, 24  # neither a multiple of the 16-wide tile
    token_rows = torch.randn(tokens, M if gathered == "a" else N, generator=gen).to(torch.bfloat16)
    ordered = torch.randn(tokens * K, N if gathered == "a" else M, generator=gen).to(torch.bfloat16)
    a, b = (token_rows, ordered) if gathered == "a" else (ordered, token_rows)
    outs = []
    for persistent in (False, True):
        out = torch.full((E, M, N), float("nan"), dtype=torch.bfloat16)
        weight_grad_with(_config(persistent), a, b, out, plan, gather_a=gathered == "a", gather_b=gathered == "b",
                         tma=tma)
        outs.append(out)
    assert -(-M // 16) * -(-N // 16) * E > sm_count(torch.device("cpu"))  # programs loop over work items
    assert torch.equal(outs[1], outs[0])
    expected = weight_grad_reference(a, b, plan, gathered)
    assert not outs[1].isnan().any()  # every tile written, an expert without rows as zeros
    assert rel_error(outs[1], expected) < 2e-2
    empty = plan.expert_token_offsets.diff() == 0
    assert torch.equal(outs[1][empty], torch.zeros_like(outs[1][empty]))


def test_persistent_programs_share_out_uneven_experts():
    # One expert takes most rows: each program's step count differs, and the flat loop must end
    # exactly where its last item's rows do (bits against the per-tile launch).
    gen = torch.Generator().manual_seed(3)
    T, E, K, M, N = 90, 7, 2, 48, 32
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    ids[:70, 0] = 4
    ids[:70, 1] = torch.where(ids[:70, 1] == 4, 5, ids[:70, 1])
    plan = build_routing_plan(ids, E)
    x = torch.randn(T, N, generator=gen)
    grad = torch.randn(T * K, M, generator=gen)
    outs = []
    for persistent in (False, True):
        out = torch.full((E, M, N), float("nan"))
        weight_grad_with(_config(persistent), grad, x, out, plan, gather_a=False, gather_b=True)
        outs.append(out)
    assert torch.equal(outs[1], outs[0])
