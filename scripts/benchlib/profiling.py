"""Where a layer step's time goes: CUDA time per kernel and the idle gaps between kernels, the
host's own time per function (cProfile), which matrix instructions the compiled kernels use, and
how much of a first call is compiling.

Each takes ``steps`` (``layer_bench.layer_steps``: ``steps(n)`` runs n forward+backward passes
of one layer, then synchronizes).
"""

from __future__ import annotations

import cProfile
import contextlib
import os
import pstats

import torch


def profile_kernels(steps, iters=3):
    """CUDA ms per kernel name per forward+backward (after warm-up, gradients set to None as in
    the timed loop), and the timeline of the last one: its span from the first kernel's start to
    the last one's end, the time no kernel ran, and the longest idle gaps with their neighbours
    (host launch overhead and synchronizations show there)."""
    steps(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        # Each from an idle GPU, as in the timed loop.
        for _ in range(iters):
            steps(1)
    kernels = sorted(
        ((ev.time_range.start, ev.time_range.end, ev.name[:40]) for ev in prof.events()
         if ev.device_type == torch.autograd.DeviceType.CUDA),
    )
    totals = {}
    for start, end, name in kernels:
        totals[name] = totals.get(name, 0.0) + (end - start) / 1e3 / iters
    # The last iteration (every iteration launches the same kernels).
    per_iter = len(kernels) // iters
    last = kernels[-per_iter:] if per_iter else []
    gaps = []
    busy_end = last[0][1] if last else 0
    for prev, cur in zip(last, last[1:]):
        busy_end = max(busy_end, prev[1])
        if cur[0] > busy_end:
            gaps.append((cur[0] - busy_end, prev[2], cur[2]))
    idle = sum(g[0] for g in gaps) / 1e3
    span = (max(k[1] for k in last) - last[0][0]) / 1e3 if last else 0.0
    return dict(
        kernels=dict(sorted(totals.items(), key=lambda kv: -kv[1])[:12]),
        span_ms=span, idle_ms=idle, launches=per_iter,
        gaps=[f"{g / 1e3:.3f} ms: {a} -> {b}" for g, a, b in sorted(gaps, reverse=True)[:6]],
    )


def host_profile(steps, iters=20, top=14):
    """Where the host's time goes in forward+backward (cProfile over ``iters`` steps): the
    ``top`` functions with the most own time, as "ms per step  calls per step  file:line(name)"."""
    steps(2)
    profiler = cProfile.Profile()
    profiler.enable()
    steps(iters)
    profiler.disable()
    rows = ((tt, nc, f"{os.path.basename(path)}:{line}({name})")
            for (path, line, name), (_, nc, tt, _, _) in pstats.Stats(profiler).stats.items())
    return [f"{1e3 * t / iters:.3f} ms  {nc / iters:.0f}x  {name}" for t, nc, name in sorted(rows, reverse=True)[:top]]


def tensor_core_report():
    """Which matrix instructions each compiled moeblaze kernel uses (wgmma is Hopper's fast path;
    mma.sync alone means the kernel runs on the older, slower path). The configs the autotuner
    picked are in each moeblaze record (``autotune_picks``)."""
    from moeblaze_megatron.kernels.gather_gemm import gather_gemm_kernel
    from moeblaze_megatron.kernels.weight_grad import weight_grad_kernel

    report = {}
    for kernel in (gather_gemm_kernel, weight_grad_kernel):
        for cache in getattr(kernel.fn, "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for compiled in kernels.values():
                ptx = compiled.asm.get("ptx", "")
                kind = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "none")
                key = f"{kernel.base_fn.__name__}:{kind}"
                report[key] = report.get(key, 0) + 1
    return report


@contextlib.contextmanager
def compile_times():
    """Triton's compilations inside the block, through its compilation listener: a dict with
    ``kernels`` (compiled, not found in the disk cache), ``cache_hits``, ``seconds`` (all stages)
    and ``ptxas_seconds`` (the cubin stage, a subprocess), and, at the block's end, what the
    compile workers did meanwhile (``worker_kernels``, ``worker_seconds`` summed over them: this
    process then finds those kernels as cache hits). What a first call spends beyond them is the
    autotuner's timing runs and the step itself."""
    import triton

    from moeblaze_megatron.kernels import compile_workers

    totals = {"kernels": 0, "cache_hits": 0, "seconds": 0.0, "ptxas_seconds": 0.0}
    workers_before = compile_workers.stats()
    previous = triton.knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        if cache_hit:
            totals["cache_hits"] += 1
            return
        stages = dict(times.lowering_stages)
        totals["kernels"] += 1
        totals["seconds"] += (times.ir_initialization + sum(stages.values()) + times.store_results) / 1e6
        totals["ptxas_seconds"] += stages.get("cubin", 0) / 1e6

    triton.knobs.compilation.listener = listener
    try:
        yield totals
    finally:
        triton.knobs.compilation.listener = previous
        workers = compile_workers.stats()
        totals["worker_kernels"] = workers["compiled"] - workers_before["compiled"]
        totals["worker_seconds"] = workers["seconds"] - workers_before["seconds"]
