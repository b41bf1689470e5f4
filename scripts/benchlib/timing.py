"""Clocks: GPU time between CUDA events, and the dense matmul rate.

Every time here is a median. ``cuda_time`` is the layer benchmarks' clock (warm-up for a while,
then timed calls for a while, each from an idle GPU or queued behind a spin, with the host's time
to return from each call); ``time_op`` times calls back to back (the per-launch tuning's clock).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

SPIN_CYCLES = 40_000_000  # torch.cuda._sleep cycles before a queued step: ~20 ms at the H200's 1.98 GHz


def cuda_time(fn, warmup, reps, queued=False, warmup_s=0.0, min_s=0.0, spin=SPIN_CYCLES, window=None):
    """Median ms between CUDA events around ``fn``, and the median host ms ``fn`` took to return
    (its launches; past the GPU time the host, not the GPU, sets the pace). Warm-up: ``warmup``
    calls and at least ``warmup_s`` seconds; then ``reps`` timed calls, more until ``min_s``
    seconds have passed. A long enough loop times the GPU in the clock and power state it holds
    under sustained load (a power-capped H200 runs the large shapes at a lower clock than it
    starts them at) rather than in whatever state the previous measurement left. ``queued``: the
    GPU first spins for ``spin`` cycles (~20 ms by default), so ``fn``'s launches queue up behind
    it and the time excludes every wait on the host (as inside a model, where earlier layers keep
    the GPU busy); the spin also lets the GPU rest before every call, so compare queued times only
    with each other. ``window`` (``nvml.PowerWindow``): entered around the timed calls only, its
    ``steps`` set to how many ran."""
    t0 = time.perf_counter()
    done = 0
    while done < warmup or time.perf_counter() - t0 < warmup_s:
        fn()
        torch.cuda.synchronize()
        done += 1
    times, host = [], []
    with window if window is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        while len(times) < reps or time.perf_counter() - t0 < min_s:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queued:
                torch.cuda._sleep(spin)
            start.record()
            t1 = time.perf_counter()
            fn()
            host.append(1e3 * (time.perf_counter() - t1))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    if window is not None:
        window.steps = len(times)
    return statistics.median(times), statistics.median(host)


def matmul_rates(device, warmup_s, min_s, n=8192, reps=20, batch=32):
    """Dense bf16 n^3 matmul TFLOP/s, twice: a burst (5 warm-up and ``reps`` timed products, the
    rate a cool GPU starts at) and sustained (``batch`` products per timed call, ~50 ms like a
    large layer step, timed as the layer steps are: ``warmup_s`` then at least ``min_s``)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    burst = cuda_time(lambda: a @ b, 5, reps)[0]

    def products():
        for _ in range(batch):
            torch.mm(a, b)

    sustained = cuda_time(products, 1, reps, warmup_s=warmup_s, min_s=min_s)[0] / batch
    return 2 * n**3 / burst / 1e9, 2 * n**3 / sustained / 1e9


def time_op(fn, reset, reps):
    """Median ms of ``fn`` between CUDA events, ``reps`` calls queued back to back after two
    untimed ones, ``reset()`` (untimed) before each."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps + 2):
        reset()
        if i >= 2:
            starts[i - 2].record()
        fn()
        if i >= 2:
            ends[i - 2].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[reps // 2]
