"""Call 5: every kernel launch of one moeblaze conf4 step, in order, under sustained load (1.5 s
of back-to-back steps, then three profiled back to back). From the repository root:
OUT=$OUT python3 benchmarks/results/2026-11-30-h200-v12/call5_timeline.py"""
import os, sys, time, json
import torch
sys.path[:0] = ["scripts", "."]
import bench_layer as bl
out = os.environ.get("OUT", "/tmp/out")
res = {}
for act in ("swiglu", "silu"):
    T, d, h, E, K = bl.CONFIGS["conf4"]
    steps = bl.layer_steps(bl.MoEBlaze, T, d, h, E, K, act, torch.bfloat16, "cuda")
    steps(2)
    t0 = time.time()
    while time.time() - t0 < 1.5:
        steps(4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        steps(3)
    ks = sorted((ev.time_range.start, ev.time_range.end, ev.name[:50]) for ev in prof.events()
                if ev.device_type == torch.autograd.DeviceType.CUDA)
    n = len(ks) // 3
    rows = []
    for i in range(3):
        step = ks[i * n:(i + 1) * n]
        rows.append([(name, (e - s) / 1e3) for s, e, name in step])
        span = (step[-1][1] - step[0][0]) / 1e3
        print(f"{act} step {i}: span {span:.2f} ms, {n} kernels")
    for j, (name, _) in enumerate(rows[0]):
        print(f"  {j:2d} {name:50s} " + " ".join(f"{r[j][1]:8.3f}" for r in rows))
    res[act] = rows
json.dump(res, open(f"{out}/timeline_conf4.json", "w"), indent=1)
