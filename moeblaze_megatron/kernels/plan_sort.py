"""The sort path of the routing-plan build: one elementwise op, a stable narrow-key sort, one kernel.

Keys: the flattened expert ids in the narrowest integer type that holds E, an unused slot (-1)
wrapped to the type's largest value (``ids & max``, one op that also narrows), so it sorts after
every expert (the type is chosen so that E <= that value). The stable sort then groups the slots by expert, slot
t*K+k ascending in t inside each expert: position p of the sorted order is position p of the plan.

``_sort_plan_kernel`` writes the whole plan from the sorted keys and the sort's permutation in one
launch, without atomics:

* programs [0, S) each find the offsets of a block of experts: offsets[e] = number of sorted keys
  below e, by a FANOUT-ary search (FANOUT - 1 probes per expert per level, 8 levels for 16-way,
  since T*K < 2^31), so a program waits for 8 dependent loads instead of 31 for a binary search;
* the other programs each take a block of sorted positions p: expert_token_indices[p] = slot // K
  and token_index_map[slot] = p (-1 for unused keys, which sort last, so the -1 tail comes for
  free), and the same block of slots in slot order: token_expert_indices = the unsorted key, or -1.

It replaces about 15 PyTorch ops after the sort, each its own launch (a host-time floor:
benchmarks/notes/routing-plan.md, "The sort path's one kernel").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch
from .plan_three_step import plan_tensors

# Sorted positions (and slots) per scatter program.
BLOCK = 1024
# Experts per search program, and the search's fan-out (a power of two).
SEARCH_BLOCK_E = 128
FANOUT = 16
# T*K fits an int32 (check_topk_ids), so counts stay below 2^31.
_MAX_SLOTS = 2**31 - 1


@triton.jit
def _search_offsets(sorted_keys_ptr, offsets_ptr, n, E, pid, BLOCK_E: tl.constexpr, FANOUT: tl.constexpr,
                    LEVELS: tl.constexpr):
    # below[e] = keys < e, digit by digit: at stride s the probes below + i*s (i = 1..FANOUT-1)
    # ask whether key[below + i*s - 1] < e; the keys ascend, so the true ones are a prefix.
    e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    probe = tl.arange(0, FANOUT).to(tl.int64)
    below = tl.zeros((BLOCK_E,), dtype=tl.int64)
    for level in tl.static_range(LEVELS):
        pos = below[:, None] + probe[None, :] * (FANOUT ** (LEVELS - 1 - level))
        ok = (probe[None, :] > 0) & (pos <= n)
        key = tl.load(sorted_keys_ptr + pos - 1, mask=ok, other=0).to(tl.int32)
        hits = tl.sum((ok & (key < e[:, None])).to(tl.int64), axis=1)
        below += hits * (FANOUT ** (LEVELS - 1 - level))
    tl.store(offsets_ptr + e, below.to(tl.int32), mask=e <= E)


@triton.jit
def _write_plan(keys_ptr, sorted_keys_ptr, slots_ptr, expert_token_indices_ptr, token_expert_indices_ptr,
                token_index_map_ptr, n, E, block, K: tl.constexpr, BLOCK: tl.constexpr):
    p = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = p < n
    key = tl.load(sorted_keys_ptr + p, mask=ok, other=0).to(tl.int32)
    slot = tl.load(slots_ptr + p, mask=ok, other=0).to(tl.int32)
    used = key < E
    tl.store(expert_token_indices_ptr + p, tl.where(used, slot // K, -1), mask=ok)
    tl.store(token_index_map_ptr + slot, tl.where(used, p.to(tl.int32), -1), mask=ok)
    key = tl.load(keys_ptr + p, mask=ok, other=0).to(tl.int32)
    tl.store(token_expert_indices_ptr + p, tl.where(key < E, key, -1), mask=ok)


@triton.jit
def _sort_plan_kernel(
    keys_ptr, sorted_keys_ptr, slots_ptr, expert_token_indices_ptr, offsets_ptr,
    token_expert_indices_ptr, token_index_map_ptr, n, E, num_search_programs,
    K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, FANOUT: tl.constexpr,
    LEVELS: tl.constexpr,
):
    # The two roles live in their own functions: Triton 3.6 rejects a name bound to tensors of
    # different shapes in the two branches of a runtime if.
    pid = tl.program_id(0)
    if pid < num_search_programs:
        _search_offsets(sorted_keys_ptr, offsets_ptr, n, E, pid, BLOCK_E, FANOUT, LEVELS)
    else:
        _write_plan(keys_ptr, sorted_keys_ptr, slots_ptr, expert_token_indices_ptr, token_expert_indices_ptr,
                    token_index_map_ptr, n, E, pid - num_search_programs, K, BLOCK)


def search_levels(fanout: int) -> int:
    """Digits of a count below 2^31 in base ``fanout``."""
    levels = 1
    while fanout**levels <= _MAX_SLOTS:
        levels += 1
    return levels


def sort_key_dtype(num_experts: int) -> torch.dtype:
    """The narrowest key type whose largest value (an unused slot's key) is above every expert id."""
    return torch.uint8 if num_experts <= 255 else (torch.int16 if num_experts <= 32767 else torch.int32)


def sort_routing_plan(topk_ids: torch.Tensor, num_experts: int):
    """Sort the narrow keys and build the plan from the sort in one kernel; returns the plan's four
    tensors (int32)."""
    num_tokens, topk = topk_ids.shape
    n = num_tokens * topk
    device = topk_ids.device
    key_dtype = sort_key_dtype(num_experts)
    if topk_ids.dtype.itemsize < key_dtype.itemsize:
        # The mask below is applied in the ids' own type: widen them first (E > 255 with 8-bit
        # ids, or E > 32767 with 16-bit ids; never on the usual int64 or int32 ids).
        topk_ids = topk_ids.to(key_dtype)
    keys = torch.empty(n, dtype=key_dtype, device=device)
    torch.bitwise_and(topk_ids, torch.iinfo(key_dtype).max, out=keys.view(num_tokens, topk))
    sorted_keys, slots = torch.sort(keys, stable=True)
    expert_token_indices, offsets, token_expert_indices, token_index_map = plan_tensors(
        num_tokens, topk, num_experts, device)
    num_search = cdiv(num_experts + 1, SEARCH_BLOCK_E)
    launch(_sort_plan_kernel, (num_search + cdiv(n, BLOCK),),
           (keys, sorted_keys, slots, expert_token_indices, offsets, token_expert_indices, token_index_map,
            n, num_experts, num_search),
           dict(K=topk, BLOCK=BLOCK, BLOCK_E=SEARCH_BLOCK_E, FANOUT=FANOUT, LEVELS=search_levels(FANOUT)))
    return expert_token_indices, offsets, token_expert_indices, token_index_map
