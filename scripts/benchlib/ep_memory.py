"""A memory and overlap model of one MoE layer under expert parallelism, per rank.

For a layer (width d, expert hidden h, E experts, top-k K, SwiGLU), T tokens per rank and P ranks
it gives, in bytes, what each way of running the experts keeps for backward (``saved_bytes``) and
its largest transient footprint (``transient_bytes``: what lives only while the layer runs,
forward or backward, on top of what it keeps). The formulas follow the code, buffer by buffer:

* stock: Megatron's alltoall dispatcher + SequentialMLP (TransformerConfig's defaults: unfused
  SwiGLU). Every (token, expert) slot is a row: a rank receives S = T*K rows. Saved: the
  dispatched rows [S, d], fc1's output [S, 2h], four [S, h] tensors of the activation and the
  probability scaling, the probabilities and the int64 permutation maps (one of them [T, E]).
  Transient (an estimate, not measured at EP > 1, low: it leaves out the backward's
  intermediates): the permuted send rows, the experts' outputs and the rows coming back, [S, d]
  each, or the experts' weight gradients, as every mode's transient counts its own.
* alltoall (ours, ``ep_mode="alltoall"``): one row per (token, destination rank): R rows received.
  Saved: the received rows [R, d], the pre-activations [S, 2h] (none with ``recompute="fc1"``;
  the plan is trimmed to the S slots), the received ids and probabilities, the plan's int32 maps
  and the exchange's int64 maps.
  Transient: the send rows, the partial outputs going back and returned, and the fused op's own
  buffers over S slots.
* expert and token rings: saved only the input [T, d], the int32 ids and the probabilities. A hop
  computes S/P slots. Transient: the ring's buffers (two received weight shards and, in backward,
  two float32 gradient accumulators; or a token block and its float32 accumulators), the float32
  output / input-gradient accumulator, and the fused op's buffers over one hop's slots.

Counts are expectations under uniform routing (``parallel.traffic.received_rows``) unless measured
ones are given (``Counts``). The fused op's buffers (``op_transient``) are the Triton path's
(fused.py); the plan build's scratch is left out. Per hop, compute against transfer: the ring
overlaps its transfers when a hop's compute takes at least its transfer (``hop_times``).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeblaze_megatron.parallel.traffic import LayerTraffic, hop_bytes, received_rows

INDEX_BYTES = 4  # int32 ids and plan maps
LONG_BYTES = 8  # int64 permutation and exchange maps
MODES = ("stock", "alltoall", "expert_ring", "token_ring")


@dataclass(frozen=True)
class LayerShape:
    d: int
    h: int
    experts: int
    topk: int
    dtype_bytes: int = 2
    prob_bytes: int = 4


LAYERS = {
    "qwen3-30b-a3b": LayerShape(d=2048, h=768, experts=128, topk=8),
    "deepseek-v3": LayerShape(d=7168, h=2048, experts=256, topk=8),
}


@dataclass(frozen=True)
class Counts:
    """Row counts of one rank: ``received`` rows of the alltoall exchange (its own included),
    ``sent`` rows, ``slots`` (token, expert) pairs it computes, ``hop_slots`` the largest one
    hop of a ring computes."""

    received: float
    sent: float
    slots: float
    hop_slots: float


def expected_counts(layer: LayerShape, tokens: int, ranks: int) -> Counts:
    rows = received_rows(tokens, ranks, layer.topk)
    slots = tokens * layer.topk
    return Counts(received=rows, sent=rows, slots=slots, hop_slots=slots / ranks)


def shard_numel(layer: LayerShape, ranks: int) -> int:
    """Elements of one rank's expert weights (fc1 [2h, d] and fc2 [d, h] per expert)."""
    return 3 * layer.experts // ranks * layer.h * layer.d


def traffic(layer: LayerShape, tokens: float, ranks: int) -> LayerTraffic:
    return LayerTraffic(tokens=tokens, hidden=layer.d, topk=layer.topk, experts_per_rank=layer.experts // ranks,
                        ranks=ranks, weight_numel=shard_numel(layer, ranks), dtype_bytes=layer.dtype_bytes,
                        prob_bytes=layer.prob_bytes, weight_bytes=layer.dtype_bytes)


def saved_bytes(layer: LayerShape, tokens: int, ranks: int, mode: str, recompute: str = "activation",
                counts: Counts | None = None) -> float:
    """Bytes one rank keeps for backward in one MoE layer (the expert weights left out)."""
    b, pb, d, h, K = layer.dtype_bytes, layer.prob_bytes, layer.d, layer.h, layer.topk
    c = counts or expected_counts(layer, tokens, ranks)
    if mode == "stock":
        # The dispatched rows, fc1's output and four [S, h] tensors, the probabilities and the
        # permutation map per slot; the top-k ids and the dense routing map's int64 index [T, E].
        return (c.slots * ((d + 2 * h + 4 * h) * b + pb + LONG_BYTES)
                + tokens * (K + layer.experts) * LONG_BYTES)
    if mode == "alltoall":
        cols = min(K, layer.experts // ranks)
        pre = c.slots * 2 * h * b if recompute == "activation" else 0
        # Received rows, ids, probabilities and the plan's token_index_map; its expert_token_indices
        # (trimmed to the slots); the exchange's maps: send_slot [T, P], and per sent row
        # send_token, send_cols (int64), the probabilities' where-mask (bool) and the gathered
        # probabilities.
        received = c.received * (d * b + cols * (2 * INDEX_BYTES + pb)) + c.slots * INDEX_BYTES
        exchange = tokens * ranks * LONG_BYTES + c.sent * (LONG_BYTES + cols * (LONG_BYTES + 1 + pb))
        return received + pre + exchange
    if mode in ("expert_ring", "token_ring"):
        return tokens * (d * b + K * (INDEX_BYTES + pb))
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def op_transient(layer: LayerShape, rows: float, tokens: float, experts: int, out_bytes: int,
                 recompute: bool) -> tuple[float, float]:
    """The fused op's own buffers over ``rows`` slots of ``tokens`` tokens on ``experts`` experts
    (fused.py), ``(forward, backward)``: forward h and the expert outputs in expert order, then
    y [T, d] in ``out_bytes``; backward the pre-activations where ``recompute`` (else the saved
    ones take their gradient in place), h scaled, the router-gradient partials, both weight
    gradients, the input gradient's rows and dx [T, d]."""
    b, d, h = layer.dtype_bytes, layer.d, layer.h
    forward = rows * (h + d) * b + rows * layer.prob_bytes + tokens * d * out_bytes
    grads = experts * 3 * h * d * b
    pre = 2 * h if recompute else 0
    backward = rows * (pre + h + d) * b + rows * 4 * max(1, h // 64) + grads + tokens * d * b
    return forward, backward


def transient_bytes(layer: LayerShape, tokens: int, ranks: int, mode: str, counts: Counts | None = None,
                    op=None) -> float:
    """The layer's largest transient footprint on one rank, forward or backward, besides what it
    keeps. ``op(rows, tokens, experts, out_bytes, recompute) -> (forward, backward)`` gives the
    expert op's own buffers (the fused op's by default, ``op_transient``)."""
    b, d, K = layer.dtype_bytes, layer.d, layer.topk
    c = counts or expected_counts(layer, tokens, ranks)
    op = op or (lambda *args: op_transient(layer, *args))
    local = layer.experts // ranks
    if mode == "stock":
        # The permuted send rows, the experts' outputs and the rows coming back; in backward the
        # experts' weight gradients, as every mode's transient counts its own (an estimate that
        # leaves out stock's backward intermediates).
        return max(3 * c.slots * d * b, shard_numel(layer, ranks) * b)
    if mode == "alltoall":
        fwd, bwd = op(c.slots, c.received, local, b, False)
        sent, received, out = c.sent * d * b, c.received * d * b, tokens * d * b
        # Forward, phase by phase: the send rows while the received ones arrive; the op (its
        # partial outputs included); the partials and the rows they come back to; those and the
        # output [T, d].
        forward = max(sent, fwd, received + sent, sent + out)
        # Backward, with the output alive: the output gradient's rows out and in; the op on them;
        # the input gradient's rows in and out; those and dx [T, d].
        backward = out + max(sent + received, received + bwd, received + sent, sent + out)
        return max(forward, backward)
    acc = 4 if b < 4 else b
    fwd, bwd = op(c.hop_slots, tokens, local, acc, True)
    if mode == "expert_ring":
        shard = shard_numel(layer, ranks)
        # Received shards alive at once (this rank's own are its parameters): the one in use and
        # the one arriving, except at P = 2, whose only received shard arrives at the last hop.
        shards = 1 if ranks == 2 else 2
        # Forward: the output accumulator, the received shards and a hop's op.
        forward = tokens * d * acc + shards * shard * b + fwd
        # Backward, with the output alive: the received shards, two float32 gradient accumulators
        # (leaving, arriving), the input- and probability-gradient accumulators, and a hop's op
        # (its weight gradients included).
        backward = tokens * d * b + shards * shard * b + 2 * shard * acc + tokens * (d + K) * acc + bwd
        return max(forward, backward)
    if mode == "token_ring":
        block = tokens * (d * b + K * (INDEX_BYTES + layer.prob_bytes))
        # Forward: the arriving block and two output accumulators (leaving, arriving) and a hop's op.
        forward = block + 2 * tokens * d * acc + fwd
        # Backward, with the output alive: the arriving block with its output gradient, two pairs
        # of input- and probability-gradient accumulators, this rank's weight-gradient sums, and
        # a hop's op.
        backward = (tokens * d * b + block + tokens * d * b + 2 * tokens * (d + K) * acc
                    + shard_numel(layer, ranks) * acc + bwd)
        return max(forward, backward)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def hop_flops(layer: LayerShape, tokens: float, ranks: int) -> tuple[float, float]:
    """FLOPs of one hop's expert GEMMs on T*K/P slots (SwiGLU: fc1 2h x d, fc2 d x h), forward
    and backward (backward: fc1 recomputed, then dH, dX, dW1, dW2)."""
    forward = 2 * (tokens * layer.topk / ranks) * 3 * layer.h * layer.d
    return forward, 3 * forward


def hop_times(layer: LayerShape, tokens: int, ranks: int, mode: str, *, tflops: float, link_gbps: float,
              measured_ms: tuple[float, float] | None = None) -> dict:
    """One ring hop's compute (at ``tflops``, or ``measured_ms``) against its transfer (at
    ``link_gbps`` GB/s one way), forward and backward, in ms."""
    ring = mode.removesuffix("_ring")
    sent = hop_bytes(ring, traffic(layer, tokens, ranks))
    compute = measured_ms or tuple(f / (tflops * 1e12) * 1e3 for f in hop_flops(layer, tokens, ranks))
    transfer = tuple(s / (link_gbps * 1e9) * 1e3 for s in sent)
    return {"hop_compute_ms": list(compute), "hop_transfer_ms": list(transfer),
            "overlaps": all(c >= t for c, t in zip(compute, transfer)), "compute_measured": measured_ms is not None}


def model_rows(layer_name: str, layer: LayerShape, tokens: int, ranks: int, *, tflops: float,
               link_gbps: float, measured: dict | None = None) -> list[dict]:
    """One record per way of running the layer: saved and transient MiB, and for the rings the
    per-hop compute and transfer times. ``measured``: {(layer, tokens, ranks): (fwd ms, bwd ms)}
    of one hop on a GPU, used in place of the ``tflops`` estimate where present."""
    rows = []
    for mode in MODES:
        record = {"layer": layer_name, "tokens_per_rank": tokens, "P": ranks, "mode": mode,
                  "saved_MiB": saved_bytes(layer, tokens, ranks, mode) / 2**20,
                  "transient_MiB": transient_bytes(layer, tokens, ranks, mode) / 2**20}
        if mode.endswith("ring"):
            hop = (measured or {}).get((layer_name, tokens, ranks))
            record.update(hop_times(layer, tokens, ranks, mode, tflops=tflops, link_gbps=link_gbps, measured_ms=hop))
        rows.append(record)
    return rows


def table_lines(records: list[dict]) -> list[str]:
    """A markdown table of ``model_rows`` records: saved and saved + transient (the layer's peak
    above its weights) against ours and stock's, and the rings' hop times (forward / backward)."""
    lines = ["| layer | T/rank | P | mode | saved MiB | saved + transient MiB | x stock | hop compute ms | "
             "hop transfer ms | overlaps |", "|---|---|---|---|---|---|---|---|---|---|"]
    by_key = {(r["layer"], r["tokens_per_rank"], r["P"], r["mode"]): r for r in records}
    for r in records:
        stock = by_key[(r["layer"], r["tokens_per_rank"], r["P"], "stock")]
        peak, stock_peak = (x["saved_MiB"] + x["transient_MiB"] for x in (r, stock))
        if "hop_compute_ms" in r:
            mark = "" if r["compute_measured"] else "~"
            hop = (f"{mark}{r['hop_compute_ms'][0]:.2f} / {mark}{r['hop_compute_ms'][1]:.2f} | "
                   f"{r['hop_transfer_ms'][0]:.2f} / {r['hop_transfer_ms'][1]:.2f} | {'yes' if r['overlaps'] else 'no'}")
        else:
            hop = "- | - | -"
        lines.append(f"| {r['layer']} | {r['tokens_per_rank']} | {r['P']} | {r['mode']} | {r['saved_MiB']:.0f} | "
                     f"{peak:.0f} | {peak / stock_peak:.2f} | {hop} |")
    return lines


def measured_hops(hops: list[dict]) -> dict:
    """``model_rows``' ``measured`` from bench_ring_hop's records."""
    return {(r["layer"], r["tokens_per_rank"], r["P"]): (r["forward_ms"], r["backward_ms"]) for r in hops}


def wide_table_lines(records: list[dict]) -> list[str]:
    """One row per (layer, T, P): each mode's saved and peak (saved + transient) MiB, a hop's
    compute (forward / backward ms; ~ where estimated) and each ring's transfer and whether it
    hides behind the compute (y/n, forward and backward)."""
    lines = ["| layer | T/rank | P | saved MiB: stock / alltoall / ring | peak MiB: stock / alltoall / expert ring / "
             "token ring | hop compute ms | expert ring hop transfer ms | token ring hop transfer ms |",
             "|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in records:
        groups.setdefault((r["layer"], r["tokens_per_rank"], r["P"]), {})[r["mode"]] = r
    for (layer, tokens, ranks), by in groups.items():
        saved = " / ".join(f"{by[m]['saved_MiB']:.0f}" for m in ("stock", "alltoall", "expert_ring"))
        peak = " / ".join(f"{by[m]['saved_MiB'] + by[m]['transient_MiB']:.0f}" for m in MODES)
        ring = by["expert_ring"]
        mark = "" if ring["compute_measured"] else "~"
        compute = f"{mark}{ring['hop_compute_ms'][0]:.2f} / {mark}{ring['hop_compute_ms'][1]:.2f}"

        def transfer(mode):
            r = by[mode]
            hides = "".join("y" if c >= t else "n" for c, t in zip(r["hop_compute_ms"], r["hop_transfer_ms"]))
            return f"{r['hop_transfer_ms'][0]:.2f} / {r['hop_transfer_ms'][1]:.2f} ({hides})"

        lines.append(f"| {layer} | {tokens} | {ranks} | {saved} | {peak} | {compute} | {transfer('expert_ring')} | "
                     f"{transfer('token_ring')} |")
    return lines
