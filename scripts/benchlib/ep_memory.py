"""A memory and overlap model of one MoE layer under expert parallelism, per rank.

For a layer (width d, expert hidden h, E experts, top-k K, SwiGLU), T tokens per rank, P ranks and
uniform routing, it gives what each way of running the experts keeps for backward and its
transient peak, in bytes:

* stock alltoall (Megatron's alltoall dispatcher + SequentialMLP/GroupedMLP): every (token,
  expert) slot is a row: each rank receives T*K rows. Saved: the dispatched rows [T*K, d], fc1's
  output [T*K, 2h], the activation [T*K, h], the expert output [T*K, d] (the unpermute's
  probability gradient). Transient: send and receive buffers of T*K rows both ways plus the
  expert intermediates.
* our alltoall (``ep_mode="alltoall"``): one row per (token, destination rank): R = T*P*(1 -
  (1 - 1/P)^K) rows received per rank. Saved: the received rows [R, d] and the pre-activations
  [T*K, 2h] (``recompute="fc1"``: the rows only), plus the index maps.
* ring (``ep_mode="ring"``): saved only the input [T, d], the ids and the probabilities. A hop
  handles T*K/P slots; the transient is two weight shards (expert ring: the one in use and the
  one arriving) or two token blocks with their output accumulators (token ring), plus one hop's
  intermediates.

Per hop, compute against transfer: the expert ring sends one weight shard (3*(E/P)*h*d elements),
the token ring one token block and its accumulator. The ring overlaps transfer with compute when
a hop's compute takes at least its transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

INDEX_BYTES = 4  # int32 ids and index maps
PROB_BYTES = 4  # float32 router probabilities


@dataclass(frozen=True)
class LayerShape:
    d: int
    h: int
    experts: int
    topk: int
    dtype_bytes: int = 2


LAYERS = {
    "qwen3-30b-a3b": LayerShape(d=2048, h=768, experts=128, topk=8),
    "deepseek-v3": LayerShape(d=7168, h=2048, experts=256, topk=8),
}


def received_rows(tokens: int, ranks: int, topk: int) -> float:
    """Expected rows one rank receives from all ranks when each token travels once per destination
    rank (uniform routing, top-k of many experts)."""
    return tokens * ranks * (1 - (1 - 1 / ranks) ** topk)


def shard_bytes(layer: LayerShape, ranks: int) -> int:
    """One rank's expert weights (fc1 [2h, d] and fc2 [d, h] per expert)."""
    return 3 * layer.experts // ranks * layer.h * layer.d * layer.dtype_bytes


def saved_bytes(layer: LayerShape, tokens: int, ranks: int, mode: str, recompute: str = "activation") -> float:
    """Bytes one rank keeps for backward in one MoE layer (the expert weights left out)."""
    b, d, h, K = layer.dtype_bytes, layer.d, layer.h, layer.topk
    slots = tokens * K
    if mode == "stock":
        return slots * (d + 2 * h + h + d) * b + slots * (INDEX_BYTES + PROB_BYTES)
    if mode == "alltoall":
        rows = received_rows(tokens, ranks, K)
        pre = slots * 2 * h * b if recompute == "activation" else 0
        # The received rows, their ids and probabilities, the plan's three [slots] maps.
        return rows * d * b + pre + rows * K * (INDEX_BYTES + PROB_BYTES) + 3 * slots * INDEX_BYTES
    if mode in ("expert_ring", "token_ring"):
        return tokens * d * b + tokens * K * (INDEX_BYTES + PROB_BYTES)
    raise ValueError(f"mode must be stock, alltoall, expert_ring or token_ring, got {mode!r}")


def hop_intermediates(layer: LayerShape, slots: float) -> float:
    """The expert intermediates of ``slots`` routed rows: pre-activations [2h], activation [h] and
    expert output [d], plus the plan's maps."""
    b = layer.dtype_bytes
    return slots * ((2 * layer.h + layer.h + layer.d) * b + 3 * INDEX_BYTES)


def transient_bytes(layer: LayerShape, tokens: int, ranks: int, mode: str) -> float:
    """The layer's largest transient footprint on one rank in forward or backward (what lives only
    during the layer), besides what it keeps for backward."""
    b, d, K = layer.dtype_bytes, layer.d, layer.topk
    slots = tokens * K
    if mode == "stock":
        # Permuted send rows, received rows, the experts' intermediates, the output coming back.
        return 2 * slots * d * b + hop_intermediates(layer, slots) + 2 * slots * d * b
    if mode == "alltoall":
        rows = received_rows(tokens, ranks, K)
        return 2 * rows * d * b + hop_intermediates(layer, slots) + 2 * rows * d * b
    hop = hop_intermediates(layer, slots / ranks)
    accumulator = tokens * d * 4  # float32 output (forward) or input gradient (backward)
    if mode == "expert_ring":
        # Backward: two weight shards and two weight-gradient shards (one arriving, one leaving).
        return 4 * shard_bytes(layer, ranks) + hop + accumulator
    if mode == "token_ring":
        block = tokens * (d * b + K * (INDEX_BYTES + PROB_BYTES))
        # Backward blocks carry their output gradient too; two blocks, two accumulators in flight.
        return 2 * (block + tokens * d * b) + 2 * tokens * d * b + hop + accumulator
    raise ValueError(f"mode must be stock, alltoall, expert_ring or token_ring, got {mode!r}")


def hop_transfer_bytes(layer: LayerShape, tokens: int, ranks: int, mode: str) -> float:
    """Bytes one rank sends per forward hop."""
    if mode == "expert_ring":
        return shard_bytes(layer, ranks)
    if mode == "token_ring":
        return tokens * (2 * layer.d * layer.dtype_bytes + layer.topk * (INDEX_BYTES + PROB_BYTES))
    raise ValueError(f"mode must be expert_ring or token_ring, got {mode!r}")


def hop_flops(layer: LayerShape, tokens: int, ranks: int) -> float:
    """Forward FLOPs of one hop's expert GEMMs (SwiGLU: fc1 2h x d, fc2 d x h) on T*K/P slots."""
    return 2 * (tokens * layer.topk / ranks) * 3 * layer.h * layer.d


def model_rows(layer_name: str, layer: LayerShape, tokens: int, ranks: int, *, tflops: float,
               link_gbps: float) -> list[dict]:
    """One record per way of running the layer: saved and transient MiB, and for the rings the
    per-hop compute and transfer times (ms) at ``tflops`` and ``link_gbps`` (GB/s one way)."""
    rows = []
    compute_ms = hop_flops(layer, tokens, ranks) / (tflops * 1e12) * 1e3
    for mode in ("stock", "alltoall", "expert_ring", "token_ring"):
        record = {"layer": layer_name, "tokens_per_rank": tokens, "P": ranks, "mode": mode,
                  "saved_MiB": saved_bytes(layer, tokens, ranks, mode) / 2**20,
                  "transient_MiB": transient_bytes(layer, tokens, ranks, mode) / 2**20}
        if mode.endswith("ring"):
            transfer_ms = hop_transfer_bytes(layer, tokens, ranks, mode) / (link_gbps * 1e9) * 1e3
            record.update(hop_compute_ms=compute_ms, hop_transfer_ms=transfer_ms,
                          overlaps=compute_ms >= transfer_ms)
        rows.append(record)
    return rows


def table_lines(records: list[dict]) -> list[str]:
    """A markdown table of ``model_rows`` records, with each ring's saved bytes against ours and
    stock's."""
    lines = ["| layer | T/rank | P | mode | saved MiB | x ours | x stock | transient MiB | hop compute ms | hop transfer ms | overlaps |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    by_key = {(r["layer"], r["tokens_per_rank"], r["P"], r["mode"]): r for r in records}
    for r in records:
        key = (r["layer"], r["tokens_per_rank"], r["P"])
        ours, stock = by_key[(*key, "alltoall")]["saved_MiB"], by_key[(*key, "stock")]["saved_MiB"]
        hop = (f"{r['hop_compute_ms']:.3f} | {r['hop_transfer_ms']:.3f} | {'yes' if r['overlaps'] else 'no'}"
               if "hop_compute_ms" in r else "- | - | -")
        lines.append(f"| {r['layer']} | {r['tokens_per_rank']} | {r['P']} | {r['mode']} | {r['saved_MiB']:.0f} | "
                     f"{r['saved_MiB'] / ours:.3f} | {r['saved_MiB'] / stock:.3f} | {r['transient_MiB']:.0f} | {hop} |")
    return lines
