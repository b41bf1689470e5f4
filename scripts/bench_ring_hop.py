"""One hop of RelayMoE's ring on one GPU, at the expert-parallel memory model's shapes.

    python scripts/bench_ring_hop.py --out DIR                    # the README table's shapes, H200
    python scripts/bench_ring_hop.py --layers qwen3-30b-a3b --ranks 8 --tokens 16384

For each layer shape, tokens per rank T and expert-parallel size P: the compute of one hop (this
rank's slots on one shard of E/P experts, the ring's own hop functions with the fused kernels,
bf16), forward and backward (fc1 recomputed), median ms after a warm-up; its peak memory against
the model's; and, at each layer's first T, its output and gradients against float64. Writes
ring_hop.json under --out, then prints the memory model's table (scripts/ep_memory_model.py) with
the measured hop times in place of the TFLOP/s estimate, and the hop table last. Exit status 1
if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from benchlib.ep_memory import LAYERS, model_rows, table_lines as model_table
from benchlib.ring_hop import run_hops, table_lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default=",".join(LAYERS), help=f"comma list of {', '.join(LAYERS)}")
    ap.add_argument("--ranks", default="8,16,64", help="comma list of expert-parallel sizes P")
    ap.add_argument("--tokens", default="4096,16384,65536", help="comma list of tokens per rank")
    ap.add_argument("--link-gbps", type=float, default=450.0, help="ring link bandwidth, GB/s one way (NVLink 4: 450)")
    ap.add_argument("--warmup-seconds", type=float, default=0.3, help="warm-up per measurement")
    ap.add_argument("--seconds", type=float, default=0.5, help="timed time per measurement (at least 5 calls)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/ring_hop"), help="output folder")
    args = ap.parse_args(argv)
    layers = [name for name in args.layers.split(",") if name]
    if [name for name in layers if name not in LAYERS]:
        ap.error(f"--layers: known layers are {list(LAYERS)}")
    try:
        ranks = [int(p) for p in args.ranks.split(",")]
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error("--ranks and --tokens take comma lists of integers")
    if min(ranks) < 2 or min(tokens) < 1 or args.link_gbps <= 0 or args.warmup_seconds < 0 or args.seconds < 0:
        ap.error("--ranks must be >= 2, --tokens >= 1, --link-gbps positive, --warmup-seconds and --seconds >= 0")
    for name in layers:
        bad = [p for p in ranks if LAYERS[name].experts % p]
        if bad:
            ap.error(f"--ranks: {bad} do not divide {name}'s {LAYERS[name].experts} experts")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the hop runs the fused kernels); the memory model alone: scripts/ep_memory_model.py")
    device = torch.device("cuda")
    records = run_hops(layers, ranks, tokens, device, warmup_s=args.warmup_seconds, min_s=args.seconds)
    measured = {(r["layer"], r["tokens_per_rank"], r["P"]): (r["forward_ms"], r["backward_ms"]) for r in records}
    model = [row for name in layers for p in ranks for t in tokens
             for row in model_rows(name, LAYERS[name], t, p, tflops=400.0, link_gbps=args.link_gbps,  # tflops: unused, every hop measured
                                   measured=measured)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "command": " ".join([sys.argv[0], *sys.argv[1:]]),
           "link_gbps": args.link_gbps}
    (out / "ring_hop.json").write_text(json.dumps({"environment": env, "hops": records, "model": model}, indent=1) + "\n")
    print("\n".join(model_table(model)))
    print()
    print("\n".join(table_lines(records)))
    failed = [r for r in records if r.get("passed") is False]
    for r in failed:
        print(f"FAILED: {r['layer']} T={r['tokens_per_rank']} P={r['P']}: {r['errors']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
