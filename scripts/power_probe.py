"""Energy per step of one MoE layer's forward+backward, back to back and queued behind a spin.

bench_layer.py times every step back to back (the GPU rests only for the host's ~0.1 ms
turnaround between steps) and queued behind a 20 ms one-thread spin. On the large shapes every
implementation runs faster queued: the H200 is power-capped there, and a rested GPU starts each
step at a higher clock (benchmarks/results/2026-11-29-h200-v10). Back to back, the step time is
then the step's energy over the cap, and energy per step is what to compare. This script runs
each mode for a few seconds per implementation and reads, through NVML, the board's energy
counter around the loop and its power, SM clock and clock-limit reasons every 20 ms:

    python scripts/power_probe.py --configs conf4 --impls moeblaze,megablocks --seconds 4

Per (config, implementation, mode): ms per step (CUDA events, median), steps, joules per step
(queued: the spin's own energy, measured alone, taken out), mean watts and SM MHz over the loop,
and the share of samples whose clock was held down by the power cap. Output: a table and JSON.
With --kernels, each kernel's CUDA time per step in both modes too (torch.profiler), to see
which kernels stretch when the GPU gets no rest.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import threading
import time

import torch

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [SCRIPTS, os.path.join(SCRIPTS, "..")]

from bench_layer import ALIASES, CONFIGS, IMPL_CLASSES, SPIN_CYCLES, layer_steps, profile_kernels  # noqa: E402

POWER_CAP_REASONS = 0x4 | 0x80  # NVML clocks-event reasons: software power cap, hardware power brake


class Sampler:
    """NVML readings of one GPU every ``period`` seconds on a thread, and its energy counter."""

    def __init__(self, index, period=0.02):
        try:
            import pynvml
        except ImportError as exc:
            raise SystemExit("power_probe.py reads the GPU through NVML: install nvidia-ml-py "
                             f"(import pynvml failed: {exc})") from exc
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.period = period
        self.samples = []
        self._stop = threading.Event()
        self._thread = None

    def energy_mj(self):
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)

    def _run(self):
        nv, h = self.nvml, self.handle
        # Named "throttle reasons" before nvidia-ml-py 12.535.
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        while not self._stop.is_set():
            self.samples.append((nv.nvmlDeviceGetPowerUsage(h) / 1e3, nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                 reasons(h)))
            time.sleep(self.period)

    def __enter__(self):
        self.samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def summarize(samples, energy_mj, steps, step_ms, spin_mj_per_step=0.0):
    """One mode's record from its NVML samples (watts, SM MHz, reasons), the energy counter's
    increase over the loop (mJ), the steps run, their CUDA-event times (ms) and the energy of one
    spin (mJ, queued only: taken out of each step's share)."""
    if steps <= 0 or not samples:
        raise ValueError(f"summarize needs at least one step and one sample, got {steps} steps, {len(samples)} samples")
    return dict(
        steps=steps,
        ms_per_step=statistics.median(step_ms),
        joules_per_step=(energy_mj / steps - spin_mj_per_step) / 1e3,
        mean_watts=statistics.fmean(s[0] for s in samples),
        mean_sm_mhz=statistics.fmean(s[1] for s in samples),
        power_capped_share=sum(1 for s in samples if s[2] & POWER_CAP_REASONS) / len(samples),
    )


def run_mode(steps, sampler, seconds, queued, spin_mj_per_step=0.0):
    """``steps(1)`` (bench_layer.layer_steps: one step, then a synchronization) repeated for
    ``seconds``, each between two CUDA events; queued, behind a spin of SPIN_CYCLES."""
    steps(1)
    times = []
    with sampler:
        e0, t0 = sampler.energy_mj(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queued:
                torch.cuda._sleep(SPIN_CYCLES)
            start.record()
            steps(1)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        energy = sampler.energy_mj() - e0
    return summarize(sampler.samples, energy, len(times), times, spin_mj_per_step)


def spin_energy_mj(sampler, seconds):
    """The energy of one SPIN_CYCLES spin, from a loop of spins alone (mJ)."""
    torch.cuda.synchronize()
    spins = 0
    with sampler:
        e0, t0 = sampler.energy_mj(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            torch.cuda._sleep(SPIN_CYCLES)
            torch.cuda.synchronize()
            spins += 1
        energy = sampler.energy_mj() - e0
    return energy / spins


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="conf4", help="comma list (aliases: qwen3, 7b, conf6, ...)")
    ap.add_argument("--impls", default="moeblaze,megablocks", help=f"comma list of {', '.join(IMPL_CLASSES)}")
    ap.add_argument("--activation", default="swiglu", choices=["swiglu", "silu", "gelu"])
    ap.add_argument("--seconds", type=float, default=4.0, help="per mode and implementation")
    ap.add_argument("--kernels", action="store_true",
                    help="also profile each kernel's CUDA time per step in both modes (which kernels stretch)")
    ap.add_argument("--out", default=None, help="folder for power_probe.json")
    args = ap.parse_args(argv)
    configs = [ALIASES.get(c, c) for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS] + [i for i in args.impls.split(",") if i not in IMPL_CLASSES]
    if unknown:
        sys.exit(f"power_probe.py: unknown {unknown}; configs: {list(CONFIGS)}, impls: {list(IMPL_CLASSES)}")
    if args.seconds <= 0:
        sys.exit(f"power_probe.py: --seconds must be positive, got {args.seconds}")
    if not torch.cuda.is_available():
        sys.exit("power_probe.py needs a CUDA GPU (and NVML, the nvidia-ml-py package)")
    device = torch.device("cuda")
    sampler = Sampler(device.index or 0)
    spin_mj = spin_energy_mj(sampler, args.seconds)
    print(f"one {SPIN_CYCLES}-cycle spin: {spin_mj:.0f} mJ", flush=True)
    records = []
    for cfg in configs:
        T, d, h, E, K = CONFIGS[cfg]
        for name in args.impls.split(","):
            try:
                steps = layer_steps(IMPL_CLASSES[name], T, d, h, E, K, args.activation, torch.bfloat16, device)
                for mode, queued in (("back_to_back", False), ("queued", True)):
                    rec = dict(config=cfg, impl=name, activation=args.activation, mode=mode,
                               **run_mode(steps, sampler, args.seconds, queued, spin_mj if queued else 0.0))
                    records.append(rec)
                    print(f"{cfg:16s} {name:12s} {mode:12s} {rec['ms_per_step']:8.2f} ms  {rec['joules_per_step']:7.2f} J"
                          f"  {rec['mean_watts']:5.0f} W  {rec['mean_sm_mhz']:5.0f} MHz  power-capped "
                          f"{100 * rec['power_capped_share']:3.0f}%  ({rec['steps']} steps)", flush=True)
                if args.kernels:
                    profiles = {mode: profile_kernels(IMPL_CLASSES[name], T, d, h, E, K, args.activation, torch.bfloat16,
                                                      device, queued=queued, steps=steps)
                                for mode, queued in (("back_to_back", False), ("queued", True))}
                    records.append(dict(config=cfg, impl=name, activation=args.activation, mode="kernels", **profiles))
                    print(f"{cfg:16s} {name:12s} kernel ms per step: back to back, queued\n"
                          + "\n".join(kernel_lines(profiles["back_to_back"], profiles["queued"])), flush=True)
                del steps
            except Exception as exc:  # a peer that is not importable is reported, not fatal
                print(f"{cfg:16s} {name:12s} not run: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        import triton

        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    command="python " + " ".join(sys.argv), spin_mj=spin_mj)
        with open(os.path.join(args.out, "power_probe.json"), "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)


if __name__ == "__main__":
    main()
