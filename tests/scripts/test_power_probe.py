"""scripts/power_probe.py's bookkeeping (benchlib.power), without a GPU: a mode's record from its
NVML samples and energy counter, and the arguments the script refuses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from benchlib import power
from power_fakes import CountingSampler

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "power_probe.py"


def test_summarize_takes_the_spin_out_of_the_queued_energy():
    # (watts, SM MHz, clock-event reasons): two of four samples held down by the software power cap.
    samples = [(690.0, 1700, 0x4), (700.0, 1650, 0x4), (500.0, 1980, 0x0), (520.0, 1980, 0x1)]
    rec = power.summarize(samples, energy_mj=50_000.0, steps=10, step_ms=[70.0, 71.0, 90.0], spin_mj_per_step=1_000.0)
    assert rec["steps"] == 10
    assert rec["ms_per_step"] == 71.0  # the median: one slow step does not move it
    assert rec["joules_per_step"] == pytest.approx(4.0)  # 50 J over 10 steps, less 1 J of spin each
    assert rec["mean_watts"] == pytest.approx(602.5)
    assert rec["mean_sm_mhz"] == pytest.approx(1827.5)
    assert rec["power_capped_share"] == 0.5
    back_to_back = power.summarize(samples, energy_mj=50_000.0, steps=10, step_ms=[70.0])
    assert back_to_back["joules_per_step"] == pytest.approx(5.0)


def test_hardware_power_brake_counts_as_capped():
    rec = power.summarize([(700.0, 1400, 0x80)], energy_mj=1.0, steps=1, step_ms=[1.0])
    assert rec["power_capped_share"] == 1.0


@pytest.mark.parametrize("steps,samples", [(0, [(1.0, 1, 0)]), (3, [])])
def test_summarize_refuses_an_empty_loop(steps, samples):
    with pytest.raises(ValueError, match="at least one step and one sample"):
        power.summarize(samples, energy_mj=1.0, steps=steps, step_ms=[1.0])


@pytest.mark.parametrize("argv,message", [
    (["--configs", "conf9"], "unknown \\['conf9'\\]"),
    (["--impls", "moeblaze,nope"], "unknown \\['nope'\\]"),
    (["--seconds", "0"], "--seconds must be positive, got 0.0"),
    pytest.param([], "needs a CUDA GPU", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")),
])
def test_bad_arguments_and_no_gpu_are_refused_by_name(argv, message):
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 1
    assert re.search(message, done.stderr), done.stderr[-2000:]


def test_missing_nvml_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml then raises ImportError
    with pytest.raises(SystemExit, match="install nvidia-ml-py"):
        power.Sampler(0)


def test_kernel_lines_pair_the_modes_by_kernel_slowest_first():
    b2b = dict(kernels={"gemm_a": 2.0, "gemm_b": 6.0, "only_b2b": 0.5}, span_ms=9.0, idle_ms=0.25, launches=7)
    queued = dict(kernels={"gemm_a": 2.0, "gemm_b": 5.0, "only_queued": 0.1}, span_ms=7.5, idle_ms=0.0, launches=7)
    lines = power.kernel_lines(b2b, queued)
    assert [line.split()[0] for line in lines[:4]] == ["gemm_b", "gemm_a", "only_b2b", "only_queued"]
    assert lines[0].split()[1:] == ["6.000", "5.000", "ms", "1.20x"]
    assert lines[2].split()[1:] == ["0.500", "0.000", "ms", "-"]  # no ratio against a kernel the other mode lacks
    assert lines[4] == "    back to back: span 9.000 ms, no kernel running 0.250 ms, 7 launches"
    assert lines[5] == "    queued: span 7.500 ms, no kernel running 0.000 ms, 7 launches"


class _FakeEvent:
    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 2.5


@pytest.mark.parametrize("queued,spin_mj", [(False, 0.0), (True, 1.0)])
def test_run_mode_counts_the_steps_energy(monkeypatch, queued, spin_mj):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)  # no GPU here: the loop's bookkeeping only
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    sampler = CountingSampler(samples=[(690.0, 1500, 0x4), (700.0, 1450, 0x0)], mj=100.0)
    ran = []

    def steps(n):
        ran.append(n)
        sampler.mj += 7.0 * n

    rec = power.run_mode(steps, sampler, seconds=0.02, queued=queued, spin_mj_per_step=spin_mj)
    assert rec["steps"] == len(ran) - 1 >= 1  # the first, untimed step is outside the window
    assert rec["ms_per_step"] == 2.5
    assert rec["joules_per_step"] == pytest.approx((7.0 - spin_mj) / 1e3)
    assert rec["mean_watts"] == 695.0 and rec["power_capped_share"] == 0.5
