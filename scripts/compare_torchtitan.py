#!/usr/bin/env python3
"""Train stock torchtitan and the MoEBlaze override (same model, weights, seed and data) and compare.

    python scripts/compare_torchtitan.py                  # auto: a GPU if there is one, else the CPU demo
    python scripts/compare_torchtitan.py --device cpu     # tiny model, reference backend, ~1 minute

torchtitan 0.3.0's Qwen3 MoE model (``training.titan_models``) is trained by a minimal loop over
torchtitan's own pieces (``training.titan_loop``: its parallelize function with FSDP2 bfloat16
mixed precision, AdamW, LR schedule, chunked loss, gradient clipping and CUDA-graph wrapper) on
the built-in corpus, three times: stock torchtitan (grouped_mm experts), the override
(``--override.imports moeblaze_megatron.torchtitan.moeblaze_experts``, applied by torchtitan's
``apply_overrides``) from stock's initial weights, and a control: stock from those weights moved
by one bfloat16 ulp each. Reports the median step time (warm-up steps left out), tokens/s, peak
memory, the bytes the MoE layers' routed experts (and the whole model) save for backward in one
forward pass, on a GPU the largest micro-batch whose steps fit ``--memory-budget-gib`` (doubling
then bisection, two steps per probe), and the loss curves: at every step the override's loss must
lie within 4 x the running maximum of |control - stock| of stock's (before the control diverges, 4
x the loss's rounding noise u |loss| / sqrt(tokens per step), u = 2^-8). Prints a short table
last, writes compare_torchtitan.json and losses.png (the loss overlay) under --out (default $OUT, else
runs/compare_torchtitan/<family>-<cpu|gpu>), and exits non-zero if the losses diverge.

On torch 2.11, which lacks ``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.12; only
type hints of torchtitan's FSDP helpers name it on one GPU), a stand-in that raises if it is
ever constructed takes its place (benchmark path only; recorded in the JSON), and every run uses
the plain loss (``--loss auto``): there stock torchtitan's chunked loss stops in its first
backward.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from benchlib.comparison import check_counts
from benchlib.titan_compare import run

from moeblaze_megatron.training.titan_choices import ACTIVATION_CHECKPOINTS, ATTENTIONS, COMPILES, LOSSES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--family", choices=("qwen3_moe", "tiny"),
                   help="model (training.titan_models.TITAN_FAMILIES); default tiny on CPU, qwen3_moe on GPU")
    p.add_argument("--attention", choices=ATTENTIONS, default="sdpa",
                   help="inner attention of both runs: sdpa (causal, no compilation) or torchtitan's flex "
                   "(block-causal by document, compiled)")
    p.add_argument("--activation-checkpoint", choices=ACTIVATION_CHECKPOINTS, default="none",
                   help="torchtitan's activation checkpointing, the same in every run")
    p.add_argument("--compile", choices=COMPILES, default="off",
                   help="torch.compile of every run's transformer blocks and loss, as torchtitan's --compile.enable "
                   "with that --compile.backend (default off, torchtitan's default)")
    p.add_argument("--cuda-graphs", choices=("on", "off"),
                   help="torchtitan's CUDA-graph step (its default on CUDA); default on for GPU, off on CPU")
    p.add_argument("--backend", choices=("auto", "triton", "reference"),
                   help="the override's backend; default auto on GPU, reference on CPU")
    p.add_argument("--recompute", choices=("activation", "fc1"), default="activation")
    p.add_argument("--loss", choices=("auto", *LOSSES), default="auto",
                   help="every run's loss: torchtitan's chunked loss (its Qwen3 configs') or the plain cross "
                   "entropy over whole logits; auto: chunked on torch >= 2.12, plain before (torch 2.11's FSDP2 "
                   "cannot train the chunked loss: training.titan_loop.default_loss)")
    p.add_argument("--count-saved", choices=("on", "off"),
                   help="count the bytes saved for backward in the first step (saved-tensor hooks and module hooks "
                   "around its forward, which torch.compile cannot trace); default on, off with --compile")
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup", type=int, help="first steps left out of the step-time median")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--local-batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--search", choices=("none", "micro-batch"), help="GPU only; default micro-batch on GPU")
    p.add_argument("--memory-budget-gib", type=float, default=80.0)
    p.add_argument("--search-time-limit", type=float, default=60.0, help="seconds of search per run at most")
    p.add_argument("--time-budget", type=float,
                   help="seconds the whole comparison should take: the searches get what the runs leave of it "
                   "(default 300 on GPU, one device call; 0: no budget)")
    p.add_argument("--out", help="output folder (default $OUT, else runs/compare_torchtitan/<family>-<cpu|gpu>)")
    p.add_argument("--profile-layer", choices=("on", "off"), default="off",
                   help="also profile the queued routed-experts timing (torch.profiler): each run's ops and kernels "
                   "by total time, in layer_profile_<run>.txt under --out")
    args = p.parse_args(argv)
    check_counts(p, args, ("steps", "seq_len", "local_batch_size", "memory_budget_gib", "search_time_limit", "lr"))
    if args.time_budget is not None and args.time_budget < 0:
        p.error(f"--time-budget must be at least 0 (0: no budget), got {args.time_budget}")
    if args.seq_len is not None and args.seq_len % 8:
        p.error(f"--seq-len must be a multiple of 8 (torchtitan's chunked loss splits it in 8), got {args.seq_len}")
    if args.count_saved is None:
        args.count_saved = "on" if args.compile == "off" else "off"
    elif args.count_saved == "on" and args.compile != "off":
        p.error("--count-saved on counts through module hooks that torch.compile cannot trace (fullgraph); "
                "count with --compile off")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python scripts/compare_torchtitan.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    return run(args, command)


if __name__ == "__main__":
    sys.exit(main())
