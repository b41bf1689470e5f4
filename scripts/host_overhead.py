"""Host time of each launch in a moeblaze layer step, with the GPU kept busy so the host never
waits: what the GPU idles on when a step starts from an idle GPU (7B-like, conf1).

    python scripts/host_overhead.py 7b,conf1 [--out FILE.json]

For each config: the host microseconds of a forward+backward step and of the forward alone, with
direct launches (kernels/launch.py) and through Triton's own launch path (SETTINGS.direct_launch
off, as MOEBLAZE_DIRECT_LAUNCH=0 sets it), interleaved; then of every launch site called on its
own (the plan, each GEMM, the combine), of fc1's launch through each layer under it (Triton's
path, a fixed config, pointer loads instead of the TMA descriptor, the compiled kernel called
with nothing around it) and of a few reference calls (an empty Triton kernel, torch ops,
autograd's Function.apply). Then the step under cProfile (the functions with the most cumulative
time), the forward under it (the most own time), the host's lead (the step from an idle GPU
behind spins of growing length: the step's time, less the spin's, stops falling once the spin
covers the host's time to its first launches) and a launch timeline of one step from an idle
GPU (each launch's host and GPU time, and the entry and exit of the functions on the way).
"""

from __future__ import annotations

import argparse
import json
import sys

from benchlib.shapes import known_config_names


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", help="comma list of bench_layer.py configs (aliases: 7b, conf1, ...)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args(argv)
    configs = known_config_names(args.configs, "host_overhead.py")
    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("host_overhead.py needs a CUDA GPU")
    from benchlib.host_costs import site_costs, table_lines

    results = {}
    for cfg in configs:
        costs, profiles = site_costs(cfg)
        results[cfg] = dict(host_us=costs, cprofile_cumulative=profiles["step_cumulative"],
                            cprofile_forward_own=profiles["forward_own"], lead_sweep_ms=profiles["lead_sweep"],
                            launch_timeline=profiles["launch_timeline"])
        print(f"== {cfg}: cProfile, cumulative ms per step (profiled)")
        print("\n".join(profiles["step_cumulative"]))
        print(f"== {cfg}: cProfile, own ms per forward (profiled)")
        print("\n".join(profiles["forward_own"]))
        print(f"== {cfg}: step ms from an idle GPU behind a spin, the spin's own time taken out")
        print("  ".join(f"{spin} ms: {ms:.3f}" for spin, ms in profiles["lead_sweep"].items()))
        print(f"== {cfg}: each launch of a step from an idle GPU, ms after the step began (median)")
        print("\n".join(profiles["launch_timeline"]))
    print(f"== host microseconds per call, GPU busy (median); torch {torch.__version__}, Triton {triton.__version__}")
    print("\n".join(table_lines(results)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           command="python " + " ".join(sys.argv), results=results), f, indent=1)


if __name__ == "__main__":
    main()
