"""bench_ring_hop's pieces on the CPU (the kernels interpreted, CUDA's clocks and counters
stubbed): a hop's record at a small layer, its float64 check, the table; the script's refusals."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from benchlib import ep_memory, ring_hop

from moe_testing import three_step_available

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_ring_hop.py"
SMALL = ep_memory.LayerShape(d=32, h=16, experts=8, topk=3)


@pytest.fixture
def small_layer(monkeypatch):
    monkeypatch.setitem(ring_hop.LAYERS, "small", SMALL)
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 12345)

    def cpu_time(fn, warmup, reps, **kwargs):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return 1e3 * (time.perf_counter() - t0) / reps, 0.0

    monkeypatch.setattr(ring_hop, "cuda_time", cpu_time)


def test_hop_record_and_check(small_layer):
    if not three_step_available(torch.device("cpu")):
        pytest.skip("the fused kernels need TRITON_INTERPRET=1 on the CPU")
    lines = []
    records = ring_hop.run_hops(["small"], [2, 4], [24], torch.device("cpu"), warmup_s=0, min_s=0, say=lines.append)
    assert [(r["P"], r["tokens_per_rank"]) for r in records] == [(2, 24), (4, 24)]
    for r in records:
        # Uniform routing: about T*K/P slots on shard 0, never more than T*min(K, E/P).
        assert 0 < r["hop_rows"] <= 24 * min(3, 8 // r["P"])
        assert r["passed"], r["errors"]
        assert r["forward_ms"] > 0 and r["backward_peak_bytes"] == 12345
        assert r["model_backward_bytes"] > r["model_forward_bytes"] > 0
    assert len(lines) == 2 and "check ok" in lines[0]
    table = ring_hop.table_lines(records)
    assert len(table) == 4 and "| small | 24 | 2 |" in table[2]


def test_check_catches_a_wrong_hop(small_layer, monkeypatch):
    if not three_step_available(torch.device("cpu")):
        pytest.skip("the fused kernels need TRITON_INTERPRET=1 on the CPU")
    real = ring_hop.hop_forward

    def half_the_probabilities(x, ids, probs, weights, shard, rows, options):
        if options.backend == "triton":  # the checked path weights its experts wrongly
            probs = probs / 2
        return real(x, ids, probs, weights, shard, rows, options)

    monkeypatch.setattr(ring_hop, "hop_forward", half_the_probabilities)
    record = ring_hop.measure_hop("small", 24, 2, torch.device("cpu"), warmup_s=0, min_s=0, check=True)
    assert not record["passed"] and record["errors"]["y"] > 0.4


@pytest.mark.parametrize("argv, message", [
    (["--layers", "llama"], "known layers"),
    (["--ranks", "3"], "do not divide"),
    (["--tokens", "0"], "--tokens >= 1"),
    ([], "needs a CUDA GPU"),
])
def test_script_refuses(argv, message):
    if torch.cuda.is_available() and not argv:
        pytest.skip("a GPU is there")
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr, done.stderr
