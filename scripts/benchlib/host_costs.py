"""Host time of each launch in a moeblaze layer step, with the GPU kept busy so the host never
waits (scripts/host_overhead.py): the step with direct launches and through Triton's own launch
path, every launch site on its own, fc1's launch through each layer under it, a few reference
calls, and the step under cProfile."""

from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels.combine import combine
from moeblaze_megatron.kernels.knobs import KNOBS
from moeblaze_megatron.kernels.row_gemm import EPI_ACT_FWD, expert_order_gemm, row_gemm, row_gemm_call, row_gemm_kernel
from moeblaze_megatron.kernels.row_gemm_ws import on_hopper
from moeblaze_megatron.kernels.tuning import row_gemm_with
from moeblaze_megatron.kernels.weight_grad import weight_grad
from moeblaze_megatron.moe_mlp import check_moe_mlp_args

from .peers import MoEBlaze
from .profiling import cprofile_rows
from .shapes import CONFIGS, make_inputs
from .timing import host_us


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pass


def host_ab(fn, reps):
    """``host_us`` of ``fn`` with cached direct launches and with Triton's launch path, alternating."""
    direct, triton_path = [], []
    fn()
    try:
        for i in range(reps):
            if i % 10 == 0:
                torch.cuda.synchronize()
                torch.cuda._sleep(200_000_000)
            for times, forced in ((direct, False), (triton_path, True)):
                KNOBS.direct_launch = not forced
                t0 = time.perf_counter()
                fn()
                times.append(1e6 * (time.perf_counter() - t0))
    finally:
        KNOBS.direct_launch = True
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
    """({what: host microseconds per call}, the step's cProfile listing) at config ``cfg``."""
    T, d, h, E, K = CONFIGS[cfg]
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    x, ids, probs, fc1, fc2 = make_inputs(T, d, h, E, K, activation, dtype, dev, 3)
    impl = MoEBlaze(fc1, fc2, activation, E, K)
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
    fc1_args = (x, impl.fc1, hbuf, plan)
    # The Triton kernel's launch, layer by layer below; the warp-specialized kernel's beside it.
    fc1_kwargs = dict(transpose_weight=True, epilogue=EPI_ACT_FWD, activation=activation, gather_a=True, pre=pre,
                      store_pre=True, n=h, warp_specialize=False)

    def fc1_launch(**kw):
        row_gemm(*fc1_args, **{**fc1_kwargs, **kw})

    fc1_launch()
    out["fc1 row_gemm"] = host_us(fc1_launch)
    if on_hopper(torch.cuda.get_device_capability()):
        fc1_launch(warp_specialize=True)
        out["fc1 row_gemm, warp-specialized"] = host_us(lambda: fc1_launch(warp_specialize=True))
    KNOBS.direct_launch = False
    try:
        out["fc1 row_gemm, Triton launch"] = host_us(fc1_launch)
        out["fc1 row_gemm, Triton, pointer weight"] = host_us(lambda: fc1_launch(tma_weight=False))
    finally:
        KNOBS.direct_launch = True
    best = row_gemm_kernel.best_config
    out["fc1 row_gemm (fixed config)"] = host_us(lambda: row_gemm_with(best, *fc1_args, **fc1_kwargs))
    out["fc1 row_gemm, pointer weight"] = host_us(lambda: fc1_launch(tma_weight=False))
    # The launch's arguments as row_gemm builds them.
    try:
        launch = direct_launch(*row_gemm_call(*fc1_args, **fc1_kwargs, tma_weight=False))
        out["fc1 compiled kernel direct"] = host_us(launch)
    except Exception as exc:  # a diagnostic: report and go on
        out["fc1 compiled kernel direct"] = f"failed: {type(exc).__name__}: {exc}"[:200]
    out["TensorDescriptor.from_tensor"] = host_us(lambda: TensorDescriptor.from_tensor(
        impl.fc1.view(E, 2, h, d), [1, 2, 128, 64]))
    out["expert_order_gemm (fc2)"] = host_us(lambda: expert_order_gemm(hbuf, impl.fc2, plan, transpose_weight=True, n=d))
    y_rows = expert_order_gemm(hbuf, impl.fc2, plan, transpose_weight=True, n=d)
    ps = probs.new_empty(rows)
    out["combine (fwd)"] = host_us(lambda: combine(y_rows, plan.token_index_map, probs, dtype, probs_sorted=ps))
    gw = torch.empty_like(impl.fc1)
    out["weight_grad (dW1)"] = host_us(lambda: weight_grad(pre, x, gw, plan, gather_a=False, gather_b=True))
    out["torch.empty"] = host_us(lambda: torch.empty(rows, h, dtype=dtype, device=dev))
    small = torch.zeros(16, device=dev)
    out["torch add_ (small)"] = host_us(lambda: small.add_(1))
    out["empty Triton kernel"] = host_us(lambda: _empty_kernel[(1,)](small, 16, BLOCK=16))
    out["get_device_capability"] = host_us(lambda: torch.cuda.get_device_capability(dev))

    step()
    torch.cuda.synchronize()

    def twenty_steps():
        for _ in range(20):
            step()

    profile = cprofile_rows(twenty_steps, 20, 40, own=False)
    torch.cuda.synchronize()
    return out, profile


def table_lines(results):
    """{config: {"host_us": site_costs' first result, ...}} as a table: one row per measurement,
    one column per config."""
    names = list(next(iter(results.values()))["host_us"])
    lines = [f"{'':34}" + "".join(f"{c[:16]:>18}" for c in results)]
    for name in names:
        cells = [results[c]["host_us"][name] for c in results]
        lines.append(f"{name:34}" + "".join(f"{v:18.1f}" if isinstance(v, float) else f"{str(v)[:17]:>18}" for v in cells))
    return lines
