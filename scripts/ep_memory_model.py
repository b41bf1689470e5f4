"""Per-rank memory of one MoE layer under expert parallelism, and the ring's overlap condition.

    python scripts/ep_memory_model.py --wide --hops benchmarks/results/2026-12-01-h200-v14/ring_hop.json
                                                                       # the README's table
    python scripts/ep_memory_model.py --layers qwen3-30b-a3b --ranks 8 --tokens 16384 --tflops 400

For each layer shape, tokens per rank T and expert-parallel size P: the bytes one MoE layer keeps
for backward and its transient peak per rank, for Megatron's stock alltoall, our alltoall mode and
both ring modes (scripts/benchlib/ep_memory.py has the model and its assumptions: uniform
routing, bf16, SwiGLU); for the rings, a hop's compute time (measured on a GPU by
scripts/bench_ring_hop.py, from its JSON given as --hops; else estimated at --tflops) against its
transfer time at --link-gbps (one way): the ring hides its transfers when compute >= transfer. A
markdown table is printed (--wide: one row per shape); --out writes the records as JSON.
"""

from __future__ import annotations

import argparse
import json

from benchlib.ep_memory import LAYERS, measured_hops, model_rows, table_lines, wide_table_lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default=",".join(LAYERS), help=f"comma list of {', '.join(LAYERS)}")
    ap.add_argument("--ranks", default="8,16,64", help="comma list of expert-parallel sizes P")
    ap.add_argument("--tokens", default="4096,16384,65536", help="comma list of tokens per rank")
    ap.add_argument("--tflops", type=float, default=400.0,
                    help="expert GEMM rate per GPU for a hop's compute (H200 measured 370-570 on one layer)")
    ap.add_argument("--link-gbps", type=float, default=450.0, help="ring link bandwidth, GB/s one way (NVLink 4: 450)")
    ap.add_argument("--hops", help="bench_ring_hop.py's ring_hop.json: measured hop compute times")
    ap.add_argument("--wide", action="store_true", help="one row per (layer, T, P) instead of one per mode")
    ap.add_argument("--out", help="JSON file for the records")
    args = ap.parse_args(argv)
    layers = [name for name in args.layers.split(",") if name]
    unknown = [name for name in layers if name not in LAYERS]
    if unknown:
        ap.error(f"--layers: unknown {unknown}; known: {list(LAYERS)}")
    try:
        ranks = [int(p) for p in args.ranks.split(",")]
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error("--ranks and --tokens take comma lists of integers")
    if min(ranks) < 2 or min(tokens) < 1 or args.tflops <= 0 or args.link_gbps <= 0:
        ap.error("--ranks must be >= 2, --tokens >= 1, --tflops and --link-gbps positive")
    measured = None
    if args.hops:
        try:
            with open(args.hops) as f:
                measured = measured_hops(json.load(f)["hops"])
        except (OSError, KeyError, ValueError) as error:
            ap.error(f"--hops: cannot read bench_ring_hop records from {args.hops}: {error}")
    records = []
    for name in layers:
        for p in ranks:
            if LAYERS[name].experts % p:
                ap.error(f"--ranks: {p} does not divide {name}'s {LAYERS[name].experts} experts")
            for t in tokens:
                records += model_rows(name, LAYERS[name], t, p, tflops=args.tflops, link_gbps=args.link_gbps,
                                      measured=measured)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tflops": args.tflops, "link_gbps": args.link_gbps, "records": records}, f, indent=1)
    print("\n".join(wide_table_lines(records) if args.wide else table_lines(records)))


if __name__ == "__main__":
    main()
