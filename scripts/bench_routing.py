"""Time building the routing plan against the index computations of stock MoE stacks.

For every shape (T tokens, E experts, top-k K; random distinct top-k ids) it times:

* ``three_step``, ``sort``, ``auto``: ``build_routing_plan(..., method=..., validate=False)``;
* ``auto_validated``: ``method="auto", validate=True`` (adds the id checks and one host sync);
* ``argsort``: torchtitan's recipe: a stable argsort of the flattened int64 ids, tokens per expert
  and their prefix sum, and the inverse permutation (the plan's token_index_map);
* ``megatron``: the index part of Megatron-Core's ``moe_utils.permute`` (megatron-core 0.19: a
  stable descending argsort of the transposed [E, T] routing map): megatron.core's own function
  when it imports (on a [T, 1] token tensor, so the gather it also does is negligible), else a
  reimplementation of the same steps; the JSON says which;
* ``masked_select``: the older Megatron index computation (transpose the routing map, then
  ``masked_select`` the token ids out of it).
The routing map [T, E] that both Megatron variants start from is made outside the timed region:
Megatron's router produces it anyway.

Before timing, every method's output is checked against the PyTorch plan on a few shapes.

Two timings per method (medians, L2 flushed before each run): ``median_ms``, eager calls, i.e. the
wall time of enqueueing and running them, which at small T is the host's launch cost; and on the
GPU ``graph_ms``, replays of the method captured in a CUDA graph, i.e. its GPU time alone. In
training the host enqueues ahead of the GPU, so the GPU time is what the routing costs on the
critical path. A method that cannot be captured (a host synchronization: ``auto_validated``,
``masked_select``, perhaps Megatron's permute) gets None, and the JSON's ``graph_not_captured``
says why.

    python scripts/bench_routing.py                  # the full sweep on the GPU (~3 minutes)
    python scripts/bench_routing.py --quick          # a few shapes
    python scripts/bench_routing.py --device cpu --quick   # tiny shapes, Triton interpreted

Writes JSON to --out (default $OUT/bench_routing.json, else benchmarks/results/bench_routing.json)
and a markdown table beside it (same name, .md), and prints the table last.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from benchlib.routing_bench import run


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="a few shapes (tiny ones on the CPU)")
    parser.add_argument("--out", type=Path, default=None, help="JSON output path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out is None:
        out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path("benchmarks/results")
        args.out = out_dir / "bench_routing.json"
    if args.device == "cpu" and not args.quick:
        parser.error("--device cpu runs only the tiny --quick sweep (the Triton build is interpreted)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --device cpu --quick for a smoke run")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        # Triton reads this when the kernels are first imported, which run() does.
        os.environ["TRITON_INTERPRET"] = "1"
    run(args.device, args.quick, args.out, args.seed)


if __name__ == "__main__":
    main()
