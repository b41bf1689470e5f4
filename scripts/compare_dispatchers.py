#!/usr/bin/env python3
"""Train one model with the stock dispatcher and with MoEBlaze: same weights, seed and data.

    python scripts/compare_dispatchers.py                        # auto: GPU if there is one
    python scripts/compare_dispatchers.py --family deepseek_v3   # on a GPU: mixtral | deepseek_v3 | qwen3_moe
    python scripts/compare_dispatchers.py --device cpu --steps 30
    python scripts/compare_dispatchers.py --baseline alltoall_te --stock-variants te,te_unfused_router,te_op_fuser
    python scripts/compare_dispatchers.py --baseline alltoall_te --stock-variants te_recipe --family deepseek_v3
    python scripts/compare_dispatchers.py --steps 20 --megatron-args --moe-router-topk 4 --moe-aux-loss-coeff 1e-2

On the CPU only the families whose fp32 training state fits the CPU's budget run (tiny:
training.families.CPU_TRAINING_STATE_BYTES); the others are refused before anything is built.

--megatron-args adds Megatron flags to every run (after the script's own, so they win): either the
rest of the command line (--megatron-args --moe-router-topk 4, last on the line; this script's
own flags go before it) or one value after '=' (--megatron-args='--moe-router-topk 4'). Every
argument, these included, is checked before anything trains: with Megatron's own parser and
validation for each run, and with the plugin's refusal for MoEBlaze's (an option MoEBlaze does
not support, e.g. --fp8-format, is named as one error line, exit status 2).

The stock side: a Megatron dispatcher with SequentialMLP (--baseline alltoall, the default on a
GPU: what Megatron runs without Transformer Engine), or --baseline alltoall_te, the stock MoE of
Megatron users with Transformer Engine: alltoall + TEGroupedMLP (--moe-grouped-gemm) with the
speed options of a --stock-variants form (training.families.TE_STOCK_VARIANTS). Given several,
each trains --variant-steps steps from the same weights on the same batches and the fastest is
the baseline (--select-only stops there and writes variants.json). Flags a variant gives the
model outside the dispatcher and experts (the fused router; te_recipe's CUDA graphs over attn
moe_router moe_preprocess, shared-expert overlap and --manual-gc, Megatron's performance recipe)
apply to MoEBlaze too; te_recipe_moe_graph then has MoEBlaze's graphs capture its attention and
its whole MoE layer. Both sides use
the same attention core (--attention: Transformer Engine's with alltoall_te, SDPA otherwise).

Reports median step time, tokens/s, peak memory and the activation memory autograd saves, both
loss curves (a PNG overlay and a markdown table), the largest micro-batch (or the longest
sequence) that fits a memory budget for each dispatcher (GPU), and checks that a checkpoint
saved by the stock run resumes, under either dispatcher, on the uninterrupted loss curve.
Writes compare.json, report.md and losses.png under --out (default
runs/compare/<family>-<cpu|gpu>, git-ignored) and says where; exits non-zero if the losses
diverge beyond rounding noise or the resume check fails.

Rounding noise is measured, not assumed: a control run repeats the stock run with every initial
weight moved by one unit in the last place of its dtype. The divergence that this produces is what
any change of rounding (another summation order, another kernel) can produce: at every step the
candidate may differ from the stock run by at most NOISE_FACTOR times the control's envelope (the
running maximum of |control - stock|). --control candidate repeats the MoEBlaze run instead (the
envelope then is |control - MoEBlaze|): the same measure of how far rounding noise carries on this
model and data, at MoEBlaze's cost per step (a third of the TE baseline's), so that 500-step runs
of both fit one 10-minute GPU call. Before the control has diverged (the first steps, where a
wrong gradient shows first) a floor applies instead: NOISE_FLOOR times the loss's rounding noise,
u |loss| / sqrt(tokens per step) (u: the compute dtype's unit roundoff; a per-token rounding error
averages over the step's tokens), and never less than NOISE_FLOOR float32 ulps of the loss (the
resolution of the number compared).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from benchlib.comparison import check_counts
from benchlib.dispatcher_compare import run

MEGATRON_ARGS = "--megatron-args"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--family", help="model family (training.families.MODEL_FAMILIES); default: tiny on CPU, qwen3_moe on GPU")
    p.add_argument("--baseline", help="stock dispatcher (SequentialMLP experts), or alltoall_te (alltoall + "
                   "TEGroupedMLP + a --stock-variants form); default allgather on CPU, alltoall on GPU")
    p.add_argument("--stock-variants", help="with --baseline alltoall_te: comma list of TE stock forms "
                   "(training.families.TE_STOCK_VARIANTS: te, te_unfused_router, te_op_fuser, te_shared_overlap, "
                   "te_recipe, te_recipe_moe_graph); "
                   "several are timed and the fastest kept (default te)")
    p.add_argument("--variant-steps", type=int, default=8,
                   help="training steps per stock variant when several are timed (the first 3 left out)")
    p.add_argument("--select-only", action="store_true",
                   help="time the --stock-variants, write variants.json and stop")
    p.add_argument("--attention", choices=("auto", "sdpa", "local"),
                   help="attention core of both runs (--moeblaze-attention); default auto (Transformer Engine's) "
                   "with --baseline alltoall_te, else sdpa")
    p.add_argument("--control", choices=("baseline", "candidate"), default="baseline",
                   help="which run the rounding-noise control repeats from weights moved by one ulp")
    p.add_argument("--candidate", default="moeblaze",
                   help="dispatcher compared against the baseline (moeblaze, or a stock one of Megatron's)")
    p.add_argument("--steps", type=int, help="training steps per run")
    p.add_argument("--warmup", type=int, help="first steps left out of the step-time median")
    p.add_argument("--seq-length", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", default="builtin",
                   help="'builtin' (the Python stdlib corpus, built on first use), 'mock' (Megatron's "
                   "mock data), or a Megatron indexed-dataset prefix")
    p.add_argument("--search", choices=("none", "micro-batch", "seq-length"),
                   help="what to grow until the memory budget is reached (GPU only; default micro-batch)")
    p.add_argument("--memory-budget-gib", type=float, default=80.0, help="memory budget of the search")
    p.add_argument("--search-time-limit", type=float, default=90.0, help="seconds of search per dispatcher")
    p.add_argument("--no-resume-check", dest="resume_check", action="store_false")
    p.add_argument(MEGATRON_ARGS, type=shlex.split, default=[], metavar="FLAGS",
                   help="Megatron flags added to every run: the rest of the command line (--megatron-args "
                   "--moe-router-topk 4, last) or one value after '=' (--megatron-args='--moe-router-topk 4')")
    p.add_argument("--out", help="output folder (default runs/compare/<family>-<cpu|gpu>, git-ignored)")
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = []
    if MEGATRON_ARGS in argv:
        # The natural form: everything after the flag is Megatron's.
        argv, rest = argv[:argv.index(MEGATRON_ARGS)], argv[argv.index(MEGATRON_ARGS) + 1:]
        if not rest:
            p.error(f"{MEGATRON_ARGS}: expected Megatron flags after it (e.g. {MEGATRON_ARGS} --moe-router-topk 4)")
        own = [token for token in rest if token.split("=", 1)[0] in p._option_string_actions]
        if own:
            p.error(f"{MEGATRON_ARGS} takes the rest of the command line as Megatron's flags, and {own[0]} is this "
                    f"script's own: put it before {MEGATRON_ARGS}")
    args = p.parse_args(argv)
    args.megatron_args += [flag for token in rest for flag in shlex.split(token)]
    check_counts(p, args, ("steps", "seq_length", "micro_batch_size", "memory_budget_gib", "search_time_limit", "lr"))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python scripts/compare_dispatchers.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    return run(args, command)


if __name__ == "__main__":
    sys.exit(main())
