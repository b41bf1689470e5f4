"""The atomic-free three-step routing-plan build (MoEBlaze, section 3).

(a) ``_dense_map_kernel``: one program per (token tile, expert block) writes every cell of a dense
    expert-major map ``dense[e, t] = k + 1`` (0: token t did not choose e) exactly once, and the
    number of marked cells of each expert in its tile.
(b) ``_tile_offsets_kernel``: one program per expert turns that expert's tile counts into
    exclusive prefix sums (the first slot of each tile, counted from the expert's own start) and
    its total.
(c) ``_scatter_kernel``: each program adds its experts' start, an exclusive prefix sum over the E
    totals that it computes itself, then a scan inside each (expert, tile) row ranks the marked
    cells; each writes its token id and its slot, once. No atomics, so the plan is deterministic.
Unused slots (id -1) are marked -1 by step (a). Step (c) also writes ``expert_token_offsets``
(from the programs of the first tile) and fills the unused tail of ``expert_token_indices`` with -1:
each program of the first expert block fills the part of the tail that lies in its tile's slots.

Why step (b) is split this way: one prefix sum over all E * num_tiles counts must run in a single
program (programs have no barrier without atomics), and that one sequential pass over E * num_tiles
counts made the build no faster than an argsort at many experts (benchmarks/notes/routing-plan.md,
"Step (b) runs per expert, not as one prefix sum"). The scan
over tiles is independent per expert, so it runs as E programs of num_tiles counts each (one
4K-wide block up to T = 2M); what still crosses experts is a prefix over only E totals, which
every scatter program recomputes from L2 for less than a fourth launch would cost. Likewise the
-1 tail (up to T*K slots) is filled by many programs, not by one. Small plans (at most
FOLD_CELLS tile counts, E * num_tiles) skip step (b): each scatter program reads all the counts
and scans what it needs itself, one launch fewer.

Tiles hold BLOCK_E x BLOCK_T = 8192 cells; below 16 experts the expert block narrows to the expert
count rounded up to a power of two (at least 2) and the token tile widens, so fewer lanes idle
(E = 8 used half of a 16-expert block). The grid runs the expert blocks of a tile next to each
other, so a tile's ids, read once per expert block, come from L2 after the first read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch, next_pow2

BLOCK_T = 512
BLOCK_E = 16
# Cells of one (expert block, token tile) program.
TILE_CELLS = BLOCK_E * BLOCK_T
# Tile counts one step-(b) program scans at a time, and expert totals one step-(c) program sums at a
# time (both loop past them).
SCAN_BLOCK = 4096
TOTALS_BLOCK = 1024
# Step (b) folded into (c) for plans of at most this many tile counts (E * num_tiles; every shape
# of bench_layer.py): each scatter program then reads all the counts itself (32 KB at most, from
# L2), which costs the GPU about what the launch it saves does, and saves that launch's host time
# (the GPU waits on the host before a layer's first GEMM). FOLD_LOAD: counts per load of the fold
# (whole rows of the counts' power-of-two width, a power of two).
FOLD_CELLS = 8192
FOLD_LOAD = 4096
# The dense map holds k + 1 in an int8.
MAX_TOPK = 126


@triton.jit
def _tile_of_program(num_eblocks):
    """(token tile, expert block) of this program: the expert blocks of a tile are adjacent."""
    pid = tl.program_id(0)
    return pid // num_eblocks, pid % num_eblocks


@triton.jit
def _dense_map_kernel(
    topk_ids_ptr, dense_ptr, tile_counts_ptr, token_index_map_ptr, token_expert_indices_ptr,
    T, E, num_tiles, num_eblocks, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid_t, pid_e = _tile_of_program(num_eblocks)
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
def _tile_offsets_kernel(tile_counts_ptr, expert_totals_ptr, num_tiles, BLOCK: tl.constexpr):
    """Program e: its tile counts become their exclusive prefix sums, in place; its total."""
    row = tile_counts_ptr + tl.program_id(0).to(tl.int64) * num_tiles
    carry = tl.zeros((), dtype=tl.int32)
    for start in range(0, num_tiles, BLOCK):
        i = start + tl.arange(0, BLOCK)
        ok = i < num_tiles
        c = tl.load(row + i, mask=ok, other=0)
        tl.store(row + i, carry + tl.cumsum(c, axis=0) - c, mask=ok)
        carry += tl.sum(c, axis=0)
    tl.store(expert_totals_ptr + tl.program_id(0), carry)


@triton.jit
def _folded_scan(tile_counts_ptr, E, num_tiles, pid_t, e, e_first, TILES: tl.constexpr, ROWS: tl.constexpr):
    """Step (b) from the raw tile counts [E, num_tiles] (TILES >= num_tiles, a power of two):
    the used slots of the experts before ``e_first``, of all experts, and per expert of ``e``
    its total and its slots in the tiles before ``pid_t``."""
    j = tl.arange(0, TILES)
    j_ok = j < num_tiles
    before = tl.zeros((), dtype=tl.int32)
    used = tl.zeros((), dtype=tl.int32)
    for start in range(0, E, ROWS):
        r = start + tl.arange(0, ROWS)
        c = tl.load(tile_counts_ptr + r[:, None] * num_tiles + j[None, :], mask=(r < E)[:, None] & j_ok[None, :],
                    other=0)
        per_expert = tl.sum(c, axis=1)
        before += tl.sum(tl.where(r < e_first, per_expert, 0), axis=0)
        used += tl.sum(per_expert, axis=0)
    c = tl.load(tile_counts_ptr + e[:, None] * num_tiles + j[None, :], mask=(e < E)[:, None] & j_ok[None, :], other=0)
    return before, used, tl.sum(c, axis=1), tl.sum(tl.where(j[None, :] < pid_t, c, 0), axis=1)


@triton.jit
def _scatter_kernel(
    dense_ptr, tile_base_ptr, expert_totals_ptr, offsets_ptr, expert_token_indices_ptr,
    token_index_map_ptr, token_expert_indices_ptr, T, E, num_tiles, num_eblocks,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, TOTALS_BLOCK: tl.constexpr,
    FOLD_TILES: tl.constexpr, FOLD_ROWS: tl.constexpr,
):
    """Step (c); with FOLD_TILES (0: step (b) ran) ``tile_base_ptr`` holds the raw tile counts
    and the program scans them itself (``_folded_scan``)."""
    pid_t, pid_e = _tile_of_program(num_eblocks)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    if FOLD_TILES:
        before, used, totals, tile_base = _folded_scan(tile_base_ptr, E, num_tiles, pid_t, e, pid_e * BLOCK_E,
                                                       FOLD_TILES, FOLD_ROWS)
    else:
        # Slots before this block's experts, and all used slots.
        before = tl.zeros((), dtype=tl.int32)
        used = tl.zeros((), dtype=tl.int32)
        for start in range(0, E, TOTALS_BLOCK):
            i = start + tl.arange(0, TOTALS_BLOCK)
            c = tl.load(expert_totals_ptr + i, mask=i < E, other=0)
            before += tl.sum(tl.where(i < pid_e * BLOCK_E, c, 0), axis=0)
            used += tl.sum(c, axis=0)
        totals = tl.load(expert_totals_ptr + e, mask=e_ok, other=0)
        tile_base = tl.load(tile_base_ptr + e * num_tiles + pid_t, mask=e_ok, other=0)
    expert_start = before + tl.cumsum(totals, axis=0) - totals
    tl.store(offsets_ptr + e, expert_start, mask=e_ok & (pid_t == 0))
    tl.store(offsets_ptr + E, used, mask=(pid_t == 0) & (pid_e == 0))
    if pid_e == 0:
        # The unused tail [used, T*K) inside this tile's slots [t0*K, (t0+BLOCK_T)*K).
        for k in tl.static_range(K):
            i = pid_t.to(tl.int64) * (BLOCK_T * K) + k * BLOCK_T + tl.arange(0, BLOCK_T)
            tail = (i >= used) & (i < T * K)
            tl.store(expert_token_indices_ptr + i, tl.full((BLOCK_T,), -1, tl.int32), mask=tail)

    both = e_ok[:, None] & (t < T)[None, :]
    cell = tl.load(dense_ptr + e[:, None].to(tl.int64) * T + t[None, :], mask=both, other=0).to(tl.int32)
    marked = cell > 0
    rank = tl.cumsum(marked.to(tl.int32), axis=1)
    base = expert_start + tile_base
    pos = base[:, None] + rank - 1
    tl.store(expert_token_indices_ptr + pos, (t[None, :] + 0 * e[:, None]), mask=marked)
    slot = t[None, :].to(tl.int64) * K + (cell - 1)
    tl.store(token_index_map_ptr + slot, pos, mask=marked)
    tl.store(token_expert_indices_ptr + slot, (e[:, None] + 0 * t[None, :]), mask=marked)


def plan_tensors(num_tokens: int, topk: int, num_experts: int, device):
    """The plan's four int32 tensors, unwritten: expert_token_indices [T*K], offsets [E+1],
    token_expert_indices and token_index_map [T, K] (four allocations: one shared by all would
    keep every part alive while any one is)."""
    return (torch.empty(num_tokens * topk, dtype=torch.int32, device=device),
            torch.empty(num_experts + 1, dtype=torch.int32, device=device),
            torch.empty(num_tokens, topk, dtype=torch.int32, device=device),
            torch.empty(num_tokens, topk, dtype=torch.int32, device=device))


def three_step_routing_plan(topk_ids: torch.Tensor, num_experts: int):
    """Launch the three steps (two for a small plan: ``FOLD_CELLS``); returns the plan's four
    tensors (int32)."""
    num_tokens, topk = topk_ids.shape
    if topk > MAX_TOPK:
        raise ValueError(f"the three-step build supports topk <= {MAX_TOPK}, got {topk}; use method='sort'")
    device = topk_ids.device
    topk_ids = topk_ids.contiguous()
    expert_token_indices, offsets, token_expert_indices, token_index_map = plan_tensors(
        num_tokens, topk, num_experts, device)
    # Narrow the expert block to the expert count (at least 2 rows) and widen the tile to match.
    block_e = min(BLOCK_E, max(next_pow2(num_experts), 2))
    block_t = TILE_CELLS // block_e
    num_tiles = max(cdiv(num_tokens, block_t), 1)
    num_eblocks = cdiv(num_experts, block_e)
    dense = torch.empty(num_experts, num_tokens, dtype=torch.int8, device=device)
    fold = num_experts * num_tiles <= FOLD_CELLS
    if fold:  # step (c) scans the counts: no totals
        tile_counts = expert_totals = torch.empty(num_experts * num_tiles, dtype=torch.int32, device=device)
    else:
        # Tile counts, turned into tile bases in place by step (b), then the E expert totals.
        scratch = torch.empty(num_experts * (num_tiles + 1), dtype=torch.int32, device=device)
        tile_counts, expert_totals = scratch[: num_experts * num_tiles], scratch[num_experts * num_tiles :]
    grid = (num_tiles * num_eblocks,)
    launch(_dense_map_kernel, grid, (topk_ids, dense, tile_counts, token_index_map, token_expert_indices,
                                     num_tokens, num_experts, num_tiles, num_eblocks),
           dict(K=topk, BLOCK_T=block_t, BLOCK_E=block_e))
    fold_tiles = next_pow2(num_tiles) if fold else 0
    if not fold:
        scan_block = min(SCAN_BLOCK, max(next_pow2(num_tiles), 128))
        launch(_tile_offsets_kernel, (num_experts,), (tile_counts, expert_totals, num_tiles), dict(BLOCK=scan_block))
    launch(_scatter_kernel, grid, (dense, tile_counts, expert_totals, offsets, expert_token_indices, token_index_map,
                                   token_expert_indices, num_tokens, num_experts, num_tiles, num_eblocks),
           dict(K=topk, BLOCK_T=block_t, BLOCK_E=block_e,
                TOTALS_BLOCK=min(next_pow2(num_experts), TOTALS_BLOCK), FOLD_TILES=fold_tiles,
                FOLD_ROWS=max(FOLD_LOAD // max(fold_tiles, 1), 1)))
    return expert_token_indices, offsets, token_expert_indices, token_index_map
