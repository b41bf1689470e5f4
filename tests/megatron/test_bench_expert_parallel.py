"""scripts/bench_expert_parallel.py under torchrun on the CPU with gloo (EP = 2 and 4, tiny shapes),
so that the multi-GPU run does not fail on a code path no test reached; and its memory search's
decisions (benchlib.ep_bench.search_sequence), which only a GPU run exercises end to end, on a
stand-in trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from benchlib.ep_bench import search_sequence
from moe_testing import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_expert_parallel.py"


@pytest.mark.parametrize("world_size", [2, 4])
def test_bench_expert_parallel_cpu(tmp_path, world_size):
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
         str(SCRIPT), "--device", "cpu", "--shape", "tiny", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| EP | part | implementation |" in run.stdout
    records = json.loads((tmp_path / f"ep{world_size}.json").read_text())["records"]
    assert records and all(r["ep"] == world_size for r in records)
    kinds = {(r["kind"], r["dispatcher"]) for r in records}
    for dispatcher in ("allgather", "moeblaze", "moeblaze_ring"):
        assert {("equivalence", dispatcher), ("layer step", dispatcher), ("model step", dispatcher)} <= kinds

    for dispatcher in ("moeblaze", "moeblaze_ring"):
        (check,) = [r for r in records if r["kind"] == "equivalence" and r["dispatcher"] == dispatcher]
        assert check["passed"] is True, (dispatcher, check["errors"])
    for r in records:
        if r["dispatcher"] == "moeblaze" and r["recv_rows"] is not None:
            # One row per (token, destination rank), fewer than one per (token, expert): top-4 of
            # 16 experts puts two experts of some tokens on one rank.
            assert r["recv_rows"] == r["unique_token_rank_pairs"], r
            assert sum(r["recv_rows"]) < sum(r["token_expert_pairs"]), r
    models = {r["dispatcher"]: r for r in records if r["kind"] == "model step"}
    # Same weights and tokens, fp32: the first losses differ only by summation order.
    for dispatcher in ("moeblaze", "moeblaze_ring"):
        assert models[dispatcher]["first_step_loss"] == pytest.approx(models["allgather"]["first_step_loss"], rel=1e-5)
    assert all(r["ms"] > 0 for r in records if r["kind"] != "equivalence")


class StandInTrainer:
    """What search_sequence uses of training.train_loop.Trainer; a step's peak is BASE + PER_TOKEN x tokens."""

    BASE, PER_TOKEN = 1000, 1

    def __init__(self):
        self.device = torch.device("cpu")
        self.args = SimpleNamespace(micro_batch_size=1)
        self.ran, self.peak = [], 0

    def random_batches(self, micro_batch_size, seq_length, generator):
        return seq_length

    def train_step(self, seq_length):
        self.ran.append(seq_length)
        self.peak = self.BASE + self.PER_TOKEN * seq_length


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_sequence_search_decisions(one_rank_world, monkeypatch):
    trainer = StandInTrainer()
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: trainer.peak)
    rank = SimpleNamespace(rank=0, say=lambda message: None)
    budget = trainer.BASE + 5000  # sequences up to 5000 fit: 4864 in steps of 256

    found = search_sequence(trainer, rank, budget, time_limit=60, allocated_before=0, first_point=(1024, 2024))
    assert found["largest_fitting"] == 4864 and found["smallest_failing"] == 5120
    # 8192 is predicted at 9192 bytes, over 1.25 budgets: recorded as not fitting, never run; 6144
    # (7144, under 1.25 budgets) runs.
    assert 8192 not in trainer.ran
    assert {"seq_length": 8192, "fits": False, "peak_bytes": None, "predicted_peak_bytes": 9192} in found["probes"]
    assert trainer.ran == [1024, 2048, 4096, 6144, 5120, 4608, 4864]

    trainer.ran.clear()
    found = search_sequence(trainer, rank, budget, time_limit=0, allocated_before=0, first_point=(1024, 2024))
    assert found["time_limited"] and found["largest_fitting"] is None and trainer.ran == []
