"""Call 1 (experiment, not the package): the staggered first wave of call1_stagger.patch, per
kernel under sustained load, then the layer with and without it. Run from the repository root
with the patch applied:  OUT=$OUT python3 benchmarks/results/2026-11-30-h200-v12/call1_stagger_probe.py"""
import json, os, sys, time, runpy
import torch
sys.path[:0] = ["scripts", "."]
import tune_kernels as tk
from bench_layer import CONFIGS, ALIASES
from moeblaze_megatron.kernels import expert_gemm as eg

OUT = os.environ.get("OUT", "/tmp/out")
_orig = eg.row_gemm
FORCE = {"ns": None}
def patched(*a, **k):
    if FORCE["ns"] is not None and "stagger" not in k:
        k["stagger"] = FORCE["ns"]
    return _orig(*a, **k)
eg.row_gemm = patched

def sustained(fn, reset, seconds=0.8, reps=30):
    t0 = time.time()
    while time.time() - t0 < seconds:
        reset(); fn(); torch.cuda.synchronize() if False else None
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        reset(); s.record(); fn(); e.record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in ev)
    return t[len(t) // 2], sum(t) / len(t)

records = []
shapes = os.environ.get("SHAPES", "conf4:swiglu,conf4:silu").split(",")
for spec in shapes:
    name, act = spec.split(":")
    T, d, h, E, K = CONFIGS[ALIASES.get(name, name)]
    plan, refs, ops, _ = tk.layer_ops(T, d, h, E, K, 0, activation=act)
    ops = {o[0]: o for o in ops}
    for opname, variants in (("dh_act_bwd", [0, 6000, 12000, 18000, 0, 24000, 9000]),
                             ("fc1_act", [0, 6000, 12000, 0, 18000]),
                             ("fc2", [0, 12000, 0]), ("dx", [0, 12000, 48000, 0])):
        _, flops, kind, launch, outputs, reset = ops[opname]
        base = None
        for ns in variants:
            FORCE["ns"] = ns
            med, mean = sustained(lambda: launch(None), reset)
            out = [o.clone() for o in outputs()]
            if base is None:
                base = out
            same = all(torch.equal(a, b) for a, b in zip(out, base))
            rec = dict(shape=name, act=act, op=opname, stagger_ns=ns, ms_median=med, ms_mean=mean,
                       tflops=flops / med / 1e9, bitwise_same=same)
            records.append(rec)
            print(f"{name:6s} {act:6s} {opname:10s} stagger {ns:6d} ns: median {med:7.3f} ms mean {mean:7.3f} "
                  f"({flops / med / 1e9:5.0f} TFLOP/s) same={same}", flush=True)
    FORCE["ns"] = None
    del plan, refs, ops
    torch.cuda.empty_cache()
os.makedirs(OUT, exist_ok=True)
json.dump(records, open(f"{OUT}/stagger_kernels.json", "w"), indent=1)

# The layer: auto stagger against none, same process.
for tag, per_k in (("on", eg.STAGGER_NS_PER_K), ("off", 0), ("on2", eg.STAGGER_NS_PER_K)):
    eg.STAGGER_NS_PER_K = per_k
    sys.argv = ["bench_layer.py", "--out", OUT, "--tag", f"stagger_{tag}", "--configs", os.environ.get("LAYER", "conf4"),
                "--acts", os.environ.get("ACTS", "swiglu,silu"), "--reps", "5", "--impls", os.environ.get("IMPLS", "moeblaze")]
    print(f"== layer stagger {tag} ({per_k} ns per K)", flush=True)
    try:
        runpy.run_path("scripts/bench_layer.py", run_name="__main__")
    except SystemExit:
        pass
