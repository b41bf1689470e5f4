"""compare_torchtitan.py on the CPU (the tiny model, the reference backend, a few steps): stock,
MoEBlaze and the control train from the same weights and data through torchtitan's pieces, the
losses agree within the measured noise, the MoE layers save less for backward, the JSON and the
closing table say so; the torch-2.11 stand-in for DataParallelMeshDims; the command line."""

from __future__ import annotations

import json
import types

import pytest
import torch
from benchlib import titan_compare

import compare_torchtitan


def test_cpu_comparison(tmp_path, capsys):
    status = compare_torchtitan.main(["--device", "cpu", "--steps", "5", "--warmup", "1", "--profile-layer", "on",
                                      "--out", str(tmp_path)])
    result = json.loads((tmp_path / "compare_torchtitan.json").read_text())
    assert status == 0 and result["loss_check"]["passed"], result["loss_check"]
    # Each run's routed experts profiled: the op's one autograd Function among the moeblaze run's ops.
    assert "MoEMLPFunction" in (tmp_path / "layer_profile_moeblaze.txt").read_text()
    assert "MoEMLPFunction" not in (tmp_path / "layer_profile_stock.txt").read_text()
    runs = result["runs"]
    assert [runs[n]["dispatcher"] for n in ("baseline", "candidate")] == ["stock", "moeblaze"]
    # Same weights and data: the first losses agree to rounding, later ones within the bound.
    assert abs(runs["candidate"]["losses"][0] - runs["baseline"]["losses"][0]) <= 1e-2 * runs["baseline"]["losses"][0]
    assert all(len(runs[n]["losses"]) == 5 for n in runs)
    # The override's MoE layers keep the floor: per layer the bf16 input and pre-activations
    # (2Td + 4TKh bytes) plus O(T*K) indices; stock keeps its routed copies.
    T, d, h, K, layers = 4 * 64, 64, 32, 2, 2
    floor = layers * (1.05 * (2 * T * d + 4 * T * K * h) + 16 * T * K + 4 * 9)
    assert 0 < runs["candidate"]["saved_moe_bytes"] <= floor < runs["baseline"]["saved_moe_bytes"]
    assert result["ratios"]["saved_moe_fraction"] < 1 and result["config"]["cuda_graphs_used"] is False
    assert result["environment"]["torchtitan"] == "0.3.0" and (tmp_path / "losses.png").is_file()
    # Where each step goes: at every step the phases lie within it.
    for name in ("baseline", "candidate"):
        phases = runs[name]["phase_seconds"]
        assert list(phases) == list(runs[name]["median_phase_seconds"]) == ["forward_backward", "clip", "optimizer"]
        for step, seconds in enumerate(runs[name]["step_seconds"]):
            spans = [phases[phase][step] for phase in phases]
            assert min(spans) > 0 and sum(spans) <= seconds, (name, step, spans, seconds)
    # The routed experts alone, timed the same way for both: a part of the step.
    for name in ("baseline", "candidate"):
        for key in ("routed_experts_seconds_per_layer", "routed_experts_queued_seconds_per_layer"):
            layer = runs[name][key]
            assert runs[name]["moe_layers"] == 2 and 0 < layer * 2 < runs[name]["median_step_seconds"] * 4, key
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-1].startswith("losses agree") and any(line.startswith("| moeblaze |") for line in table)
    assert any(line.startswith("torchtitan ") and line.endswith("loss, compile off") for line in table)
    assert any(line.startswith("median ms per phase of a step: stock forward+backward ") for line in table)
    experts_line = "routed experts alone, fwd+bwd per layer (balanced routing), per call / queued: stock "
    assert any(line.startswith(experts_line) for line in table)
    bound = result["ratios"]["step_time_speedup_bound"]
    step_line = next(line for line in table if line.startswith("moeblaze: step time "))
    assert (bound is None) == ("took no time" not in step_line), (bound, step_line)
    # Internal goals stay out of what a user reads: the table and the JSON.
    assert not any("goal" in line for line in table)
    assert "goal" not in (tmp_path / "compare_torchtitan.json").read_text()


def test_speedup_bound():
    # 4 layers of 5 ms routed experts in a 100 ms step: 80 ms would be left, at most 1.25x.
    base = {"median_step_seconds": 0.100, "moe_layers": 4, "routed_experts_queued_seconds_per_layer": 0.005}
    assert titan_compare.speedup_bound(base) == pytest.approx(1.25)
    # Timings that leave nothing of the step (a tiny CPU model, timed apart): no bound claimed.
    assert titan_compare.speedup_bound(dict(base, routed_experts_queued_seconds_per_layer=0.025)) is None


def test_stand_in_for_a_missing_data_parallel_mesh_dims(monkeypatch):
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        monkeypatch.delattr(fsdp, "DataParallelMeshDims")
        assert titan_compare.install_fsdp_stand_in() is True
        with pytest.raises(RuntimeError, match="stand-in for torch.distributed.fsdp.DataParallelMeshDims"):
            fsdp.DataParallelMeshDims(shard="dp_shard")
    # Where torch has it, nothing is replaced.
    monkeypatch.setattr(fsdp, "DataParallelMeshDims", object, raising=False)
    assert titan_compare.install_fsdp_stand_in() is False and fsdp.DataParallelMeshDims is object


def test_command_line_errors(capsys):
    for argv, message in ((["--seq-len", "60"], "multiple of 8"), (["--steps", "2"], "at least 4"),
                          (["--local-batch-size", "0"], "must be positive"),
                          (["--compile", "inductor", "--count-saved", "on"], "torch.compile cannot trace")):
        with pytest.raises(SystemExit):
            compare_torchtitan.parse_args(argv)
        assert message in capsys.readouterr().err
    args = compare_torchtitan.parse_args(["--device", "cpu", "--search", "micro-batch"])
    with pytest.raises(SystemExit, match="--search needs a GPU"):
        titan_compare.resolve(args)
    args = compare_torchtitan.parse_args(["--device", "cpu"])
    assert titan_compare.resolve(args).type == "cpu" and (args.family, args.backend) == ("tiny", "reference")
    assert (args.compile, args.count_saved) == ("off", "on")
    # The saved-bytes count stays off under compile unless asked for.
    assert compare_torchtitan.parse_args(["--compile", "aot_eager"]).count_saved == "off"


def test_micro_batch_search_with_a_simulated_allocator(monkeypatch):
    """search_micro_batch's bookkeeping on a stand-in device: 40 GiB of model plus 1 GiB per 1024
    tokens under an 80 GiB budget fits micro-batches of 4096 tokens up to 10; the captured step is
    freed first; the allocator cap is lifted afterwards."""
    gib = 2**30
    state = {"fraction": 1.0, "peak": 0, "released": False}
    total = 140 * gib

    class FakeTrainer:
        device = torch.device("cuda", 0)
        run = types.SimpleNamespace(local_batch_size=2, seq_len=4096, cuda_graphs=True)
        optimizers = types.SimpleNamespace(zero_grad=lambda set_to_none: None)

        def release_cuda_graph(self):
            state["released"] = True

        def forget_failed_step(self):
            state["forgotten"] = state.get("forgotten", 0) + 1
            return []

        def random_batch(self, batch_size, seq_len, generator):
            return batch_size, seq_len

        def train_step(self, batch, eager):
            assert eager and state["released"]
            need = 40 * gib + batch[0] * batch[1] * gib // 1024
            if need > state["fraction"] * total:
                state["peak"] = int(state["fraction"] * total)
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            state["peak"] = max(state["peak"], need)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: state.update(fraction=fraction))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: state.update(peak=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: state["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 40 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 41 * gib)
    lines = []
    found = titan_compare.search_micro_batch(FakeTrainer(), 80 * gib, 60.0, lines.append)
    assert found["largest_fitting"] == 10 and found["smallest_failing"] == 11 and state["fraction"] == 1.0
    assert all(p["fits"] == (p["value"] <= 10) for p in found["probes"]) and len(lines) == len(found["probes"])
    assert state["forgotten"] == sum(not p["fits"] for p in found["probes"])


def test_family_parameters_match_the_models_torchtitan_builds():
    """The CPU rule's sizes: each family's parameter count against the model torchtitan builds
    (on the meta device), norms being all it leaves out."""
    from moeblaze_megatron.training.families import fits_cpu
    from moeblaze_megatron.training.titan_models import TITAN_FAMILIES, titan_model_config

    for name, family in TITAN_FAMILIES.items():
        with torch.device("meta"):
            built = sum(p.numel() for p in titan_model_config(name, "sdpa").build().parameters())
        assert family.parameters() <= built <= 1.003 * family.parameters(), (name, family.parameters(), built)
    assert [name for name, family in TITAN_FAMILIES.items() if fits_cpu(family.parameters())] == ["tiny"]


@pytest.mark.parametrize("argv,message", [
    (["--family", "qwen3_moe"], "--family qwen3_moe does not run on the CPU: 2.49 billion parameters"),
    (["--cuda-graphs", "on"], "--cuda-graphs on needs a GPU"),
    (["--search", "micro-batch"], "--search needs a GPU"),
    (["--warmup", "5", "--steps", "5"], "--warmup (5) must be at least 0 and smaller than --steps (5)"),
])
def test_every_argument_is_checked_before_anything_trains(monkeypatch, capsys, argv, message):
    """On the CPU a bad argument fails before any run is built, as one error line naming it."""
    from moeblaze_megatron.training import titan_loop

    def trained(*args, **kwargs):
        raise AssertionError("a run was built before every argument was checked")

    monkeypatch.setattr(titan_loop, "TitanTrainer", trained)
    assert compare_torchtitan.main(["--device", "cpu", "--out", "/nonexistent/never-written", *argv]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[-1].startswith(f"compare_torchtitan.py: error: {message}"), errors


def test_the_table_words_a_slower_step_as_slower_and_names_no_goal():
    run = lambda name, step: {"dispatcher": name, "median_step_seconds": step, "tokens_per_second": 8192 / step,  # noqa: E731
                              "peak_memory_bytes": 2**30, "saved_moe_bytes": 2**20, "saved_activation_bytes": 2**21,
                              "median_phase_seconds": {"forward_backward": step}, "moe_layers": 4,
                              "routed_experts_seconds_per_layer": 0.004, "routed_experts_queued_seconds_per_layer": 0.003}
    result = {"environment": {"torchtitan": "0.3.0", "device": "cuda:0"},
              "config": {"family": "qwen3_moe", "local_batch_size": 2, "seq_len": 4096, "cuda_graphs_used": True,
                         "attention": "sdpa", "activation_checkpoint": "none", "loss": "plain", "compile": "off"},
              "runs": {"baseline": run("stock", 0.100), "candidate": run("moeblaze", 0.127)},
              "ratios": {"step_time_speedup": 0.100 / 0.127, "step_time_speedup_bound": 1.14, "saved_moe_fraction": 0.15,
                         "peak_memory_fraction": 1.1, "largest_fitting_ratio": 0.5},
              "loss_check": {"passed": True, "worst_diff_over_tolerance": 0.1, "steps": [{}] * 30}}
    table = titan_compare.table(result)
    line = next(line for line in table.splitlines() if line.startswith("moeblaze: step time "))
    assert line == ("moeblaze: step time 1.27x slower than stock (1.14x faster if its routed experts took no time); "
                    "MoE saved for backward 6.67x less; peak memory 1.10x more; largest micro-batch 2.00x smaller")
    assert "goal" not in table
