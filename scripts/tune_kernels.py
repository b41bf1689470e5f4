"""Time every expert-GEMM launch of one MoE layer, config by config, on the GPU.

The layer's forward+backward (SwiGLU, or --activation silu / gelu) runs six grouped GEMMs (fc1
with the activation, fc2, dH with the activation backward, dW2, dW1, dX). For each, this script
launches the kernel with each candidate ``triton.Config`` (bypassing the autotuner), checks the
result against the autotuned launch, and reports ms and TFLOP/s next to a dense torch.mm of the
same size measured in the same run, so a config list can be chosen from numbers rather than
guesses. Diagnostic ops: dw1_contiguous (dW1 without the gather), dw1_grouped_mm /
dw2_grouped_mm (a gather plus torch._grouped_mm, checked against the kernel's dW1 / dW2),
fc2_grouped_mm / dx_grouped_mm (the two GEMMs whose rows are already in expert order, as
torch._grouped_mm), dw1_pointer / dw2_pointer
(the expert-order operand through pointer loads instead of the TMA descriptor the layer uses) and
fc1_act_pointer / dh_act_bwd_pointer / dx_pointer (the weight through pointer loads instead of the
layer's TMA descriptor), fc2_rows_pointer / dx_rows_pointer (A and the output, in expert order,
through pointers instead of ragged TMA descriptors) and fc1_plain / dh_plain (fc1 and dH with a
plain store instead of their fused epilogues: what the epilogues cost). With --energy-seconds S
each op, as the layer launches it and at every candidate config, and a dense mm of fc1's size,
also gets its energy per launch (NVML, nvidia-ml-py) over S seconds of back-to-back launches: on a
power-capped GPU what a launch costs the step, which may rank the configs otherwise than their ms.

    python scripts/tune_kernels.py --shapes conf4,qwen3,7b --out /tmp/tune
    python scripts/tune_kernels.py --shapes conf6 --activation silu --ops fc1_act,dh_act_bwd
    python scripts/tune_kernels.py --shapes 7b --ops fc1_act,fc2,dh_act_bwd,dw2,dw1,dx --configs none --energy-seconds 0.6
"""

from __future__ import annotations

import argparse
import sys

import torch
from benchlib.shapes import ALIASES, CONFIGS, config_name

from moeblaze_megatron.kernels.gather_gemm import ACTIVATION_IDS


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="conf4,qwen3,7b")
    ap.add_argument("--ops", default="fc1_act,fc2,dh_act_bwd,dw2,dw1,dx",
                    help="comma list; also the diagnostic dw1_contiguous, dw1_grouped_mm, dw1_pointer, dw2_pointer, "
                    "fc2_grouped_mm, dx_grouped_mm, fc1_act_pointer, dh_act_bwd_pointer, dx_pointer, fc2_rows_pointer, "
                    "dx_rows_pointer, fc1_plain, dh_plain")
    ap.add_argument("--activation", default="swiglu", choices=sorted(ACTIVATION_IDS))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--configs", default="", help="comma list of label parts (e.g. '128x256,/s5'): time only "
                    "the candidate configs whose label contains one of them (default: all)")
    ap.add_argument("--time-limit", type=float, default=400.0, help="seconds; stops starting new shapes after")
    ap.add_argument("--energy-seconds", type=float, default=0.0,
                    help="also read each op's energy per call (as the layer launches it and at each candidate "
                    "config, and a dense mm of fc1's size) through NVML over back-to-back loops of this many seconds "
                    "(default 0: not read)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if config_name(s) not in CONFIGS]
    if unknown:
        sys.exit(f"--shapes: unknown {unknown}; known: {', '.join([*CONFIGS, *ALIASES])}")
    if args.energy_seconds < 0:
        sys.exit(f"--energy-seconds must be >= 0, got {args.energy_seconds}")
    if not torch.cuda.is_available():
        sys.exit("tune_kernels.py needs a CUDA GPU")
    from benchlib.kernel_tuning import tune

    tune(args.shapes.split(","), args.ops.split(","), args.activation, args.reps, args.configs.split(","),
         args.time_limit, out=args.out, energy_seconds=args.energy_seconds)


if __name__ == "__main__":
    main()
