"""One MoE layer, forward and forward+backward, routing given: moeblaze against its peers.

Runs on one GPU. For each configuration and activation it first checks every implementation's
output and gradients against a float64 reference (at a reduced token count, same d/h/E/K), then
times the full shape with CUDA events (median, under sustained load: see benchlib.timing.cuda_time),
and records the bytes saved for backward (parameters excluded) and the peak memory above inputs,
weights and their gradients.

    python scripts/bench_layer.py --out benchmarks/results            # every config, every peer
    python scripts/bench_layer.py --configs conf4,qwen3 --acts swiglu --impls moeblaze,grouped_mm

Peers (each skipped with a note when not importable): grouped_mm (torch._grouped_mm pipeline, as
torchtitan does it), megatron_sequential (Megatron-Core alltoall dispatcher + SequentialMLP),
te_grouped (Megatron-Core alltoall dispatcher with the fused permutation + TEGroupedMLP, Transformer
Engine's grouped GEMM: the stock MoE with TE at EP = 1; needs TE), megablocks (dMoE, grouped path),
liger (Liger-Kernel's fused MoE), scattermoe, sonicmoe (SonicMoE's general-routing entry with our
routing; ../shared/tools/sonic-peer.sh), and under the blockwise FP8 recipe moeblaze_fp8 and
te_grouped_fp8 (checked against float64 at FP8's bar). A shape NAME@rN is NAME's widths with N
rows per expert on average (the rows-per-expert sweeps: --configs qwen3@r64,qwen3@r512,...).
"""

from __future__ import annotations

import argparse
import os
import sys

from benchlib.accuracy import CHECK_TOKENS
from benchlib.baselines import IMPLS
from benchlib.shapes import CONFIGS, config_names


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma list (aliases: conf2, qwen3, 7b, dsv3, ...)")
    parser.add_argument("--acts", default="swiglu,silu", help="comma list of swiglu, silu, gelu")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement at least (median)")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="fwd+bwd: timed for at least this long (fwd and queued: half), after --warmup-seconds")
    parser.add_argument("--warmup-seconds", type=float, default=1.0,
                        help="fwd+bwd: run this long before timing, so the GPU's clock settles under the load (fwd: half)")
    parser.add_argument("--check-tokens", type=int, default=CHECK_TOKENS)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--tag", default="bench_layer")
    parser.add_argument("--profile", action="store_true", help="profile moeblaze: CUDA time per kernel, idle gaps between kernels")
    parser.add_argument("--power", choices=("auto", "off"), default="auto",
                        help="auto: read the GPU's energy, power and clock through NVML (nvidia-ml-py) during the "
                        "back-to-back fwd+bwd steps, where it answers; off: do not")
    parser.add_argument("--report-only", metavar="JSON", help="rewrite the markdown table and the charts of a saved run")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.report_only:
        from benchlib.layer_report import rewrite_report

        rewrite_report(args.report_only)
        return
    if args.seconds < 0 or args.warmup_seconds < 0:
        sys.exit(f"--seconds and --warmup-seconds must be >= 0, got {args.seconds} and {args.warmup_seconds}")
    if args.reps < 1:
        sys.exit(f"--reps must be at least 1 (timed steps per measurement), got {args.reps}")
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_layer.py needs a CUDA GPU")
    configs = config_names(args.configs)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown --configs {unknown}; known: {list(CONFIGS)}")
    from benchlib.layer_bench import run

    run(configs, args.acts.split(","), args.impls.split(","), args.out, args.tag, args.reps, args.seconds,
        args.warmup_seconds, args.check_tokens, check=not args.no_check, profile=args.profile,
        power=args.power == "auto")


if __name__ == "__main__":
    main()
