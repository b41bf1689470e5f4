"""Bytes one rank sends for one MoE layer under each expert-parallel mode, and the choice of mode
that moves the fewest.

Pure arithmetic over shapes (no communication, no tensors): the modes' choice (``choose_mode``),
the ring's per-hop transfers (``hop_bytes``) and the memory model (``scripts/ep_memory_model.py``)
all read these formulas, so they are written once. What travels, per mode (forward, then backward):

* alltoall: each token once to every other rank holding one of its experts, with its K' = min(K,
  E/P) local ids and probabilities; the partial outputs come back. Backward: the reverse
  all-to-alls (output gradients out, input and probability gradients back). The row count is the
  expectation under uniform routing, T * (P - 1) * (1 - (1 - 1/P)^K): the actual count depends on
  the router.
* expert ring: P - 1 hops of one weight shard (fc1 and fc2 of E/P experts). Backward: P - 1 hops of
  weights and P hops of their gradient accumulators (float32, so a shard's gradient is rounded
  once, at home).
* token ring: P - 1 hops of a token block (rows, int32 ids, probabilities) and P hops of its output
  accumulator (float32). Backward: the block with its output gradient, and the input- and
  probability-gradient accumulators (float32).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..config import RING_MODES

__all__ = ["EPMode", "LayerTraffic", "MODES", "choose_mode", "hop_bytes", "received_rows", "step_bytes"]

# Every way of running the experts across ranks, in the order ties are broken.
MODES = ("alltoall", *RING_MODES)
INDEX_BYTES = 4  # int32 expert ids


class EPMode(enum.Enum):
    """How one MoE layer's experts run, resolved for one forward (``parallel.moe.resolve_mode``):
    on this rank alone (expert parallelism 1), through the token exchange, or as one of the rings.
    The values are ``MODES``' names (and "local")."""

    LOCAL = "local"
    ALLTOALL = "alltoall"
    EXPERT_RING = "expert"
    TOKEN_RING = "token"

    @property
    def is_ring(self) -> bool:
        return self in (EPMode.EXPERT_RING, EPMode.TOKEN_RING)


@dataclass(frozen=True)
class LayerTraffic:
    """One MoE layer as one rank of a group of ``ranks`` sees it.

    tokens: tokens on this rank (T); hidden: d; topk: K; experts_per_rank: E / P;
    weight_numel: elements of this rank's expert weights (fc1 and fc2); dtype_bytes,
    prob_bytes, weight_bytes: element sizes of the activations, router probabilities and weights.
    """

    tokens: float
    hidden: int
    topk: int
    experts_per_rank: int
    ranks: int
    weight_numel: int
    dtype_bytes: int = 2
    prob_bytes: int = 4
    weight_bytes: int = 2

    @property
    def accumulator_bytes(self) -> int:
        """Element size of a travelling sum: float32, or the inputs' own where wider."""
        return max(4, self.dtype_bytes)


def received_rows(tokens: float, ranks: int, topk: int) -> float:
    """Expected rows one rank receives (its own tokens included) when each token travels once per
    destination rank, under uniform routing over many experts."""
    return tokens * ranks * (1 - (1 - 1 / ranks) ** topk)


def hop_bytes(mode: str, traffic: LayerTraffic) -> tuple[float, float]:
    """Bytes one rank sends in one ring hop: ``(forward, backward)``. A hop's accumulator sends
    are counted with the hop (one per hop; the last one travels home after the last hop)."""
    t = traffic
    if mode == "expert":
        weights = t.weight_numel * t.weight_bytes
        return weights, weights + t.weight_numel * t.accumulator_bytes
    if mode == "token":
        ids_probs = t.topk * (INDEX_BYTES + t.prob_bytes)
        block = t.tokens * (t.hidden * t.dtype_bytes + ids_probs)
        forward = block + t.tokens * t.hidden * t.accumulator_bytes
        backward = block + t.tokens * t.hidden * t.dtype_bytes + t.tokens * (t.hidden + t.topk) * t.accumulator_bytes
        return forward, backward
    raise ValueError(f"mode must be one of {RING_MODES}, got {mode!r}")


def step_bytes(mode: str, traffic: LayerTraffic) -> tuple[float, float]:
    """Bytes one rank sends for the layer in one training step: ``(forward, backward)``."""
    t = traffic
    if mode == "alltoall":
        cols = min(t.topk, t.experts_per_rank)
        rows = t.tokens * (t.ranks - 1) * (1 - (1 - 1 / t.ranks) ** t.topk)
        forward = rows * (2 * t.hidden * t.dtype_bytes + cols * (INDEX_BYTES + t.prob_bytes))
        backward = rows * (2 * t.hidden * t.dtype_bytes + cols * t.prob_bytes)
        return forward, backward
    if mode not in RING_MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    forward, backward = hop_bytes(mode, traffic)
    p = t.ranks
    if mode == "expert":
        weights = t.weight_numel * t.weight_bytes
        return (p - 1) * forward, (p - 1) * weights + p * (backward - weights)
    block_fwd = t.tokens * (t.hidden * t.dtype_bytes + t.topk * (INDEX_BYTES + t.prob_bytes))
    block_bwd = block_fwd + t.tokens * t.hidden * t.dtype_bytes
    return (p - 1) * block_fwd + p * (forward - block_fwd), (p - 1) * block_bwd + p * (backward - block_bwd)


def choose_mode(candidates, traffic: LayerTraffic) -> str:
    """The candidate (of ``MODES``) that sends the fewest bytes in a training step; ties go to the
    earlier of ``MODES``. The same shapes give the same choice on every rank."""
    unknown = [m for m in candidates if m not in MODES]
    if unknown or not candidates:
        raise ValueError(f"candidates must be a non-empty list of {MODES}, got {list(candidates)!r}")
    ordered = [m for m in MODES if m in candidates]
    return min(ordered, key=lambda m: sum(step_bytes(m, traffic)))
