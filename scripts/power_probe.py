"""Energy per step of one MoE layer's forward+backward, back to back and queued behind a spin.

bench_layer.py times every step back to back (the GPU rests only for the host's ~0.1 ms
turnaround between steps) and queued behind a 20 ms one-thread spin. On the large shapes every
implementation runs faster queued: the H200 is power-capped there, and a rested GPU starts each
step at a higher clock (benchmarks/results/2026-11-29-h200-v10). Back to back, the step time is
then the step's energy over the cap, and energy per step is what to compare. This script runs
each mode for a few seconds per implementation and reads, through NVML, the board's energy
counter around the loop and its power, SM clock and clock-limit reasons every 20 ms:

    python scripts/power_probe.py --configs conf4 --impls moeblaze,megablocks --seconds 4

Per (config, implementation, mode): ms per step (CUDA events, median), steps, joules per step
(queued: the spin's own energy, measured alone, taken out), mean watts and SM MHz over the loop,
and the share of samples whose clock was held down by the power cap. Output: a table and JSON.
With --kernels, each kernel's CUDA time per step in both modes too (torch.profiler), to see
which kernels stretch when the GPU gets no rest.
"""

from __future__ import annotations

import argparse
import sys

from benchlib.baselines import IMPL_CLASSES
from benchlib.shapes import CONFIGS, config_names


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="conf4", help="comma list (aliases: qwen3, 7b, conf6, ...)")
    ap.add_argument("--impls", default="moeblaze,megablocks", help=f"comma list of {', '.join(IMPL_CLASSES)}")
    ap.add_argument("--activation", default="swiglu", choices=["swiglu", "silu", "gelu"])
    ap.add_argument("--seconds", type=float, default=4.0, help="per mode and implementation")
    ap.add_argument("--kernels", action="store_true",
                    help="also profile each kernel's CUDA time per step in both modes (which kernels stretch)")
    ap.add_argument("--out", default=None, help="folder for power_probe.json")
    args = ap.parse_args(argv)
    configs = config_names(args.configs)
    unknown = [c for c in configs if c not in CONFIGS] + [i for i in args.impls.split(",") if i not in IMPL_CLASSES]
    if unknown:
        sys.exit(f"power_probe.py: unknown {unknown}; configs: {list(CONFIGS)}, impls: {list(IMPL_CLASSES)}")
    if args.seconds <= 0:
        sys.exit(f"power_probe.py: --seconds must be positive, got {args.seconds}")
    import torch

    if not torch.cuda.is_available():
        sys.exit("power_probe.py needs a CUDA GPU (and NVML, the nvidia-ml-py package)")
    from benchlib.power import probe

    probe(configs, args.impls.split(","), args.activation, args.seconds, kernels=args.kernels, out=args.out)


if __name__ == "__main__":
    main()
