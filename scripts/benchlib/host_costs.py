"""Host time of each launch in a moeblaze layer step, with the GPU kept busy so the host never
waits (scripts/host_overhead.py): the step with direct launches and through Triton's own launch
path, every launch site on its own, fc1's launch through each layer under it, a few reference
calls, the step under cProfile, the host's lead from an idle GPU and a launch timeline."""

from __future__ import annotations

import contextlib
import importlib
import statistics
import sys
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels.combine import combine
from moeblaze_megatron.kernels.settings import SETTINGS
from moeblaze_megatron.kernels.launch import launch_call
from moeblaze_megatron.kernels.plan_three_step import plan_tensors, three_step_routing_plan
from moeblaze_megatron.kernels.gather_gemm import EPI_ACT_FWD, expert_order_gemm, gather_gemm, gather_gemm_call, gather_gemm_kernel
from moeblaze_megatron.kernels.gather_gemm_ws import on_hopper
from moeblaze_megatron.kernels.tuning import gather_gemm_with
from moeblaze_megatron.kernels.weight_grad import weight_grad
from moeblaze_megatron.moe_mlp import check_moe_mlp_args

from .baselines import MoEBlaze
from .profiling import cprofile_rows
from .shapes import CONFIGS, make_inputs
from .timing import host_us


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pass


class _NoOp(torch.autograd.Function):
    """An autograd Function taking the op's seven arguments and doing nothing: its own host cost."""

    @staticmethod
    def forward(ctx, x, *rest):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, *([None] * 6)


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
                SETTINGS.direct_launch = not forced
                t0 = time.perf_counter()
                fn()
                times.append(1e6 * (time.perf_counter() - t0))
    finally:
        SETTINGS.direct_launch = True
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


# Spins before a step (ms): long enough ones hide the host's lead (the time to its first launches).
LEAD_SPINS_MS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8)


def lead_sweep(step, reps=30):
    """The step from an idle GPU behind spins of LEAD_SPINS_MS: {spin ms: (step ms after the spin's
    own time, measured alone)}. Past the host's lead (the time until the launches keep the GPU
    busy) the step's own time stops falling: that spin is the lead, that time the GPU's."""
    def timed(fn):
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    cycles_per_ms = torch.cuda.get_device_properties(0).clock_rate  # kHz: cycles per ms
    out = {}
    for spin in LEAD_SPINS_MS:
        cycles = int(spin * cycles_per_ms)
        alone = timed(lambda: torch.cuda._sleep(cycles)) if cycles else 0.0

        def spun():
            if cycles:
                torch.cuda._sleep(cycles)
            step()

        out[f"{spin:g}"] = round(timed(spun) - alone, 4)
    return out


# Functions whose entry and exit the launch timeline marks (module, name; "Class.method" for a
# static method): the host path from the step's start to its launches.
TIMELINE_MARKS = (
    ("moeblaze_megatron.moe_mlp", "moe_mlp"), ("moeblaze_megatron.moe_mlp", "check_moe_mlp_args"),
    ("moeblaze_megatron.routing", "build_routing_plan"), ("moeblaze_megatron.routing", "_prefetch_plan_kernels"),
    ("moeblaze_megatron.kernels.plan_three_step", "three_step_routing_plan"),
    ("moeblaze_megatron.fused", "TritonMoEMLP.forward"), ("moeblaze_megatron.fused", "TritonMoEMLP.backward"),
    ("moeblaze_megatron.fused", "prefetch_layer_kernels"), ("moeblaze_megatron.fused", "fused_forward"),
    ("moeblaze_megatron.fused", "fused_backward"), ("moeblaze_megatron.kernels.gather_gemm", "gather_gemm_call"),
    ("moeblaze_megatron.kernels.combine", "combine"), ("moeblaze_megatron.kernels.launch", "launch"),
)


@contextlib.contextmanager
def _marked(marks, record):
    """Inside the block each function of ``marks`` calls ``record(name, ">")`` on entry and
    ``record(name, "<")`` on exit, wherever a module of the package (or the bench library)
    holds it by name; the originals are back after the block."""
    undo = []
    for module_name, qualname in marks:
        module = importlib.import_module(module_name)
        owner_name, _, attr = qualname.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        original = owner.__dict__[attr]
        fn = original.__func__ if isinstance(original, staticmethod) else original

        def wrapper(*args, __fn=fn, __name=qualname, **kwargs):
            record(__name, ">")
            try:
                return __fn(*args, **kwargs)
            finally:
                record(__name, "<")

        if owner_name:
            undo.append((owner, attr, original))
            setattr(owner, attr, staticmethod(wrapper))
            continue
        for mod in list(sys.modules.values()):
            name = getattr(mod, "__name__", "") or ""
            if name.startswith(("moeblaze_megatron", "benchlib")) and getattr(mod, attr, None) is fn:
                undo.append((mod, attr, fn))
                setattr(mod, attr, wrapper)
    try:
        yield
    finally:
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)


def launch_timeline(step, reps=9):
    """One step from an idle GPU (the median of ``reps`` steps), as a list of rows: each direct
    launch (the kernel, when the host reached it and when the GPU did: an event recorded just
    before it, on an idle GPU the host's submit, on a busy one the previous kernel's end) and the
    entry (>) and exit (<) of each function of TIMELINE_MARKS, ms after the step began. Where
    host and GPU times are close the GPU waits on the host."""
    from moeblaze_megatron.kernels import launch as launch_module

    entry_call = launch_module._Entry.__call__
    runs = []

    def recorded(self, grid, args, device):
        reached = time.perf_counter()  # before the event's own host time
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        runs[-1].append((self.name, reached, event))
        entry_call(self, grid, args, device)

    def record(name, edge):
        runs[-1].append((f"  {edge} {name}", time.perf_counter(), None))

    launch_module._Entry.__call__ = recorded
    try:
        with _marked(TIMELINE_MARKS, record):
            for _ in range(reps):
                runs.append([])
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                runs[-1] = [(what, 1e3 * (t - t0), None if ev is None else start.elapsed_time(ev))
                            for what, t, ev in runs[-1]]
    finally:
        launch_module._Entry.__call__ = entry_call
    # The steps whose sequence is the last one's (a step that compiled a new signature has another).
    same = [r for r in runs if [what for what, _, _ in r] == [what for what, _, _ in runs[-1]]]
    rows = [f"(the median of {len(same)} steps of {reps})"]
    for i, (what, _, ev) in enumerate(same[0]):
        host = statistics.median(r[i][1] for r in same)
        gpu = "" if ev is None else f"  gpu +{statistics.median(r[i][2] for r in same):.3f}"
        rows.append(f"{what:40} host +{host:.3f}{gpu}")
    return rows


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
        gather_gemm(*fc1_args, **{**fc1_kwargs, **kw})

    fc1_launch()
    out["fc1 gather_gemm"] = host_us(fc1_launch)
    if on_hopper(torch.cuda.get_device_capability()):
        fc1_launch(warp_specialize=True)
        out["fc1 gather_gemm, warp-specialized"] = host_us(lambda: fc1_launch(warp_specialize=True))
    SETTINGS.direct_launch = False
    try:
        out["fc1 gather_gemm, Triton launch"] = host_us(fc1_launch)
        out["fc1 gather_gemm, Triton, pointer weight"] = host_us(lambda: fc1_launch(tma_weight=False))
    finally:
        SETTINGS.direct_launch = True
    best = gather_gemm_kernel.best_config
    out["fc1 gather_gemm (fixed config)"] = host_us(lambda: gather_gemm_with(best, *fc1_args, **fc1_kwargs))
    out["fc1 gather_gemm, pointer weight"] = host_us(lambda: fc1_launch(tma_weight=False))
    # The launch in two halves: building its arguments, then launching the built call.
    for label, kw in (("", {}), (", pointer weight", dict(tma_weight=False))):
        out[f"fc1 gather_gemm_call (arguments){label}"] = host_us(lambda: gather_gemm_call(*fc1_args, **fc1_kwargs, **kw))
        built = gather_gemm_call(*fc1_args, **fc1_kwargs, **kw)
        launch_call(built)
        out[f"fc1 launch of the built call{label}"] = host_us(lambda: launch_call(built))
    # The launch's arguments as gather_gemm builds them.
    try:
        launch = direct_launch(*gather_gemm_call(*fc1_args, **fc1_kwargs, tma_weight=False))
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
    # What each host step of the path to fc1 is made of (every torch call costs microseconds).
    flat = torch.empty(4096, dtype=torch.int32, device=dev)
    out["as_strided"] = host_us(lambda: flat.as_strided((64, 8), (8, 1), 512))
    out["slice"] = host_us(lambda: flat[512:1024])
    out["contiguous (already)"] = host_us(lambda: x.contiguous())
    out["tensor.stride(0)"] = host_us(lambda: x.stride(0))
    out["torch.cuda.current_device"] = host_us(torch.cuda.current_device)
    out["autograd Function.apply (no-op)"] = host_us(lambda: _NoOp.apply(xi, pi, impl.fc1, impl.fc2, plan, "a", "b"))
    out["three_step_routing_plan"] = host_us(lambda: three_step_routing_plan(ids, E))
    out["plan_tensors"] = host_us(lambda: plan_tensors(T, K, E, dev))

    step()
    torch.cuda.synchronize()

    def twenty_steps():
        for _ in range(20):
            step()

    profile = cprofile_rows(twenty_steps, 20, 40, own=False)
    torch.cuda.synchronize()

    def twenty_forwards():
        for _ in range(20):
            impl(x, ids, probs)

    own = cprofile_rows(twenty_forwards, 20, 30, own=True)
    torch.cuda.synchronize()
    return out, dict(step_cumulative=profile, forward_own=own, lead_sweep=lead_sweep(step),
                     launch_timeline=launch_timeline(step))


def table_lines(results):
    """{config: {"host_us": site_costs' first result, ...}} as a table: one row per measurement,
    one column per config."""
    names = list(next(iter(results.values()))["host_us"])
    lines = [f"{'':34}" + "".join(f"{c[:16]:>18}" for c in results)]
    for name in names:
        cells = [results[c]["host_us"][name] for c in results]
        lines.append(f"{name:34}" + "".join(f"{v:18.1f}" if isinstance(v, float) else f"{str(v)[:17]:>18}" for v in cells))
    return lines
