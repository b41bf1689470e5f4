"""A layer's first forward+backward on the GPU as a timeline: each launch that goes through Triton
(compiling, loading, tuning) with its seconds, each wait for the compile workers, each worker's
reply; PROFILE=1 adds cProfile's cumulative table. With a fresh Triton cache it is a cold first
call (benchmarks/NOTES.md, twenty-first session):

    TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/first_call_timeline.py dsv3 [SETUP_SECONDS]

SETUP_SECONDS: a pause between building the layer (which starts the compile workers, as the
Megatron and torchtitan layers do) and its first call, standing for a job's setup.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
from benchlib.peers import MoEBlaze
from benchlib.shapes import CONFIGS, config_name, make_inputs

from moeblaze_megatron.kernels import compile_workers, launch


def instrument(events, clock):
    """Record into ``events`` (seconds, text) every launch through Triton, every wait for the
    workers longer than 10 ms and every worker's reply."""

    class TimedFuture(compile_workers.Future):
        def set_result(self, result):
            events.append((clock(), f"worker done ({result:.2f} s compiling)"))
            super().set_result(result)

    compile_workers.Future = TimedFuture
    through_triton, wait_for = launch._through_triton, compile_workers.wait_for

    def timed_through_triton(kernel, constexprs, grid, args):
        base = kernel.autotuner if isinstance(kernel, launch._OneConfig) else kernel
        name = getattr(getattr(base, "fn", base), "__name__", "?")
        started = clock()
        compiled = through_triton(kernel, constexprs, grid, args)
        events.append((started, f"{name} through Triton {clock() - started:.2f} s"))
        return compiled

    def timed_wait_for(kernel):
        started = clock()
        wait_for(kernel)
        if clock() - started > 0.01:
            events.append((started, f"waited {clock() - started:.2f} s for the workers"))

    launch._through_triton = timed_through_triton
    compile_workers.wait_for = timed_wait_for

    import triton

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if not cache_hit:  # compiled here, not found in the cache (the workers' compiles are found)
            events.append((clock(), f"compiled here: {getattr(getattr(src, 'fn', None), '__name__', src)}"))

    triton.knobs.compilation.listener = listener


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", help=f"a layer shape: {', '.join(CONFIGS)} (or an alias: qwen3, 7b, dsv3, ...)")
    ap.add_argument("setup_seconds", nargs="?", type=float, default=0.0)
    args = ap.parse_args(argv)
    events, t0 = [], [time.perf_counter()]

    def clock():
        return time.perf_counter() - t0[0]

    instrument(events, clock)  # from here on: what this process compiles, too
    T, d, h, E, K = CONFIGS[config_name(args.shape)]
    x, ids, probs, fc1, fc2 = make_inputs(T, d, h, E, K, "swiglu", torch.bfloat16, torch.device("cuda"), 0)
    layer = MoEBlaze(fc1, fc2, "swiglu", E, K)
    xi, pi, gy = x.clone().requires_grad_(), probs.clone().requires_grad_(), torch.randn_like(x)
    torch.cuda.synchronize()
    time.sleep(args.setup_seconds)
    profile = cProfile.Profile() if os.environ.get("PROFILE") == "1" else None
    t0[0] = time.perf_counter()
    if profile:
        profile.enable()
    layer(xi, ids, pi).backward(gy)
    torch.cuda.synchronize()
    if profile:
        profile.disable()
    print(f"{args.shape}: first call {clock():.2f} s after {args.setup_seconds:.0f} s of setup; workers: "
          f"{compile_workers.stats()}")
    for at, text in sorted(events):
        print(f"  {at:6.2f}  {text}")
    if profile:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(35)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
