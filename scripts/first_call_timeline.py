"""A layer's first forward+backward on the GPU as a timeline: each launch that goes through Triton
(compiling, loading, tuning) with its seconds, each wait for the compile workers, each worker's
reply; PROFILE=1 adds cProfile's cumulative table. With a fresh Triton cache it is a cold first
call (benchmarks/NOTES.md, twenty-first session):

    TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/first_call_timeline.py dsv3 [SETUP_SECONDS]

SETUP_SECONDS: a pause between building the layer (which starts the compile workers, as the
Megatron and torchtitan layers do) and its first call, standing for a job's setup. KEYS=1 logs
the parts of Triton's cache key of every compile, here and in the workers, and names the part
that differs for each kernel compiled here that a worker compiled under another key.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
from benchlib.baselines import MoEBlaze
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


# Run first in this process and in each worker (KEYS=1): every compile appends its cache key's parts
# (Triton's get_cache_key: source, backend, options, environment) to the file MOEBLAZE_KEYS_LOG names.
_KEY_SPY = """
import json, os
import triton.compiler.compiler as _cc

def _spy(src, backend, options, env_vars, _key=_cc.get_cache_key):
    fn = getattr(src, "fn", None)
    entry = dict(name=getattr(src, "name", "?"), pid=os.getpid(), src=src.hash(), backend=backend.hash(),
                 options_hash=options.hash(), env=str(sorted(env_vars.items())),
                 options={k: str(v) for k, v in options.__dict__.items()},
                 fn=getattr(fn, "cache_key", None), signature=str(getattr(src, "signature", None)),
                 attrs=str(getattr(src, "attrs", None)), constants=str(getattr(src, "constants", None)))
    with open(os.environ["MOEBLAZE_KEYS_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\\n")
    return _key(src, backend, options, env_vars)

_cc.get_cache_key = _spy
"""


def spy_on_keys(path):
    """KEYS=1: log every compile's key parts, here and in the workers (which start after this)."""
    os.environ["MOEBLAZE_KEYS_LOG"] = path
    open(path, "w").close()
    exec(_KEY_SPY, {})
    compile_workers._BOOTSTRAP = _KEY_SPY + compile_workers._BOOTSTRAP


def key_differences(path) -> list[str]:
    """For each kernel compiled here under a key no worker used, what differs from the workers'
    compiles of a kernel of that name."""
    entries = [json.loads(line) for line in open(path)]
    here = [e for e in entries if e["pid"] == os.getpid()]
    workers = [e for e in entries if e["pid"] != os.getpid()]
    parts = ("src", "backend", "options_hash", "env")
    worker_keys = {tuple(e[p] for p in parts) for e in workers}
    lines = []
    for e in here:
        if tuple(e[p] for p in parts) in worker_keys:
            continue
        same_name = [w for w in workers if w["name"] == e["name"]]
        if not same_name:
            lines.append(f"{e['name']}: no worker compiled it")
            continue
        best = min(same_name, key=lambda w: sum(w[p] != e[p] for p in parts))
        diff = [p for p in parts + ("fn", "signature", "attrs", "constants") if best[p] != e[p]]
        fields = [f"{k}: here {e['options'].get(k)} / worker {best['options'].get(k)}"
                  for k in sorted(set(e["options"]) | set(best["options"]))
                  if e["options"].get(k) != best["options"].get(k)]
        detail = {p: (e[p], best[p]) for p in diff if p in ("env", "signature", "attrs", "constants", "backend")}
        lines.append(f"{e['name']}: differs in {diff}; options {fields}; {detail}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", help=f"a layer shape: {', '.join(CONFIGS)} (or an alias: qwen3, 7b, dsv3, ...)")
    ap.add_argument("setup_seconds", nargs="?", type=float, default=0.0)
    args = ap.parse_args(argv)
    events, t0 = [], [time.perf_counter()]

    def clock():
        return time.perf_counter() - t0[0]

    keys_log = None
    if os.environ.get("KEYS") == "1":
        keys_log = os.path.join(os.environ.get("TRITON_CACHE_DIR") or ".", "keys.jsonl")
        spy_on_keys(keys_log)
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
    if keys_log:
        print("cache keys compiled here that no worker used:")
        for line in key_differences(keys_log) or ["  none"]:
            print(f"  {line}")
    if profile:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(35)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
