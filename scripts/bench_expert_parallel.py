"""Expert parallelism: MoEBlaze against Megatron's stock dispatcher at EP = world size.

    torchrun --nproc-per-node 8 scripts/bench_expert_parallel.py --out DIR       # GPUs, NCCL, bf16
    torchrun --nproc-per-node 2 scripts/bench_expert_parallel.py --device cpu --shape tiny --out DIR

Every rank holds num_experts / world_size experts of each MoE layer and routes its own tokens.
MoEBlaze runs in each of --ep-modes: ``moeblaze`` (the alltoall exchange, each token once per
destination rank) and ``moeblaze_ring`` (RelayMoE's ring, ``--moeblaze-ep-mode ring``).
The stock dispatcher is alltoall + SequentialMLP on GPU, allgather + SequentialMLP on the CPU (see
STOCK).

1. Equivalence: one MoE layer with the moeblaze dispatcher and one with the stock dispatcher, both
   at EP = world size, and a float32 reference at EP = 1 (every expert on every rank, stock
   alltoall), all with the same global weights (the compute dtype's values) on each rank's own
   tokens. Output, input gradient, router gradient and expert gradients (the EP = 1
   expert gradients summed over ranks, as the EP layers gather every rank's tokens) are compared
   with the reference; a quantity passes when its relative error is below the dtype's bar
   (8 * 2**-9 in bf16, 1e-5 in fp32) or at most twice the stock layer's.
2. Layer step: forward+backward of one MoE layer (Qwen3-30B-A3B-like on GPU: d 2048, expert ffn
   768, 128 experts, top-8, 16384 tokens per rank, bf16): median time (CUDA events; perf_counter on
   CPU) and peak memory above what the step starts with (the CUDA allocator's; null on CPU), the
   slowest rank's. Also the rows each dispatcher's all-to-all received, against the unique
   (token, destination rank) pairs (what MoEBlaze should receive) and the (token, expert) pairs
   (what stock receives).
3. Model step: a small GPTModel of MoE layers (the qwen3_moe family on GPU, tiny on CPU) trained
   by training.train_loop.Trainer (Megatron's DDP, optimizer, schedule) at the same EP: median step
   time, peak memory, first-step loss from the same weights and tokens.
4. Longest sequence (GPU): per dispatcher, the longest sequence whose training step fits
   --memory-budget-gib on every rank (doubling, then bisection in steps of 256).

Rank 0 prints progress, writes ``ep{N}.json`` under --out and prints a table last. Exits non-zero
if the equivalence fails or MoEBlaze received more rows than unique (token, rank) pairs.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

# Progress lines only: Megatron warns, on every rank, about every optional library it lacks (at
# import) and torch about the deprecated collectives Megatron calls.
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402
from benchlib.ep_bench import DEFAULTS, MOEBLAZE_VARIANTS, SHAPES, STOCK, run  # noqa: E402  (sets the NCCL defaults on import)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/expert_parallel"),
                   help="output folder (rank 0 writes ep{N}.json there)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if there is a GPU, else cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), help="layer and model size; default qwen3 on cuda, tiny on cpu")
    p.add_argument("--check-tokens", type=int, help="tokens per rank of the equivalence check")
    p.add_argument("--time-tokens", type=int, help="tokens per rank of the layer timing")
    p.add_argument("--reps", type=int, help="timed repetitions of the layer step")
    p.add_argument("--model-steps", type=int, help="timed training steps of the model (after 2 warm-up steps)")
    p.add_argument("--seq-length", type=int, help="sequence length of the model step")
    p.add_argument("--micro-batch-size", type=int, help="sequences per rank per model step")
    p.add_argument("--memory-budget-gib", type=float, default=80.0, help="memory budget of the sequence search")
    p.add_argument("--search-seconds", type=float,
                   help="time limit of the sequence search per dispatcher (GPU only; 0 skips it; default 60)")
    p.add_argument("--skip-model", action="store_true", help="only the layer parts (1 and 2)")
    p.add_argument("--ep-modes", default="alltoall,ring",
                   help="MoEBlaze's expert-parallel modes to run, comma list of alltoall, ring "
                   "(--moeblaze-ep-mode; the ring picks its expert or token ring by bytes)")
    args = p.parse_args(argv)
    args.ep_modes = [m for m in args.ep_modes.split(",") if m]
    if not args.ep_modes or set(args.ep_modes) - set(MOEBLAZE_VARIANTS):
        p.error(f"--ep-modes takes a comma list of {', '.join(MOEBLAZE_VARIANTS)}, got {','.join(args.ep_modes)!r}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("check_tokens", "time_tokens", "reps", "model_steps", "seq_length", "micro_batch_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.memory_budget_gib <= 0 or args.search_seconds < 0:
        p.error(f"--memory-budget-gib must be positive and --search-seconds non-negative, got "
                f"{args.memory_budget_gib} and {args.search_seconds}")
    args.stock = STOCK[args.device]
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available (use --device cpu to run on the CPU with gloo)")
    if args.device == "cpu" and args.search_seconds > 0:
        p.error("--search-seconds needs --device cuda (the search measures the CUDA allocator's peak)")
    return args


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
