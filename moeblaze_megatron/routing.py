"""The routing plan: MoEBlaze's integer index maps, built without a sort or atomics.

A plan describes one routing decision (T tokens, each sent to K distinct experts out of E) with
O(T*K) integers instead of a (T*K, d) copy of the activations:

* ``expert_token_indices`` [T*K]: token ids grouped by expert, ascending inside each expert;
* ``expert_token_offsets`` [E+1]: expert e's slice of ``expert_token_indices`` is
  ``[offsets[e], offsets[e+1])``;
* ``token_expert_indices`` [T, K]: the expert of each (token, k) slot;
* ``token_index_map`` [T, K]: where slot (t, k) sits in ``expert_token_indices``.

An id of -1 marks an unused slot: a token routed to fewer than K experts (dropped by a capacity
limit, or holding fewer of its experts on this rank under expert parallelism). Its
``token_index_map`` and ``token_expert_indices`` entries are -1; ``expert_token_indices`` holds the
``offsets[E]`` used slots first and -1 after them.

Every path (the Triton three-step build, the sort path and the pure-PyTorch path) gives the
identical plan: "grouped by expert, token ids ascending" fixes every position.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .config import check_option

__all__ = ["RoutingPlan", "build_routing_plan", "check_topk_ids"]

# The cost model behind "auto" on the GPU (ms, cells = T*E / 1e6, slots = T*K / 1e6): a least-squares
# fit to measured CUDA-graph times of both builds (benchmarks/notes/routing-plan.md,
# "The auto method picks by a cost model fitted to CUDA-graph times").
THREE_STEP_BASE_MS = 0.0147
THREE_STEP_MS_PER_M_CELLS = 0.00453
THREE_STEP_MS_PER_M_SLOTS = 0.00627
SORT_BASE_MS = 0.0282
SORT_MS_PER_M_SLOTS = 0.0333
SORT_WIDE_KEY_MS = 0.012
_INDEX_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class RoutingPlan:
    """Index maps of one routing decision. All int32, on the routing ids' device."""

    expert_token_indices: torch.Tensor
    expert_token_offsets: torch.Tensor
    token_expert_indices: torch.Tensor
    token_index_map: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.token_expert_indices.shape[0]

    @property
    def topk(self) -> int:
        return self.token_expert_indices.shape[1]

    @property
    def num_experts(self) -> int:
        return self.expert_token_offsets.shape[0] - 1

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """[E] number of (token, k) slots routed to each expert (int32, on device)."""
        return self.expert_token_offsets.diff()

    def permute_probs(self, topk_probs: torch.Tensor) -> torch.Tensor:
        """Router probabilities [T, K] rearranged into the plan's expert order [T*K] (0 past the
        used slots)."""
        slots = topk_probs.numel()
        # Unused slots all land on one extra cell that is cut off: no boolean indexing, so no
        # device-to-host synchronization; every kept cell has exactly one writer.
        out = torch.zeros(slots + 1, dtype=topk_probs.dtype, device=topk_probs.device)
        pos = self.token_index_map.reshape(-1).long()
        out.scatter_(0, torch.where(pos >= 0, pos, slots), topk_probs.reshape(-1))
        return out[:slots]

    def unpermute_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Values in expert order [T*K, ...] gathered back into slot order [T, K, ...]; unused
        slots get 0."""
        pos = self.token_index_map.long()
        used = (pos >= 0).view(*pos.shape, *([1] * (rows.dim() - 1)))
        return torch.where(used, rows[pos.clamp(min=0)], 0)

    def trimmed(self, num_rows: int) -> RoutingPlan:
        """The same plan with ``expert_token_indices`` cut to its first ``num_rows`` entries (the
        used slots come first): a caller that knows how many slots are used (a ring hop) sizes its
        expert-order buffers by them instead of T * K."""
        if not 0 <= num_rows <= self.expert_token_indices.shape[0]:
            raise ValueError(f"num_rows must be in [0, {self.expert_token_indices.shape[0]}], got {num_rows}")
        return RoutingPlan(self.expert_token_indices[:num_rows], self.expert_token_offsets,
                           self.token_expert_indices, self.token_index_map)

    def to(self, device) -> RoutingPlan:
        return RoutingPlan(*(t.to(device) for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The four index maps, in field order (how autograd saves a plan)."""
        return (
            self.expert_token_indices,
            self.expert_token_offsets,
            self.token_expert_indices,
            self.token_index_map,
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, RoutingPlan) and all(
            a.shape == b.shape and bool(torch.equal(a.cpu().long(), b.cpu().long()))
            for a, b in zip(self.tensors(), other.tensors())
        )

    __hash__ = None


def check_topk_ids(topk_ids: torch.Tensor, num_experts: int, *, check_values: bool = True) -> None:
    """Raise a clear error for routing ids that no plan can describe.

    ``check_values`` also checks the range and the distinctness of the ids in each row; on a GPU
    that costs one device-to-host synchronization.
    """
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must have an integer dtype, got {topk_ids.dtype}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D [tokens, topk], got shape {tuple(topk_ids.shape)}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    num_tokens, topk = topk_ids.shape
    if not 1 <= topk <= num_experts:
        raise ValueError(
            f"topk_ids has topk={topk} columns; expected 1 <= topk <= num_experts={num_experts}"
        )
    # Under torch.compile a size can be data-dependent (rows received in an expert-parallel
    # exchange): no guard on it; the eager path checks it.
    if not torch.compiler.is_compiling() and num_tokens * topk > _INDEX_LIMIT:
        raise ValueError(
            f"topk_ids has {num_tokens}*{topk} slots; the plan's int32 indices hold at most "
            f"{_INDEX_LIMIT}"
        )
    if not check_values or num_tokens == 0:
        return
    lo, hi = torch.aminmax(topk_ids)
    sorted_ids = topk_ids.sort(dim=1).values
    repeated = ((sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)).any()
    lo, hi, repeated = torch.stack([lo.long(), hi.long(), repeated.long()]).tolist()
    if lo < -1 or hi >= num_experts:
        raise ValueError(
            f"topk_ids holds expert ids in [{lo}, {hi}]; expected ids in [0, {num_experts}) "
            f"(or -1 for an unused slot)"
        )
    if repeated:
        raise ValueError("topk_ids names the same expert twice for one token; expected distinct ids per row")


def build_routing_plan(
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    method: str = "auto",
    validate: bool = True,
) -> RoutingPlan:
    """Build the routing plan for ``topk_ids`` [T, K] (expert id of each token's k-th choice).

    ``method``: ``"three_step"`` (the atomic-free Triton build: dense token-expert map, per-expert
    counts and prefix sum, tile scan and scatter), ``"sort"`` (a stable narrow-key sort, then one
    Triton kernel; O(T*K) memory, faster for many experts), ``"torch"`` (the pure-PyTorch mirror of
    the three-step build; the CPU path and the test oracle) or ``"auto"`` (the fastest that
    applies).
    ``validate=False`` skips the range and distinctness checks of the ids, and with them the
    only device-to-host synchronization; invalid ids then give an undefined plan. Every method
    gives the same plan.
    """
    check_option("routing_method", method)
    check_topk_ids(topk_ids, num_experts, check_values=validate)
    if method == "auto":
        method = choose_routing_method(topk_ids, num_experts)
    if method == "three_step":
        from .kernels.plan_three_step import three_step_routing_plan as build
    elif method == "sort":
        from .kernels.plan_sort import sort_routing_plan as build
    else:
        return torch_routing_plan(topk_ids, num_experts)
    return RoutingPlan(*build(topk_ids, num_experts))


def choose_routing_method(topk_ids: torch.Tensor, num_experts: int) -> str:
    """On the GPU the faster build for the shape (see gpu_routing_method); on the CPU the PyTorch
    path (Triton runs there only under the slow interpreter)."""
    if topk_ids.device.type == "cuda":
        return gpu_routing_method(topk_ids.shape[0], num_experts, topk_ids.shape[1])
    return "torch"


# Kept per shape: the answer is fixed, and its imports and arithmetic come before the first kernel.
@functools.lru_cache(maxsize=1024)
def gpu_routing_method(num_tokens: int, num_experts: int, topk: int) -> str:
    """The three-step build where its predicted GPU time is at most the sort's and topk is within
    its MAX_TOPK; the sort otherwise (cost model above)."""
    from .kernels.plan_three_step import MAX_TOPK
    from .kernels.plan_sort import sort_key_dtype

    if topk > MAX_TOPK:
        return "sort"
    cells, slots = num_tokens * num_experts / 1e6, num_tokens * topk / 1e6
    three_step = THREE_STEP_BASE_MS + THREE_STEP_MS_PER_M_CELLS * cells + THREE_STEP_MS_PER_M_SLOTS * slots
    sort = SORT_BASE_MS + SORT_MS_PER_M_SLOTS * slots
    if sort_key_dtype(num_experts).itemsize > 1:
        sort += SORT_WIDE_KEY_MS
    return "three_step" if three_step <= sort else "sort"


def torch_routing_plan(topk_ids: torch.Tensor, num_experts: int) -> RoutingPlan:
    """The three-step build in plain PyTorch: dense map, per-expert counts, scan and scatter."""
    num_tokens, topk = topk_ids.shape
    device = topk_ids.device
    ids = topk_ids.long()
    used = ids >= 0
    tokens = torch.arange(num_tokens, device=device)[:, None].expand(-1, topk)
    slots = torch.arange(1, topk + 1, dtype=torch.int32, device=device).expand(num_tokens, -1)
    # (a) dense expert-major map: cell (e, t) holds k+1 if token t chose expert e as its k-th.
    dense = torch.zeros(num_experts, num_tokens, dtype=torch.int32, device=device)
    dense[ids[used], tokens[used]] = slots[used]
    marked = dense > 0
    # (b) per-expert counts and their prefix sum.
    counts = marked.sum(dim=1, dtype=torch.int32)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    offsets[1:] = counts.cumsum(0)
    # (c) rank of each marked cell inside its expert row gives its final slot.
    rank = marked.cumsum(dim=1, dtype=torch.int32) - 1
    pos = offsets[:-1, None] + rank
    expert_token_indices = torch.full((num_tokens * topk,), -1, dtype=torch.int32, device=device)
    token_index_map = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=device)
    e_idx, t_idx = marked.nonzero(as_tuple=True)
    expert_token_indices[pos[e_idx, t_idx].long()] = t_idx.int()
    token_index_map[t_idx, (dense[e_idx, t_idx] - 1).long()] = pos[e_idx, t_idx]
    return RoutingPlan(expert_token_indices, offsets, topk_ids.int(), token_index_map)

