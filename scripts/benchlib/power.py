"""Energy per step of one MoE layer's forward+backward, back to back and queued behind a spin,
read through NVML: the board's energy counter around each loop, and its power, SM clock and
clock-limit reasons sampled every 20 ms (scripts/power_probe.py says why energy per step is
what to compare on a power-capped GPU)."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time

import torch

from .layer_bench import layer_steps
from .nvml import PowerWindow, Sampler, readings
from .baselines import IMPL_CLASSES
from .profiling import profile_kernels
from .shapes import CONFIGS
from .timing import SPIN_CYCLES

def summarize(samples, energy_mj, steps, step_ms, spin_mj_per_step=0.0):
    """One mode's record from its NVML samples (watts, SM MHz, reasons), the energy counter's
    increase over the loop (mJ), the steps run, their CUDA-event times (ms) and the energy of one
    spin (mJ, queued only: taken out of each step's share)."""
    if steps <= 0 or not samples:
        raise ValueError(f"summarize needs at least one step and one sample, got {steps} steps, {len(samples)} samples")
    return dict(steps=steps, ms_per_step=statistics.median(step_ms),
                joules_per_step=(energy_mj / steps - spin_mj_per_step) / 1e3, **readings(samples))


def run_mode(steps, sampler, seconds, queued, spin_mj_per_step=0.0):
    """``steps(1)`` (layer_bench.layer_steps: one step, then a synchronization) repeated for
    ``seconds``, each between two CUDA events; queued, behind a spin of SPIN_CYCLES."""
    steps(1)
    times = []
    with PowerWindow(sampler) as window:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queued:
                torch.cuda._sleep(SPIN_CYCLES)
            start.record()
            steps(1)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return summarize(sampler.samples, window.energy_mj, len(times), times, spin_mj_per_step)


def spin_energy_mj(sampler, seconds):
    """The energy of one SPIN_CYCLES spin, from a loop of spins alone (mJ)."""
    torch.cuda.synchronize()
    spins = 0
    with PowerWindow(sampler) as window:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            torch.cuda._sleep(SPIN_CYCLES)
            torch.cuda.synchronize()
            spins += 1
    return window.energy_mj / spins


def kernel_lines(back_to_back, queued):
    """Two profile_kernels results (the same steps back to back and queued) side by side: per
    kernel name, ms per step in each mode and their ratio, slowest back to back first; then each
    mode's span and the time no kernel ran."""
    names = sorted(set(back_to_back["kernels"]) | set(queued["kernels"]), key=lambda n: -back_to_back["kernels"].get(n, 0.0))
    lines = []
    for name in names:
        a, b = back_to_back["kernels"].get(name), queued["kernels"].get(name)
        ratio = f"{a / b:5.2f}x" if a and b else "    -"
        lines.append(f"    {name:40s} {a or 0.0:8.3f} {b or 0.0:8.3f} ms  {ratio}")
    for mode, prof in (("back to back", back_to_back), ("queued", queued)):
        lines.append(f"    {mode}: span {prof['span_ms']:.3f} ms, no kernel running {prof['idle_ms']:.3f} ms, "
                     f"{prof['launches']} launches")
    return lines


def probe(configs, impls, activation, seconds, kernels=False, out=None):
    """Every (config, implementation) in both modes for ``seconds`` each, printed as it goes;
    with ``kernels``, each kernel's CUDA time per step in both modes too; ``out``: the folder
    of power_probe.json."""
    device = torch.device("cuda")
    sampler = Sampler(device.index or 0)
    spin_mj = spin_energy_mj(sampler, seconds)
    print(f"one {SPIN_CYCLES}-cycle spin: {spin_mj:.0f} mJ", flush=True)
    records = []
    for cfg in configs:
        T, d, h, E, K = CONFIGS[cfg]
        for name in impls:
            try:
                steps = layer_steps(IMPL_CLASSES[name], T, d, h, E, K, activation, torch.bfloat16, device)
                for mode, queued in (("back_to_back", False), ("queued", True)):
                    rec = dict(config=cfg, impl=name, activation=activation, mode=mode,
                               **run_mode(steps, sampler, seconds, queued, spin_mj if queued else 0.0))
                    records.append(rec)
                    print(f"{cfg:16s} {name:12s} {mode:12s} {rec['ms_per_step']:8.2f} ms  {rec['joules_per_step']:7.2f} J"
                          f"  {rec['mean_watts']:5.0f} W  {rec['mean_sm_mhz']:5.0f} MHz  power-capped "
                          f"{100 * rec['power_capped_share']:3.0f}%  ({rec['steps']} steps)", flush=True)
                if kernels:
                    profiles = {mode: profile_kernels(steps, queued=queued)
                                for mode, queued in (("back_to_back", False), ("queued", True))}
                    records.append(dict(config=cfg, impl=name, activation=activation, mode="kernels", **profiles))
                    print(f"{cfg:16s} {name:12s} kernel ms per step: back to back, queued\n"
                          + "\n".join(kernel_lines(profiles["back_to_back"], profiles["queued"])), flush=True)
                del steps
            except Exception as exc:  # a peer that is not importable is reported, not fatal
                print(f"{cfg:16s} {name:12s} not run: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
            torch.cuda.empty_cache()
    if out:
        os.makedirs(out, exist_ok=True)
        import triton

        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    command="python " + " ".join(sys.argv), spin_mj=spin_mj)
        with open(os.path.join(out, "power_probe.json"), "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)
