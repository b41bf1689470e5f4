"""Where a moeblaze layer step waits on the host: a profiler trace of one forward+backward (from an
idle GPU, as bench_layer.py times it) with each launch's host range labelled, printed as a
timeline (host ranges and GPU kernels, ms from the step's start) and saved as a Chrome trace.

    python scripts/trace_layer.py 7b,qwen3 --out /tmp/traces

The profiler slows the host, so read the gaps as an upper bound; bench_layer.py's "host" and
"queued" columns measure the same thing unprofiled.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchlib.shapes import CONFIGS, known_config_names


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", help="comma list of bench_layer.py configs (aliases: qwen3, 7b, ...)")
    ap.add_argument("--activation", default="swiglu")
    ap.add_argument("--out", default=None, help="folder for the Chrome traces (none written without it)")
    args = ap.parse_args(argv)
    configs = known_config_names(args.configs, "trace_layer.py")
    import torch

    if not torch.cuda.is_available():
        sys.exit("trace_layer.py needs a CUDA GPU")
    from benchlib.layer_bench import layer_steps
    from benchlib.baselines import MoEBlaze
    from benchlib.profiling import label_launch_sites, timeline, trace_steps

    label_launch_sites()
    for cfg in configs:
        T, d, h, E, K = CONFIGS[cfg]
        prof = trace_steps(layer_steps(MoEBlaze, T, d, h, E, K, args.activation, torch.bfloat16, torch.device("cuda")))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.out, f"trace_{cfg}_{args.activation}.json"))
        print(f"== {cfg} {args.activation}: " + "\n".join(timeline(prof, "STEP2")), flush=True)


if __name__ == "__main__":
    main()
