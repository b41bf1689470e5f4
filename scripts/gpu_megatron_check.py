"""Megatron-Core integration check on one GPU: MoEBlaze against the stock alltoall dispatcher with
SequentialMLP (the fastest stock path without Transformer Engine).

1. Equivalence, bf16: an MoE layer shaped like Qwen3-30B-A3B's (d 2048, expert ffn 768, 128
   experts, top-8) and a small GPTModel (4 MoE layers with a shared expert). Stock and MoEBlaze get
   the same weights and inputs; both are compared with the stock model in float32 (TF32 off): the
   output or loss and every gradient. MoEBlaze passes a quantity when its relative error is below
   8 * 2**-9 (the bf16 bar of the op's own tests) or at most twice the stock implementation's.
2. Step time: forward+backward of one MoE layer (router, dispatch, experts, combine) for the
   Qwen3-like shape and a coarse one (16 experts, top-4), and of the GPTModel; median of timed
   repetitions (CUDA events) and peak memory above what was allocated before the step.

Both models use the same attention (torch SDPA, moeblaze_megatron.training.attention) so that
attention does not dominate the full-model numbers. A table is printed last; --out receives the JSON.

    python scripts/gpu_megatron_check.py --out benchmarks/results/gpu_megatron_check.json

--device cpu --smoke runs every code path on tiny shapes on the CPU (a test of this script).

--te checks the Transformer Engine layer-spec path instead (benchlib.te_checks, needs TE): MoEBlaze
under --transformer-impl transformer_engine against the stock alltoall + TEGroupedMLP with the
fused permutation and the fused router, same weights, on the TE MoE layer and a TE GPTModel, both
against a float32 local-spec evaluation of the same weights; torch_dist checkpoints saved by
either and loaded by the other; and their step times (default out gpu_megatron_check_te.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from benchlib.megatron_checks import format_table, run_checks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON report (default $OUT or benchmarks/results, gpu_megatron_check[_te].json)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (for testing this script on the CPU)")
    parser.add_argument("--check-tokens", type=int, default=4096, help="tokens of the layer equivalence check")
    parser.add_argument("--time-tokens", type=int, default=16384, help="tokens of the layer timing")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--te", action="store_true", help="the Transformer Engine layer-spec checks (GPU, TE)")
    parser.add_argument("--no-router-fusion", dest="router_fusion", action="store_false",
                        help="with --te: Megatron's own router for both (default: TE's fused router for both)")
    args = parser.parse_args(argv)
    if args.te and (args.device != "cuda" or args.smoke):
        parser.error("--te runs on the GPU only (Transformer Engine); drop --device cpu / --smoke")
    if not args.router_fusion and not args.te:
        parser.error("--no-router-fusion applies to --te")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU (use --device cpu --smoke to test the script)")
    out = args.out or os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                   "gpu_megatron_check_te.json" if args.te else "gpu_megatron_check.json")
    if args.te:
        from benchlib.te_checks import format_te_table, run_te_checks

        report = run_te_checks(args.check_tokens, args.time_tokens, args.reps, router_fusion=args.router_fusion)
        table = format_te_table(report)
    else:
        report = run_checks(args.device, args.smoke, args.check_tokens, args.time_tokens, args.reps)
        table = format_table(report["checks"], report["timings"])
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report["meta"]))
    print(table)
    return 0 if all(c["pass"] for c in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
