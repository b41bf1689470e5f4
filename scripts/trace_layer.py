"""Where a moeblaze layer step waits on the host: a profiler trace of one forward+backward (from an
idle GPU, as bench_layer.py times it) with each launch's host range labelled, printed as a
timeline (host ranges and GPU kernels, ms from the step's start) and saved as a Chrome trace.

    python scripts/trace_layer.py 7b,qwen3 --out /tmp/traces

The profiler slows the host, so read the gaps as an upper bound; bench_layer.py's "host" and
"queued" columns measure the same thing unprofiled.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(__file__))
import bench_layer as bl  # noqa: E402

# (module, attribute) of every launch site of the layer, labelled "M:<name>" in the trace.
LAUNCH_SITES = [
    ("moeblaze_megatron.moe_mlp", "check_moe_mlp_args"), ("moeblaze_megatron.moe_mlp", "build_routing_plan"),
    ("moeblaze_megatron.kernels.moe_mlp", "row_gemm"), ("moeblaze_megatron.kernels.moe_mlp", "expert_order_gemm"),
    ("moeblaze_megatron.kernels.moe_mlp", "combine"), ("moeblaze_megatron.kernels.moe_mlp", "weight_grad"),
]


def label_launch_sites():
    for module_name, name in LAUNCH_SITES:
        module = importlib.import_module(module_name)
        fn = getattr(module, name)

        @functools.wraps(fn)
        def labelled(*args, _fn=fn, _label=f"M:{name}", **kwargs):
            with record_function(_label):
                return _fn(*args, **kwargs)

        setattr(module, name, labelled)


def timeline(prof, step_name):
    events = list(prof.events())
    step = next(e for e in events if e.name == step_name and e.device_type != torch.autograd.DeviceType.CUDA)
    s0, s1 = step.time_range.start, step.time_range.end
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.start >= s0
                  and not e.name.startswith(("M:", "STEP"))), key=lambda e: e.time_range.start)
    host = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CUDA and e.name.startswith("M:")
                   and s0 <= e.time_range.start <= s1), key=lambda e: e.time_range.start)
    lines = [f"host step {(s1 - s0) / 1e3:.3f} ms; first kernel at +{(gpu[0].time_range.start - s0) / 1e3:.3f} ms; "
             f"last kernel ends at +{(max(e.time_range.end for e in gpu) - s0) / 1e3:.3f} ms; {len(gpu)} kernels"]
    rows = [(e.time_range.start, "host", e) for e in host] + [(e.time_range.start, "gpu ", e) for e in gpu]
    for _, kind, e in sorted(rows, key=lambda r: r[0]):
        lines.append(f"  {kind} +{(e.time_range.start - s0) / 1e3:7.3f} .. +{(e.time_range.end - s0) / 1e3:7.3f}  "
                     f"{e.name[:60]}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", help="comma list of bench_layer.py configs (aliases: qwen3, 7b, ...)")
    ap.add_argument("--activation", default="swiglu")
    ap.add_argument("--out", default=None, help="folder for the Chrome traces (none written without it)")
    args = ap.parse_args(argv)
    label_launch_sites()
    for cfg in args.configs.split(","):
        cfg = bl.ALIASES.get(cfg, cfg)
        T, d, h, E, K = bl.CONFIGS[cfg]
        steps = bl.layer_steps(bl.MoEBlaze, T, d, h, E, K, args.activation, torch.bfloat16, torch.device("cuda"))
        steps(3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(3):
                with record_function(f"STEP{i}"):
                    steps(1)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.out, f"trace_{cfg}_{args.activation}.json"))
        print(f"== {cfg} {args.activation}: " + "\n".join(timeline(prof, "STEP2")), flush=True)


if __name__ == "__main__":
    main()
