"""Host time of each launch in a moeblaze layer step, with the GPU kept busy so the host never
waits: what the GPU idles on when a step starts from an idle GPU (7B-like, conf1).

    python scripts/host_overhead.py 7b,conf1 [--out FILE.json]

For each config: the host microseconds of a forward+backward step and of the forward alone, with
direct launches (kernels/launch.py) and through Triton's own launch path (MOEBLAZE_DIRECT_LAUNCH=0),
interleaved; then of every launch site called on its own (the plan, each GEMM, the combine), of
fc1's launch through each layer under it (Triton's path, a fixed config, pointer loads instead of
the TMA descriptor, the compiled kernel called with nothing around it) and of a few reference
calls (an empty Triton kernel, a torch op). Last, the step under cProfile: the functions with the
most cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_layer as bl  # noqa: E402

from moeblaze_megatron import build_routing_plan  # noqa: E402
from moeblaze_megatron.kernels import expert_gemm as eg  # noqa: E402
from moeblaze_megatron.kernels.combine import combine  # noqa: E402
from moeblaze_megatron.moe_mlp import check_moe_mlp_args  # noqa: E402


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pass


def host_us(fn, reps=60):
    """Median host microseconds of ``fn`` with the GPU busy (its launches queue, none waits)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        if i % 20 == 0:
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)
        t0 = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    return statistics.median(times)


def host_ab(fn, reps):
    """``host_us`` of ``fn`` with cached direct launches and with Triton's launch path, alternating."""
    direct, triton_path = [], []
    fn()
    for i in range(reps):
        if i % 10 == 0:
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)
        for times, forced in ((direct, False), (triton_path, True)):
            os.environ["MOEBLAZE_DIRECT_LAUNCH"] = "0" if forced else "1"
            t0 = time.perf_counter()
            fn()
            times.append(1e6 * (time.perf_counter() - t0))
    os.environ["MOEBLAZE_DIRECT_LAUNCH"] = "1"
    torch.cuda.synchronize()
    return statistics.median(direct), statistics.median(triton_path)


def direct_launch(kernel, grid, args, constexprs):
    """The compiled kernel behind ``kernel`` (a triton.autotune) for these arguments, with the
    autotuner's pick, and a closure launching it with no binding or cache lookup."""
    config = kernel.best_config
    fn = kernel.fn
    device = torch.cuda.current_device()
    kwargs = {**constexprs, **config.all_kwargs()}
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(kernel.arg_names, args)), **kwargs})
    compiled = fn.run(*args, grid=grid, warmup=False, **kwargs)
    binder = fn.device_caches[device][4]
    bound, _, _ = binder(*args, **kwargs, debug=False, instrumentation_mode="")
    values = list(bound.values())
    meta = dict(bound)
    g = grid(meta) if callable(grid) else grid
    g = tuple(g) + (1,) * (3 - len(g))
    stream = torch.cuda.current_stream().cuda_stream

    def launch():
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

    return launch


def site_costs(cfg, activation="swiglu"):
    T, d, h, E, K = bl.CONFIGS[cfg]
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    x, ids, probs, fc1, fc2 = bl.make_inputs(T, d, h, E, K, activation, dtype, dev, 3)
    impl = bl.MoEBlaze(fc1, fc2, activation, E, K)
    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    gy = torch.randn_like(x)
    leaves = impl.params() + [xi, pi]

    def step():
        for t in leaves:
            t.grad = None
        impl(xi, ids, pi).backward(gy)

    step()
    torch.cuda.synchronize()
    out = {}
    # Cached direct calls against every launch through Triton's launch path (as before
    # kernels/launch.py), interleaved so both see the same host state.
    out["step fwd+bwd"], out["step fwd+bwd, Triton launches"] = host_ab(step, reps=40)
    out["forward (grad)"], out["forward (grad), Triton launches"] = host_ab(lambda: impl(xi, ids, pi), reps=40)
    out["check_moe_mlp_args"] = host_us(lambda: check_moe_mlp_args(
        xi, ids, pi, impl.fc1, impl.fc2, activation, None, "activation", "auto", False))
    out["build_routing_plan"] = host_us(lambda: build_routing_plan(ids, E, validate=False))
    plan = build_routing_plan(ids, E, validate=False)
    rows = plan.expert_token_indices.shape[0]
    pre = x.new_empty(rows, fc1.shape[1])
    hbuf = x.new_empty(rows, h)

    def fc1_launch(**kw):
        eg.row_gemm(x, impl.fc1, hbuf, plan, transpose_weight=True, epilogue=eg.EPI_ACT_FWD, activation=activation,
                    gather_a=True, pre=pre, store_pre=True, n=h, **kw)

    fc1_launch()
    out["fc1 row_gemm"] = host_us(fc1_launch)
    os.environ["MOEBLAZE_DIRECT_LAUNCH"] = "0"
    out["fc1 row_gemm, Triton launch"] = host_us(fc1_launch)
    out["fc1 row_gemm, Triton, pointer weight"] = host_us(lambda: fc1_launch(tma_weight=False))
    os.environ["MOEBLAZE_DIRECT_LAUNCH"] = "1"
    best = eg._row_gemm_kernel.best_config
    out["fc1 row_gemm (fixed config)"] = host_us(lambda: fc1_launch(config=best))
    out["fc1 row_gemm, pointer weight"] = host_us(lambda: fc1_launch(tma_weight=False))
    # The launch's arguments as row_gemm builds them, through a capture of eg._launch.
    captured = {}
    real_launch = eg._launch
    eg._launch = lambda kernel, grid, args, constexprs, config: captured.update(
        kernel=kernel, grid=grid, args=args, constexprs=constexprs)
    fc1_launch(tma_weight=False)
    eg._launch = real_launch
    try:
        launch = direct_launch(captured["kernel"], captured["grid"], captured["args"], captured["constexprs"])
        out["fc1 compiled kernel direct"] = host_us(launch)
    except Exception as exc:  # a diagnostic: report and go on
        out["fc1 compiled kernel direct"] = f"failed: {type(exc).__name__}: {exc}"[:200]
    out["TensorDescriptor.from_tensor"] = host_us(lambda: eg.TensorDescriptor.from_tensor(
        impl.fc1.view(E, 2, h, d), [1, 2, 128, 64]))
    out["expert_order_gemm (fc2)"] = host_us(lambda: eg.expert_order_gemm(hbuf, impl.fc2, plan, transpose_weight=True, n=d))
    y_rows = eg.expert_order_gemm(hbuf, impl.fc2, plan, transpose_weight=True, n=d)
    ps = probs.new_empty(rows)
    out["combine (fwd)"] = host_us(lambda: combine(y_rows, plan.token_index_map, probs, dtype, probs_sorted=ps))
    gw = torch.empty_like(impl.fc1)
    out["weight_grad (dW1)"] = host_us(lambda: eg.weight_grad(pre, x, gw, plan, gather_a=False, gather_b=True))
    out["torch.empty"] = host_us(lambda: torch.empty(rows, h, dtype=dtype, device=dev))
    small = torch.zeros(16, device=dev)
    out["torch add_ (small)"] = host_us(lambda: small.add_(1))
    out["empty Triton kernel"] = host_us(lambda: _empty_kernel[(1,)](small, 16, BLOCK=16))
    out["get_device_capability"] = host_us(lambda: torch.cuda.get_device_capability(dev))

    step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows_ = sorted(((ct, nc, f"{os.path.basename(fn)}:{line}({name})")
                    for (fn, line, name), (_, nc, _, ct, _) in stats.items()
                    if "synchronize" not in name), reverse=True)[:40]
    profile = [f"{1e3 * ct / 20:.3f} ms  {nc / 20:.0f}x  {name}" for ct, nc, name in rows_]
    return out, profile


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", help="comma list of bench_layer.py configs (aliases: 7b, conf1, ...)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args(argv)
    results = {}
    for cfg in args.configs.split(","):
        cfg = bl.ALIASES.get(cfg, cfg)
        costs, profile = site_costs(cfg)
        results[cfg] = dict(host_us=costs, cprofile_cumulative=profile)
        print(f"== {cfg}: cProfile, cumulative ms per step (profiled)")
        print("\n".join(profile))
    print(f"== host microseconds per call, GPU busy (median); torch {torch.__version__}, Triton {triton.__version__}")
    names = list(next(iter(results.values()))["host_us"])
    print(f"{'':34}" + "".join(f"{c[:16]:>18}" for c in results))
    for name in names:
        cells = [results[c]["host_us"][name] for c in results]
        print(f"{name:34}" + "".join(f"{v:18.1f}" if isinstance(v, float) else f"{str(v)[:17]:>18}" for v in cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           command="python " + " ".join(sys.argv), results=results), f, indent=1)


if __name__ == "__main__":
    main()
