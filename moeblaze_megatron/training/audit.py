"""Bytes an operation saves for backward, and its CPU allocator peak: the memory audit shared by
the tests, the demo and the benchmarks."""

from __future__ import annotations

import torch


def saved_bytes_for_backward(fn, parameters=()):
    """Run ``fn()`` and return (its result, bytes autograd saved for backward meanwhile).

    Tensors whose storage is one of ``parameters`` (the weights, which exist anyway) are not
    counted; every other storage is counted once, whole, however many views of it are saved:
    that is the memory kept alive until backward.
    """
    excluded = {p.untyped_storage().data_ptr() for p in parameters}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return result, sum(saved.values())


def cpu_peak_bytes(fn):
    """Run ``fn()`` and return (its result, the CPU allocator's peak in bytes above the start),
    from the profiler's memory events (CPU tensors have no allocator statistics of their own).
    Allocations of every thread count, the communication backend's included."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, peak
