"""The GPU's power through NVML: its power, SM clock and clock-limit reasons sampled on a thread,
and its energy counter. bench_layer.py reads them around its back-to-back forward+backward loop
and tune_kernels.py around loops of one launch: at the power cap a step's time is its energy
over the cap, so energy per step is what a faster kernel has to save."""

from __future__ import annotations

import statistics
import threading
import time

POWER_CAP_REASONS = 0x4 | 0x80  # NVML clocks-event reasons: software power cap, hardware power brake
SAMPLE_PERIOD_S = 0.02  # between a Sampler's readings, by default


class Sampler:
    """NVML readings of one GPU every ``period`` seconds on a thread, and its energy counter."""

    def __init__(self, index, period=SAMPLE_PERIOD_S):
        try:
            import pynvml
        except ImportError as exc:
            raise SystemExit("reading the GPU's power needs NVML: install nvidia-ml-py "
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

    def read(self):
        """One (watts, SM MHz, clock-event reasons) reading."""
        nv, h = self.nvml, self.handle
        # Named "throttle reasons" before nvidia-ml-py 12.535.
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return nv.nvmlDeviceGetPowerUsage(h) / 1e3, nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), reasons(h)

    def _run(self):
        while not self._stop.is_set():
            self.samples.append(self.read())
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
        if not self.samples:  # a block shorter than the thread's start
            self.samples.append(self.read())


def readings(samples) -> dict:
    """Mean watts, mean SM MHz and the share of samples whose clock the power cap held down, from
    (watts, SM MHz, clock-event reasons) samples."""
    if not samples:
        raise ValueError("readings needs at least one sample")
    return dict(mean_watts=statistics.fmean(s[0] for s in samples),
                mean_sm_mhz=statistics.fmean(s[1] for s in samples),
                power_capped_share=sum(1 for s in samples if s[2] & POWER_CAP_REASONS) / len(samples))


def optional_sampler(index):
    """(``Sampler`` of GPU ``index``, None) where NVML answers, else (None, why not)."""
    try:
        return Sampler(index), None
    except SystemExit as exc:
        return None, str(exc)
    except Exception as exc:  # NVML present but failing (no driver access): the power columns are left out
        return None, f"NVML failed: {type(exc).__name__}: {exc}"


class PowerWindow:
    """A sampler's readings and energy over a loop of steps: the loop sets ``steps`` (how many
    ran inside the window); ``record()`` then gives joules per step and the readings."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.steps = 0
        self.energy_mj = None

    def __enter__(self):
        self.sampler.__enter__()
        self._e0 = self.sampler.energy_mj()
        return self

    def __exit__(self, *exc):
        self.energy_mj = self.sampler.energy_mj() - self._e0
        self.sampler.__exit__(*exc)

    def record(self) -> dict:
        if self.energy_mj is None or self.steps <= 0:
            raise ValueError(f"PowerWindow.record: the window has not run a step (steps={self.steps})")
        # A loop shorter than one sampling period still gets the reading taken at its start.
        return dict(steps=self.steps, joules_per_step=self.energy_mj / self.steps / 1e3,
                    **readings(self.sampler.samples))
