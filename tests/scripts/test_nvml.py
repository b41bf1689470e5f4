"""benchlib.nvml, without a GPU: a stand-in NVML module answers the sampler, so its readings, the
energy window bench_layer.py puts around its timed steps, and the refusals run on the CPU."""

from __future__ import annotations

import sys
import types

import pytest
from benchlib import nvml


def _fake_nvml(watts=(650.0,), mhz=1600, reasons=0x4, energy_steps=(0, 5_000)):
    """A stand-in ``pynvml``: power in mW from ``watts`` (cycled), a fixed clock and reasons, and an
    energy counter (mJ) that returns ``energy_steps`` in turn."""
    calls = {"power": 0, "energy": 0}

    def power(handle):
        calls["power"] += 1
        return 1e3 * watts[(calls["power"] - 1) % len(watts)]

    def energy(handle):
        calls["energy"] += 1
        return energy_steps[min(calls["energy"] - 1, len(energy_steps) - 1)]

    return types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda index: ("gpu", index), NVML_CLOCK_SM=0,
        nvmlDeviceGetPowerUsage=power, nvmlDeviceGetClockInfo=lambda handle, clock: mhz,
        nvmlDeviceGetCurrentClocksEventReasons=lambda handle: reasons,
        nvmlDeviceGetTotalEnergyConsumption=energy), calls


def test_readings_average_and_count_the_capped_samples():
    samples = [(690.0, 1700, 0x4), (700.0, 1650, 0x80), (500.0, 1980, 0x0), (520.0, 1980, 0x1)]
    r = nvml.readings(samples)
    assert r["mean_watts"] == pytest.approx(602.5)
    assert r["mean_sm_mhz"] == pytest.approx(1827.5)
    assert r["power_capped_share"] == 0.5  # the software cap and the hardware brake; not other reasons
    with pytest.raises(ValueError, match="at least one sample"):
        nvml.readings([])


def test_the_window_gives_energy_per_step_and_the_readings(monkeypatch):
    fake, calls = _fake_nvml(watts=(600.0, 700.0), energy_steps=(10_000, 16_000))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = nvml.Sampler(0, period=0.001)
    window = nvml.PowerWindow(sampler)
    with window:
        while calls["power"] < 4:  # let the thread take a few readings
            pass
    window.steps = 3
    rec = window.record()
    assert rec["steps"] == 3
    assert rec["joules_per_step"] == pytest.approx(2.0)  # 6 J over 3 steps
    assert 600.0 <= rec["mean_watts"] <= 700.0 and rec["mean_sm_mhz"] == 1600
    assert rec["power_capped_share"] == 1.0


def test_a_block_shorter_than_the_thread_still_reads_once(monkeypatch):
    fake, _ = _fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = nvml.Sampler(0, period=10.0)
    sampler._stop.set()  # as if the block ended before the thread's first reading
    sampler._thread = types.SimpleNamespace(join=lambda: None)
    sampler.samples = []
    sampler.__exit__(None, None, None)
    assert sampler.samples == [(650.0, 1600, 0x4)]


def test_a_window_without_steps_is_refused(monkeypatch):
    fake, _ = _fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    window = nvml.PowerWindow(nvml.Sampler(0))
    with pytest.raises(ValueError, match="has not run a step"):
        window.record()
    with window:
        pass
    with pytest.raises(ValueError, match=r"has not run a step \(steps=0\)"):
        window.record()


def test_optional_sampler_says_why_there_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml then raises ImportError
    sampler, why = nvml.optional_sampler(0)
    assert sampler is None and "install nvidia-ml-py" in why
    broken = types.SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(RuntimeError("no driver")))
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    sampler, why = nvml.optional_sampler(0)
    assert sampler is None and why == "NVML failed: RuntimeError: no driver"
    fake, _ = _fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler, why = nvml.optional_sampler(0)
    assert isinstance(sampler, nvml.Sampler) and why is None
