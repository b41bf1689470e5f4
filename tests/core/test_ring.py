"""RelayMoE's ring (``parallel/ring.py``) and the framework-neutral alltoall exchange
(``parallel/moe.alltoall_moe``) on the CPU with gloo, P = 2, 3 and 4 processes: each mode
against EP = 1 (``moe_mlp`` over all experts and all ranks' tokens, float64, the same global
weights): output, input, router-probability and every expert's weight gradients, on awkward
routing (an expert with no tokens, every token on one rank's experts, dropped slots, top-1,
top-k = E, ranks with different token counts, a rank with no tokens); bitwise the same on a second
run; and what autograd keeps: the input, the ids and the probabilities, nothing of rows x hidden."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_testing import run_distributed
from moeblaze_megatron import moe_mlp
from moeblaze_megatron.config import RING_CHOICES, RING_MODES
from moeblaze_megatron.parallel.moe import alltoall_moe, ring_moe
from moeblaze_megatron.parallel.ring import shard_row_counts
from moeblaze_megatron.parallel.traffic import MODES, LayerTraffic, choose_mode, hop_bytes, step_bytes
from moeblaze_megatron.routing import build_routing_plan
from moeblaze_megatron.training.audit import saved_bytes_for_backward

D, H = 12, 10
# name -> (experts per rank, top-k, tokens per rank as a function of (rank, P))
CASES = {
    "random": (2, 2, lambda r, p: 7 + 3 * r),
    "empty_expert": (2, 2, lambda r, p: 9),
    "one_rank_experts": (2, 2, lambda r, p: 8),
    "dropped_slots": (3, 3, lambda r, p: 6 + r),
    "top1": (2, 1, lambda r, p: 5 + 2 * r),
    "topk_all": (1, None, lambda r, p: 5),
    "rank_without_tokens": (2, 2, lambda r, p: 0 if r == p - 1 else 6),
}


def _global_problem(case: str, P: int, seed: int):
    """Every rank's tokens, ids and probabilities, and the global weights, in float64."""
    per_rank, topk, tokens = CASES[case]
    E = per_rank * P
    K = E if topk is None else topk
    g = torch.Generator().manual_seed(seed)
    counts = [tokens(r, P) for r in range(P)]
    T = sum(counts)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    scores = torch.rand(T, E, generator=g, dtype=torch.float64)
    if case == "empty_expert":
        scores[:, 1] = -1  # expert 1 (rank 0's second) never chosen
    if case == "one_rank_experts":
        scores[:, per_rank:] -= 2  # every token's experts are rank 0's
    ids = scores.topk(K, dim=1).indices
    probs = torch.rand(T, K, generator=g, dtype=torch.float64)
    if case == "dropped_slots":
        drop = torch.rand(T, K, generator=g) < 0.4
        ids = torch.where(drop, -1, ids)
        probs = torch.where(drop, 0.0, probs)
    fc1 = torch.randn(E, 2 * H, D, generator=g, dtype=torch.float64) * D**-0.5
    fc2 = torch.randn(E, D, H, generator=g, dtype=torch.float64) * H**-0.5
    grad_y = torch.randn(T, D, generator=g, dtype=torch.float64)
    return counts, x, ids, probs, fc1, fc2, grad_y


def _ep1(x, ids, probs, fc1, fc2, grad_y):
    """EP = 1: moe_mlp over every expert and every rank's tokens; (y, grads of x, probs, fc1, fc2)."""
    leaves = [t.clone().requires_grad_() for t in (x, probs, fc1, fc2)]
    y = moe_mlp(leaves[0], ids, leaves[1], leaves[2], leaves[3], "swiglu", build_routing_plan(ids, fc1.shape[0]),
                backend="reference")
    y.backward(grad_y)
    return y.detach(), *(t.grad for t in leaves)


def _ring(mode, group, rank, counts, x, ids, probs, fc1, fc2, grad_y, per_rank, backend="reference", dtype=None):
    lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
    shard = slice(rank * per_rank, (rank + 1) * per_rank)
    dtype = dtype or x.dtype
    leaves = [t.to(dtype).clone().requires_grad_() for t in (x[lo:hi], probs[lo:hi], fc1[shard], fc2[shard])]
    if mode == "alltoall":
        y = alltoall_moe(leaves[0], ids[lo:hi], leaves[1], leaves[2], leaves[3], group, backend=backend)
    else:
        y = ring_moe(leaves[0], ids[lo:hi], leaves[1], leaves[2], leaves[3], group, mode=mode, backend=backend)
    y.backward(grad_y[lo:hi].to(dtype))
    return y.detach(), *(t.grad for t in leaves)


def _ring_worker(rank, world_size, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        group = dist.group.WORLD
        failures = []
        for index, (case, (per_rank, _, _)) in enumerate(CASES.items()):
            counts, x, ids, probs, fc1, fc2, grad_y = _global_problem(case, world_size, seed=index)
            want = _ep1(x, ids, probs, fc1, fc2, grad_y)
            lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
            shard = slice(rank * per_rank, (rank + 1) * per_rank)
            want_mine = (want[0][lo:hi], want[1][lo:hi], want[2][lo:hi], want[3][shard], want[4][shard])
            for mode in ("alltoall", *RING_CHOICES):
                got = _ring(mode, group, rank, counts, x, ids, probs, fc1, fc2, grad_y, per_rank)
                again = _ring(mode, group, rank, counts, x, ids, probs, fc1, fc2, grad_y, per_rank)
                for name, g, w, a in zip(("y", "dx", "dprobs", "dfc1", "dfc2"), got, want_mine, again):
                    if g is None or g.shape != w.shape:
                        failures.append(f"{case}/{mode}/{name}: got {None if g is None else tuple(g.shape)}, "
                                        f"want {tuple(w.shape)}")
                        continue
                    err = ((g - w).norm() / w.norm().clamp(min=1e-300)).item() if w.numel() else 0.0
                    if not torch.isfinite(g).all() or err > 1e-12:
                        failures.append(f"{case}/{mode}/{name}: relative error {err:.3e}")
                    if not torch.equal(g, a):
                        failures.append(f"{case}/{mode}/{name}: a second run differs")
        return failures
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_modes_match_ep1_in_float64(world_size):
    reports = run_distributed(_ring_worker, world_size, timeout=300)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(reports) for f in fs]
    assert not failures, "\n".join(failures)


def _triton_and_audit_worker(rank, world_size, port):
    """The fused kernels (interpreted) on each hop's trimmed plan, in float32; and the bytes each
    ring mode keeps for backward."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        group = dist.group.WORLD
        out = {}
        counts, x, ids, probs, fc1, fc2, grad_y = _global_problem("dropped_slots", world_size, seed=5)
        want = _ep1(x, ids, probs, fc1, fc2, grad_y)
        lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
        shard = slice(rank * 3, (rank + 1) * 3)
        want_mine = (want[0][lo:hi], want[1][lo:hi], want[2][lo:hi], want[3][shard], want[4][shard])
        for mode in RING_MODES:
            got = _ring(mode, group, rank, counts, x, ids, probs, fc1, fc2, grad_y, 3, backend="triton",
                        dtype=torch.float32)
            out[f"{mode}/errors"] = [((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want_mine)]
        # The audit: a larger shape, so that one kept (rows, hidden) tensor would stand out.
        T, d = 64, 32
        g = torch.Generator().manual_seed(rank)
        xa = torch.randn(T, d, generator=g, requires_grad=True)
        ida = torch.rand(T, 4 * world_size, generator=g).topk(4, dim=1).indices
        pa = torch.rand(T, 4, generator=g, requires_grad=True)
        w1 = torch.randn(4, 2 * 16, d, generator=g, requires_grad=True)
        w2 = torch.randn(4, d, 16, generator=g, requires_grad=True)
        for mode in RING_MODES:
            _, saved = saved_bytes_for_backward(
                lambda: ring_moe(xa, ida, pa, w1, w2, group, mode=mode, backend="reference"), [w1, w2])
            out[f"{mode}/saved"] = saved
        out["floor"] = xa.numel() * 4 + ida.numel() * 4 + pa.numel() * 4
        out["x_bytes"] = xa.numel() * 4
        return out
    finally:
        dist.destroy_process_group()


def test_ring_on_the_kernels_and_what_it_keeps():
    for report in run_distributed(_triton_and_audit_worker, 2, timeout=600):
        for mode in RING_MODES:
            errors = report[f"{mode}/errors"]
            assert max(errors) < 1e-5, (mode, errors)
            # The input, the int32 ids and the probabilities, nothing else: one kept (rows, hidden)
            # tensor (T*K*d*4 = 32 KiB here) would be more than three times that floor.
            assert report["x_bytes"] <= report[f"{mode}/saved"] <= report["floor"], (mode, report)


def _bf16_worker(rank, world_size, port):
    """Each ring in bfloat16 against the float64 EP = 1 result, beside the same op at EP = 1 in
    bfloat16 (the rounding any bf16 run has)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        counts, x, ids, probs, fc1, fc2, grad_y = _global_problem("random", world_size, seed=11)
        # The oracle takes the bf16 inputs' values: the errors are the computation's alone.
        x, probs, fc1, fc2, grad_y = (t.bfloat16().double() for t in (x, probs, fc1, fc2, grad_y))
        want = _ep1(x, ids, probs, fc1, fc2, grad_y)
        bf16 = _ep1(x.bfloat16(), ids, *(t.bfloat16() for t in (probs, fc1, fc2, grad_y)))
        lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
        shard = slice(rank * 2, (rank + 1) * 2)

        def mine(result):
            return (result[0][lo:hi], result[1][lo:hi], result[2][lo:hi], result[3][shard], result[4][shard])

        def err(g, w):
            return ((g.double() - w).norm() / w.norm()).item()

        out = {"ep1_bf16": [err(g, w) for g, w in zip(mine(bf16), mine(want))]}
        for mode in RING_MODES:
            got = _ring(mode, dist.group.WORLD, rank, counts, x, ids, probs, fc1, fc2, grad_y, 2,
                        dtype=torch.bfloat16)
            assert all(g.dtype == torch.bfloat16 for g in got)
            out[mode] = [err(g, w) for g, w in zip(got, mine(want))]
        return out
    finally:
        dist.destroy_process_group()


def test_ring_in_bfloat16():
    for report in run_distributed(_bf16_worker, 3, timeout=300):
        for mode in RING_MODES:
            for name, got, ep1 in zip(("y", "dx", "dprobs", "dfc1", "dfc2"), report[mode], report["ep1_bf16"]):
                # bf16 keeps 8 bits: a few roundings of 2^-9 each, and no worse than twice EP = 1's.
                assert got < 2**-6 and got <= 2 * ep1 + 2**-9, (mode, name, got, ep1)


def test_shard_row_counts():
    ids = torch.tensor([[0, 5], [3, -1], [7, 6], [-1, -1]])
    assert shard_row_counts(ids, 2, 4).tolist() == [1, 1, 1, 2]


def test_bytes_per_step_and_the_choice():
    # Qwen3-30B-A3B-like at P = 8: fine-grained experts, 16 per rank.
    shapes = dict(hidden=2048, topk=8, experts_per_rank=16, ranks=8, weight_numel=16 * 3 * 768 * 2048)
    few, many = LayerTraffic(tokens=1024, **shapes), LayerTraffic(tokens=65536, **shapes)
    # By hand: a weight shard is 151 MB in bf16; its float32 gradient twice that.
    W = 16 * 3 * 768 * 2048
    assert step_bytes("expert", few) == (7 * 2 * W, 7 * 2 * W + 8 * 4 * W)
    block = 1024 * (2048 * 2 + 8 * (4 + 4))
    assert step_bytes("token", few)[0] == 7 * block + 8 * 1024 * 2048 * 4
    rows = 1024 * 7 * (1 - (7 / 8) ** 8)
    assert step_bytes("alltoall", few)[0] == pytest.approx(rows * (2 * 2048 * 2 + 8 * (4 + 4)))
    # Few tokens: the token blocks are cheaper than the weights; many: the weights travel.
    assert choose_mode(RING_MODES, few) == "token" and choose_mode(RING_MODES, many) == "expert"
    # The all-to-all sends each token to fewer than P - 1 ranks: cheaper than the token ring always,
    # and than the expert ring until the tokens outweigh the weights.
    assert choose_mode(MODES, few) == "alltoall" and choose_mode(MODES, many) == "expert"
    # The same per-hop bytes the ring's hop sends.
    assert hop_bytes("expert", few)[0] == 2 * W
    with pytest.raises(ValueError, match="mode must be one of"):
        hop_bytes("ring", few)
    with pytest.raises(ValueError, match="candidates must be"):
        choose_mode(["ring"], few)


def test_ring_refuses_bad_arguments():
    x = torch.randn(4, D)
    with pytest.raises(ValueError, match="mode must be one of"):
        ring_moe(x, torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 2), torch.randn(1, 2 * H, D),
                 torch.randn(1, D, H), None, mode="weights")
    with pytest.raises(ValueError, match="topk_probs has shape"):
        ring_moe(x, torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 3), torch.randn(2, 2 * H, D),
                 torch.randn(2, D, H), None, mode="expert")
