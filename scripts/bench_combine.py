"""Time the combine kernel with and without its router-probability side outputs on the GPU, next
to the torch ops those side outputs replace (``RoutingPlan.permute_probs`` before the activation
backward, ``unpermute_rows`` of the summed partials after it).

    python scripts/bench_combine.py 7b,qwen3,conf4,dsv3

Each time is the median of 20 launches, each queued behind a short GPU spin (no host wait timed).
"""

from __future__ import annotations

import argparse
import sys

from benchlib.shapes import known_config_names


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="?", default="7b,qwen3,conf4,dsv3",
                    help="comma list of bench_layer.py configs (aliases: qwen3, 7b, ...)")
    args = ap.parse_args(argv)
    configs = known_config_names(args.configs, "bench_combine.py")
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_combine.py needs a CUDA GPU")
    from benchlib.combine_bench import combine_times

    for cfg in configs:
        times = combine_times(cfg, torch.device("cuda"))
        print(f"== {cfg} GPU ms: " + "  ".join(f"{k} {v:.3f}" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
