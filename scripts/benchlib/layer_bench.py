"""One MoE layer, forward and forward+backward, routing given: every implementation's times,
bytes saved for backward and peak memory on one GPU (scripts/bench_layer.py)."""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time

import torch

from moeblaze_megatron.kernels.tuning import autotune_picks
from moeblaze_megatron.training.audit import saved_bytes_for_backward

from .accuracy import CHECK_TOL, check_impl
from .layer_report import write_report
from .nvml import PowerWindow, optional_sampler
from .baselines import IMPL_CLASSES, KNOWN_CRASHES
from .profiling import compile_times, host_profile, profile_kernels, tensor_core_report
from .shapes import CONFIGS, flops_fwdbwd, floor_bytes, make_inputs
from .timing import cuda_time, matmul_rates

# Environment variables that change what moeblaze runs; recorded with the results.
ENV_KNOBS = ("MOEBLAZE_AUTOTUNE", "MOEBLAZE_DIRECT_LAUNCH", "MOEBLAZE_WARP_SPECIALIZE", "TRITON_CACHE_AUTOTUNING")


def layer_steps(cls, T, d, h, E, K, activation, dtype, device):
    """``steps(n)``: n forward+backward passes of a fresh layer (gradients set to None first, as
    in the timed loop), then a synchronization."""
    x, ids, probs, fc1, fc2 = make_inputs(T, d, h, E, K, activation, dtype, device, 3)
    impl = cls(fc1, fc2, activation, E, K)
    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    gy = torch.randn_like(x)
    leaves = impl.params() + [xi, pi]

    def steps(n):
        for _ in range(n):
            for t in leaves:
                t.grad = None
            impl(xi, ids, pi).backward(gy)
        torch.cuda.synchronize()

    return steps


def measure(cls, T, d, h, E, K, activation, dtype, device, seed, reps, warmup_s=0.0, min_s=0.0, sampler=None):
    """One implementation at one shape: forward, forward+backward (its host time too) and queued
    forward+backward ms, the first call's seconds, the bytes saved for backward (parameters
    excluded) and the peak memory above inputs, weights and their gradients; with ``sampler``
    (``nvml.Sampler``), the GPU's energy per step, power, clock and power-capped share over the
    timed back-to-back forward+backward steps (``power_fwdbwd``)."""
    x, ids, probs, fc1, fc2 = make_inputs(T, d, h, E, K, activation, dtype, device, seed)
    impl = cls(fc1, fc2, activation, E, K)
    del fc1, fc2
    params = impl.params()
    xi = x.clone().requires_grad_()
    pi = probs.clone().requires_grad_()
    gy = torch.randn_like(x)
    t0 = time.perf_counter()
    with compile_times() as compiled:
        impl(xi, ids, pi).backward(gy)  # first call: compilation and autotuning
        torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0

    def fwd():
        with torch.no_grad():
            impl(x, ids, probs)

    leaves = params + [xi, pi]

    def fwdbwd():
        # As optimizer.zero_grad(set_to_none=True) does: no gradient accumulation is timed.
        for t in leaves:
            t.grad = None
        impl(xi, ids, pi).backward(gy)

    ms_fwd = cuda_time(fwd, 2, reps, warmup_s=warmup_s / 2, min_s=min_s / 2)[0]
    window = PowerWindow(sampler) if sampler is not None else None
    ms_fwdbwd, host_ms_fwdbwd = cuda_time(fwdbwd, 2, reps, warmup_s=warmup_s, min_s=min_s, window=window)
    ms_fwdbwd_queued = cuda_time(fwdbwd, 1, reps, queued=True, min_s=min_s / 2)[0]
    # Peak above inputs, weights and their gradients: the gradients' own bytes are taken out.
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y, nbytes = saved_bytes_for_backward(lambda: impl(xi, ids, pi), params)
    y.backward(gy)
    torch.cuda.synchronize()
    grad_bytes = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
    peak = torch.cuda.max_memory_allocated() - base - grad_bytes
    rec = dict(ms_fwd=ms_fwd, ms_fwdbwd=ms_fwdbwd, host_ms_fwdbwd=host_ms_fwdbwd, ms_fwdbwd_queued=ms_fwdbwd_queued,
               saved_bytes=nbytes, peak_bytes=peak, first_call_s=first_call_s, first_call_compile=compiled)
    if window is not None:
        rec["power_fwdbwd"] = window.record()
    return rec


def _compiled_text(rec) -> str:
    """`` (compiling 8.1 s, ptxas 5.0, 14 kernels)`` of a first call that compiled anything."""
    compiled = rec.get("first_call_compile") or {}
    workers = compiled.get("worker_kernels", 0)
    if not compiled.get("kernels") and not workers:
        return ""
    text = f" (compiling {compiled['seconds']:.1f} s, ptxas {compiled['ptxas_seconds']:.1f}, {compiled['kernels']} kernels"
    if workers:
        text += f"; in workers {workers} kernels, {compiled['worker_seconds']:.1f} s"
    return text + ")"


def _power_text(rec) -> str:
    """`` 2.67 J/step at 665 W, 1742 MHz, power-capped 100%`` where the power was read."""
    p = rec.get("power_fwdbwd")
    if not p:
        return ""
    return (f" {p['joules_per_step']:.2f} J/step at {p['mean_watts']:.0f} W, {p['mean_sm_mhz']:.0f} MHz, "
            f"power-capped {100 * p['power_capped_share']:.0f}%")


def available_impls(names, dtype, device, notes):
    """{name: class} of the implementations that build on a small layer; why the others do not
    goes into ``notes`` (and is printed)."""
    available = {}
    for name in names:
        try:
            E0 = 4
            IMPL_CLASSES[name](*make_inputs(8, 64, 64, E0, 2, "swiglu", dtype, device, 0)[3:], "swiglu", E0, 2)
            available[name] = IMPL_CLASSES[name]
        except Exception as exc:  # a peer that is not importable is reported, not fatal
            notes.append(f"{name}: not run ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
            print(notes[-1], flush=True)
    return available


def run(configs, acts, impls, out, tag, reps, seconds, warmup_seconds, check_tokens, check=True, profile=False,
        power=True):
    """Every (config, activation, implementation) on the GPU: checked against the float64
    reference (at a reduced token count), timed, its memory measured, and with ``power`` (where
    NVML answers) its energy per step, power and clock back to back. Writes ``tag``.json under
    ``out`` after every record, then the markdown table and the chart; prints progress."""
    device = torch.device("cuda")
    dtype = torch.bfloat16
    os.makedirs(out, exist_ok=True)
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python " + " ".join(sys.argv),
                env={k: os.environ[k] for k in ENV_KNOBS if k in os.environ},
                timing=dict(min_reps=reps, seconds=seconds, warmup_seconds=warmup_seconds))
    started = time.perf_counter()
    peak, sustained = matmul_rates(device, warmup_seconds, seconds)
    meta["matmul_peak_tflops"], meta["matmul_sustained_tflops"] = peak, sustained
    print(f"{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  dense bf16 matmul {peak:.0f} TFLOP/s "
          f"(burst), {sustained:.0f} sustained", flush=True)
    records, notes = [], []
    sampler = None
    if power:
        sampler, why_not = optional_sampler(torch.cuda.current_device())
        if sampler is None:
            notes.append(f"power: not read ({why_not})")
            print(notes[-1], flush=True)
    available = available_impls(impls, dtype, device, notes)
    for cfg in configs:
        T, d, h, E, K = CONFIGS[cfg]
        for act in acts:
            for name, cls in available.items():
                rec = dict(meta, config=cfg, T=T, d=d, h=h, E=E, K=K, activation=act, impl=name)
                try:
                    if (cfg, name) in KNOWN_CRASHES:
                        raise RuntimeError(KNOWN_CRASHES[cfg, name])
                    # Timed first, so that its first call is a training job's first step: the check
                    # compiles the same kernels (the ints they specialize on keep their 16-divisibility).
                    tuned_before = set(autotune_picks()) if name.startswith("moeblaze") else set()
                    rec.update(measure(cls, T, d, h, E, K, act, dtype, device, 2, reps, warmup_seconds, seconds,
                                       sampler=sampler))
                    if name.startswith("moeblaze"):
                        rec["autotune_picks"] = {k: v for k, v in autotune_picks().items() if k not in tuned_before}
                    if check:
                        # float64 reference at reduced T and E (same d, h, K): dsv3-like's full
                        # float64 weights alone would take 90 GB.
                        torch.cuda.empty_cache()
                        e_chk = min(E, 32)
                        errs = check_impl(cls, min(T, check_tokens), d, h, e_chk, min(K, e_chk), act, dtype, device, 1)
                        rec["check"] = errs
                        worst = max(v for v in errs.values() if not math.isnan(v))
                        rec["check_ok"] = worst < (cls.check_tol or CHECK_TOL)
                    rec["tflops"] = flops_fwdbwd(T, d, h, K, act) / rec["ms_fwdbwd"] / 1e9
                    rec["pct_of_matmul"] = 100 * rec["tflops"] / peak
                    rec["pct_of_sustained_matmul"] = 100 * rec["tflops"] / sustained
                    rec["floor_bytes"] = floor_bytes(T, d, h, K, act)
                except Exception as exc:
                    msg = str(exc).splitlines()[0][:200] if str(exc) else ""
                    rec["error"] = f"{type(exc).__name__}: {msg}"
                    if "out of memory" in msg.lower():
                        rec["error"] = "OOM"
                records.append(rec)
                # Written after every record: a run cut short by its time limit keeps what it measured.
                with open(os.path.join(out, f"{tag}.json"), "w") as f:
                    json.dump(dict(meta=meta, notes=notes, records=records), f, indent=1)
                torch.cuda.empty_cache()
                if profile and name.startswith("moeblaze") and "error" not in rec:
                    rec["profile"] = profile_kernels(layer_steps(cls, T, d, h, E, K, act, dtype, device))
                    prof = rec["profile"]
                    print("   " + "  ".join(f"{k}={v:.2f}" for k, v in prof["kernels"].items()), flush=True)
                    print(f"   timeline: {prof['launches']} kernels, span {prof['span_ms']:.2f} ms, idle "
                          f"{prof['idle_ms']:.2f} ms; longest gaps: {prof['gaps']}", flush=True)
                    prof["host"] = host_profile(layer_steps(cls, T, d, h, E, K, act, dtype, device))
                    print("   host, own time per step:\n     " + "\n     ".join(prof["host"]), flush=True)
                status = rec.get("error") or (
                    f"fwd {rec['ms_fwd']:.2f} ms  fwd+bwd {rec['ms_fwdbwd']:.2f} ms (host {rec['host_ms_fwdbwd']:.2f}, "
                    f"queued {rec['ms_fwdbwd_queued']:.2f})  "
                    f"{rec['tflops']:.0f} TF/s "
                    f"saved {rec['saved_bytes'] / 2**20:.0f} MiB peak {rec['peak_bytes'] / 2**20:.0f} MiB "
                    f"first {rec['first_call_s']:.1f}s{_compiled_text(rec)}{_power_text(rec)} "
                    f"check {'ok' if rec.get('check_ok', True) else 'FAIL ' + str(rec['check'])}")
                print(f"[{time.perf_counter() - started:5.0f}s] {cfg:16s} {act:6s} {name:20s} {status}", flush=True)
                if rec.get("autotune_picks"):
                    print("   autotuner picks: " + "  ".join(rec["autotune_picks"].values()), flush=True)
    if profile:
        try:
            meta["tensor_core_report"] = tensor_core_report()
        except Exception as exc:  # introspection of Triton internals is best effort
            meta["tensor_core_report"] = f"unavailable: {exc}"
        print("compiled moeblaze kernels by matrix instruction:", meta["tensor_core_report"], flush=True)
    with open(os.path.join(out, f"{tag}.json"), "w") as f:
        json.dump(dict(meta=meta, notes=notes, records=records), f, indent=1)
    write_report(meta, notes, records, out, tag)
