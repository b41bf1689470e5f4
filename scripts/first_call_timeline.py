"""A layer's first forward+backward on the GPU, as a timeline: each launch that goes through
Triton (compiling, loading, tuning) with its seconds, each wait for the compile workers and each
worker's reply; PROFILE=1 adds cProfile's cumulative table. Run it with a fresh TRITON_CACHE_DIR
for a cold first call (benchmarks/NOTES.md, twenty-first session):

    TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/first_call_timeline.py dsv3 [seconds to sleep after
    building the layer, as a job's setup would]
"""

import cProfile
import io
import os
import pstats
import sys
import time
import torch
from benchlib.shapes import CONFIGS, config_name, make_inputs
from benchlib.peers import MoEBlaze
from moeblaze_megatron.kernels import compile_workers, launch
T0 = [None]
events = []
def now(): return time.perf_counter() - T0[0]
class TFuture(compile_workers.Future):
    def set_result(self, r):
        events.append((now(), "worker done %.2f" % r)); super().set_result(r)
compile_workers.Future = TFuture
orig_tt = launch._through_triton
def tt(kernel, constexprs, grid, args):
    k = kernel.autotuner if isinstance(kernel, launch._OneConfig) else kernel
    name = getattr(getattr(k, "fn", k), "__name__", "?")
    t = now(); r = orig_tt(kernel, constexprs, grid, args); events.append((t, f"through_triton {name} {now()-t:.2f}s")); return r
launch._through_triton = tt
orig_wait = compile_workers.wait_for
def wf(k):
    t = now(); orig_wait(k); d = now() - t
    if d > 0.01: events.append((t, f"wait_for {d:.2f}s"))
compile_workers.wait_for = wf
launch.compile_workers.wait_for = wf
T, d, h, E, K = CONFIGS[config_name(sys.argv[1])]
x, ids, probs, fc1, fc2 = make_inputs(T, d, h, E, K, "swiglu", torch.bfloat16, torch.device("cuda"), 0)
impl = MoEBlaze(fc1, fc2, "swiglu", E, K)
xi = x.clone().requires_grad_(); pi = probs.clone().requires_grad_(); gy = torch.randn_like(x)
torch.cuda.synchronize()
if len(sys.argv) > 2:
    compile_workers.start(); time.sleep(float(sys.argv[2]))
pr = cProfile.Profile() if os.environ.get('PROFILE') else None
T0[0] = time.perf_counter()
pr and pr.enable()
impl(xi, ids, pi).backward(gy); torch.cuda.synchronize()
pr and pr.disable()
print(f"first call {now():.2f} s", compile_workers.stats())
for t, e in sorted(events): print(f"  {t:6.2f} {e}")
if pr:
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(35); print(s.getvalue()[-6000:])
