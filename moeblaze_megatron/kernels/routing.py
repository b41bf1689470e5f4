"""The atomic-free three-step routing-plan build (MoEBlaze, section 3).

(a) ``_dense_map_kernel``: one program per (token tile, expert block) writes every cell of a dense
    expert-major map ``dense[e, t] = k + 1`` (0: token t did not choose e) exactly once, and the
    number of marked cells of each expert in its tile.
(b) ``_tile_offsets_kernel``: an exclusive prefix sum over those counts, expert-major, gives the
    first slot of each (expert, tile) pair; the first tile of each expert gives its offset.
(c) ``_scatter_kernel``: a scan inside each (expert, tile) row ranks the marked cells; each then
    writes its token id and its slot, once. No atomics, so the plan is deterministic.
Unused slots (id -1) are marked -1 by step (a); step (b) fills the unused tail of
``expert_token_indices`` with -1.

For few tokens the three launches cost more than the work, so ``_one_launch_kernel`` runs the same
three steps in a single launch: each program owns a block of experts, counts every expert's slots
itself (step b needs no barrier between programs then) and ranks and scatters its own experts'
cells tile by tile, the dense map living one token tile at a time in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 512
BLOCK_E = 16
SCAN_BLOCK = 4096
# Up to this many tokens (and 64 experts) one launch beats three (estimated for the H200 from the
# 2026-11-29 sweep, where the three launches took 50-100 us at 4K tokens, launch-bound).
ONE_LAUNCH_MAX_TOKENS = 8192
ONE_LAUNCH_MAX_EXPERTS = 64
# The dense map holds k + 1 in an int8.
MAX_TOPK = 126


@triton.jit
def _dense_map_kernel(
    topk_ids_ptr, dense_ptr, tile_counts_ptr, token_index_map_ptr, token_expert_indices_ptr,
    T, E, num_tiles, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    t_ok = t < T
    e_ok = e < E
    cell = tl.zeros((BLOCK_E, BLOCK_T), dtype=tl.int32)
    for k in tl.static_range(K):
        slot = t.to(tl.int64) * K + k
        ids = tl.load(topk_ids_ptr + slot, mask=t_ok, other=-1).to(tl.int32)
        cell = tl.where(ids[None, :] == e[:, None], k + 1, cell)
        unused = t_ok & (ids < 0) & (pid_e == 0)
        tl.store(token_index_map_ptr + slot, tl.full((BLOCK_T,), -1, tl.int32), mask=unused)
        tl.store(token_expert_indices_ptr + slot, tl.full((BLOCK_T,), -1, tl.int32), mask=unused)
    both = e_ok[:, None] & t_ok[None, :]
    tl.store(dense_ptr + e[:, None].to(tl.int64) * T + t[None, :], cell.to(tl.int8), mask=both)
    count = tl.sum((cell > 0).to(tl.int32), axis=1)
    tl.store(tile_counts_ptr + e * num_tiles + pid_t, count, mask=e_ok)


@triton.jit
def _tile_offsets_kernel(
    tile_counts_ptr, tile_base_ptr, offsets_ptr, expert_token_indices_ptr, n_items, num_tiles, E,
    num_slots, BLOCK: tl.constexpr,
):
    carry = tl.zeros((), dtype=tl.int32)
    for start in range(0, n_items, BLOCK):
        i = start + tl.arange(0, BLOCK)
        ok = i < n_items
        c = tl.load(tile_counts_ptr + i, mask=ok, other=0)
        base = carry + tl.cumsum(c, axis=0) - c
        tl.store(tile_base_ptr + i, base, mask=ok)
        tl.store(offsets_ptr + i // num_tiles, base, mask=ok & (i % num_tiles == 0))
        carry += tl.sum(c, axis=0)
    tl.store(offsets_ptr + E, carry)
    for start in range(carry, num_slots, BLOCK):
        i = start + tl.arange(0, BLOCK)
        tl.store(expert_token_indices_ptr + i, tl.full((BLOCK,), -1, tl.int32), mask=i < num_slots)


@triton.jit
def _scatter_kernel(
    dense_ptr, tile_base_ptr, expert_token_indices_ptr, token_index_map_ptr,
    token_expert_indices_ptr, T, E, num_tiles,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    both = (e < E)[:, None] & (t < T)[None, :]
    cell = tl.load(dense_ptr + e[:, None].to(tl.int64) * T + t[None, :], mask=both, other=0).to(tl.int32)
    marked = cell > 0
    rank = tl.cumsum(marked.to(tl.int32), axis=1)
    base = tl.load(tile_base_ptr + e * num_tiles + pid_t, mask=e < E, other=0)
    pos = base[:, None] + rank - 1
    tl.store(expert_token_indices_ptr + pos, (t[None, :] + 0 * e[:, None]), mask=marked)
    slot = t[None, :].to(tl.int64) * K + (cell - 1)
    tl.store(token_index_map_ptr + slot, pos, mask=marked)
    tl.store(token_expert_indices_ptr + slot, (e[:, None] + 0 * t[None, :]), mask=marked)


@triton.jit
def _one_launch_kernel(
    topk_ids_ptr, offsets_ptr, expert_token_indices_ptr, token_index_map_ptr,
    token_expert_indices_ptr, T, E, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BINS: tl.constexpr,
):
    pid = tl.program_id(0)
    bins = tl.arange(0, BINS)
    counts = tl.zeros((BINS,), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < T
        for k in tl.static_range(K):
            slot = t.to(tl.int64) * K + k
            ids = tl.load(topk_ids_ptr + slot, mask=t_ok, other=-1).to(tl.int32)
            # Unused slots and the padding count in bin E, which no expert owns.
            counts += tl.histogram(tl.where(ids < 0, E, ids), BINS)
            unused = t_ok & (ids < 0) & (pid == 0)
            tl.store(token_index_map_ptr + slot, tl.full((BLOCK_T,), -1, tl.int32), mask=unused)
            tl.store(token_expert_indices_ptr + slot, tl.full((BLOCK_T,), -1, tl.int32), mask=unused)
    counts = tl.where(bins < E, counts, 0)
    starts = tl.cumsum(counts, axis=0) - counts
    total = tl.sum(counts, axis=0)
    tl.store(offsets_ptr + bins, starts, mask=(bins < E) & (pid == 0))
    tl.store(offsets_ptr + E, total, mask=pid == 0)
    for start in range(total, T * K, BLOCK_T):
        i = start + tl.arange(0, BLOCK_T)
        tl.store(expert_token_indices_ptr + i, tl.full((BLOCK_T,), -1, tl.int32), mask=(i < T * K) & (pid == 0))

    e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    run = tl.sum(tl.where(bins[None, :] == e[:, None], starts[None, :], 0), axis=1)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < T
        cell = tl.zeros((BLOCK_E, BLOCK_T), dtype=tl.int32)
        for k in tl.static_range(K):
            ids = tl.load(topk_ids_ptr + t.to(tl.int64) * K + k, mask=t_ok, other=-1).to(tl.int32)
            cell = tl.where(ids[None, :] == e[:, None], k + 1, cell)
        marked = cell > 0
        pos = run[:, None] + tl.cumsum(marked.to(tl.int32), axis=1) - 1
        tl.store(expert_token_indices_ptr + pos, (t[None, :] + 0 * e[:, None]), mask=marked)
        slot = t[None, :].to(tl.int64) * K + (cell - 1)
        tl.store(token_index_map_ptr + slot, pos, mask=marked)
        tl.store(token_expert_indices_ptr + slot, (e[:, None] + 0 * t[None, :]), mask=marked)
        run += tl.sum(marked.to(tl.int32), axis=1)


def three_step_routing_plan(topk_ids: torch.Tensor, num_experts: int):
    """Launch the three steps; returns the plan's four tensors (int32)."""
    num_tokens, topk = topk_ids.shape
    if topk > MAX_TOPK:
        raise ValueError(f"the three-step build supports topk <= {MAX_TOPK}, got {topk}; use method='sort'")
    device = topk_ids.device
    topk_ids = topk_ids.contiguous()
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    expert_token_indices = torch.empty(num_tokens * topk, dtype=torch.int32, device=device)
    token_index_map = torch.empty(num_tokens, topk, dtype=torch.int32, device=device)
    token_expert_indices = torch.empty(num_tokens, topk, dtype=torch.int32, device=device)
    if num_tokens <= ONE_LAUNCH_MAX_TOKENS and num_experts <= ONE_LAUNCH_MAX_EXPERTS:
        _one_launch_kernel[(triton.cdiv(num_experts, BLOCK_E),)](
            topk_ids, offsets, expert_token_indices, token_index_map, token_expert_indices,
            num_tokens, num_experts, K=topk, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E,
            BINS=triton.next_power_of_2(num_experts + 1), num_warps=8,
        )
        return expert_token_indices, offsets, token_expert_indices, token_index_map
    num_tiles = max(triton.cdiv(num_tokens, BLOCK_T), 1)
    dense = torch.empty(num_experts, num_tokens, dtype=torch.int8, device=device)
    tile_counts = torch.empty(num_experts * num_tiles, dtype=torch.int32, device=device)
    tile_base = torch.empty_like(tile_counts)
    grid = (num_tiles, triton.cdiv(num_experts, BLOCK_E))
    _dense_map_kernel[grid](
        topk_ids, dense, tile_counts, token_index_map, token_expert_indices,
        num_tokens, num_experts, num_tiles, K=topk, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E,
    )
    _tile_offsets_kernel[(1,)](
        tile_counts, tile_base, offsets, expert_token_indices, num_experts * num_tiles, num_tiles,
        num_experts, num_tokens * topk, BLOCK=SCAN_BLOCK,
    )
    _scatter_kernel[grid](
        dense, tile_base, expert_token_indices, token_index_map, token_expert_indices,
        num_tokens, num_experts, num_tiles, K=topk, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E,
    )
    return expert_token_indices, offsets, token_expert_indices, token_index_map
