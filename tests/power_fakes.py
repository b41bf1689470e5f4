"""Stand-ins for the GPU's NVML readings, so that the power bookkeeping of the benchmark scripts
(benchlib.nvml, power, kernel_tuning) runs on the CPU. Imported as ``from power_fakes import ...``
(pytest puts tests/ on sys.path)."""

from __future__ import annotations


class CountingSampler:
    """A sampler whose energy counter (mJ) the test's own calls advance (``mj``), with fixed
    (watts, SM MHz, clock-event reasons) readings taken at each window's start."""

    def __init__(self, samples=((650.0, 1500, 0x4),), mj=0.0):
        self.mj = mj
        self.readings = list(samples)
        self.samples = []

    def energy_mj(self):
        return self.mj

    def __enter__(self):
        self.samples = list(self.readings)
        return self

    def __exit__(self, *exc):
        pass
