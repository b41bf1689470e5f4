"""The minimal Megatron-Core loop on the CPU: MoEBlaze against the stock dispatcher on the tiny
model and on narrowed versions of the example families, Megatron --save/--load resumes (also
across dispatchers), and compare_dispatchers.py's loss check, search and command line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import load_script

from moeblaze_megatron.cpu_compat import enable_cpu_megatron
from moeblaze_megatron.train_loop import RunSpec, Trainer, single_process

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
# fp32 losses of two dispatchers from the same weights differ only by summation order in the
# MoE layers (a few ulps, 1e-7 relative); after a handful of steps that grows to ~1e-6. 1e-5
# relative still catches a wrong expert, probability or weight mapping (differences of 1e-2+).
LOSS_RTOL = 1e-5
# Narrowed example families: the same router, expert-count ratios and features at CPU width.
NARROW = ["--hidden-size", "64", "--ffn-hidden-size", "128", "--moe-ffn-hidden-size", "32",
          "--num-attention-heads", "4", "--kv-channels", "16", "--num-query-groups", "2",
          "--moe-shared-expert-intermediate-size", "32"]


@pytest.fixture(scope="module")
def cpu_world():
    with enable_cpu_megatron(), single_process(CPU):
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from moeblaze_megatron.data import build_byte_dataset, stdlib_source_files

    prefix = tmp_path_factory.mktemp("corpus") / "pystdlib"
    build_byte_dataset(prefix, stdlib_source_files(), max_bytes=300_000)
    return str(prefix)


def tiny(dispatcher, corpus, **overrides):
    fields = dict(family="tiny", dispatcher=dispatcher, seq_length=32, micro_batch_size=2, train_iters=8,
                  data_path=corpus, lr=3e-3, min_lr=3e-4, warmup_iters=2, clip_grad=0.0)
    fields.update(overrides)
    return RunSpec(**fields)


def train(run, steps, initial_state=None, save_at=None):
    trainer = Trainer(run, CPU, initial_state=initial_state)
    state = trainer.unwrapped_state_dict() if initial_state is None else initial_state
    losses = []
    for _ in range(steps):
        losses.append(trainer.train_step().loss)
        if trainer.iteration == save_at:
            trainer.save()
    iteration = trainer.iteration
    trainer.close()
    return losses, state, iteration


def assert_close_losses(got, want, rtol):
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rtol * abs(w), f"step {step}: {g} vs {w}"


def test_moeblaze_trains_like_stock_and_resumes_across_dispatchers(cpu_world, corpus, tmp_path):
    """Each dispatcher saves a Megatron checkpoint at step 4 of 8 and goes on; each checkpoint is
    resumed under both dispatchers. Resuming under the dispatcher that saved it reproduces the
    uninterrupted losses exactly; under the other, to fp32 rounding; and the two uninterrupted
    runs (same initial weights) agree to fp32 rounding."""
    uninterrupted, state = {}, None
    for dispatcher in ("allgather", "moeblaze"):
        save = tmp_path / dispatcher
        losses, state, _ = train(tiny(dispatcher, corpus, save=str(save)), 8, initial_state=state, save_at=4)
        uninterrupted[dispatcher] = losses
        assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert uninterrupted["allgather"][-1] < uninterrupted["allgather"][0] - 0.5  # it learns
    assert_close_losses(uninterrupted["moeblaze"], uninterrupted["allgather"], LOSS_RTOL)

    for saved_by in ("allgather", "moeblaze"):
        for resumed_under in ("allgather", "moeblaze"):
            trainer = Trainer(tiny(resumed_under, corpus, load=str(tmp_path / saved_by)), CPU)
            assert trainer.iteration == 4 and trainer.args.consumed_train_samples == 8
            resumed = [trainer.train_step().loss for _ in range(4)]
            trainer.close()
            want = uninterrupted[saved_by][4:]
            if resumed_under == saved_by:
                assert resumed == want, f"{saved_by} checkpoint resumed under {resumed_under}"
            else:
                assert_close_losses(resumed, want, LOSS_RTOL)


@pytest.mark.parametrize("family,experts", [("mixtral", None), ("deepseek_v3", "16"), ("qwen3_moe", "16")])
def test_example_families_train_alike(cpu_world, family, experts):
    """Each example family's router and MoE options (top-2 softmax; sigmoid + expert bias + group-
    limited routing + shared expert + dense first layer + seq aux loss; top-8 of many experts +
    QK-norm), narrowed to CPU width, give the same losses under both dispatchers."""
    extra = NARROW + (["--num-experts", experts] if experts else [])
    runs = {}
    state = None
    for dispatcher in ("allgather", "moeblaze"):
        run = RunSpec(family=family, dispatcher=dispatcher, seq_length=32, micro_batch_size=2, train_iters=3,
                      warmup_iters=1, clip_grad=0.0, extra_args=extra)
        runs[dispatcher], state, _ = train(run, 3, initial_state=state)
    assert_close_losses(runs["moeblaze"], runs["allgather"], LOSS_RTOL)


def test_run_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="family"):
        RunSpec(family="gpt5", dispatcher="moeblaze", seq_length=8, micro_batch_size=1, train_iters=2)
    with pytest.raises(ValueError, match="warmup_iters"):
        RunSpec(family="tiny", dispatcher="moeblaze", seq_length=8, micro_batch_size=1, train_iters=2, warmup_iters=2)
    with pytest.raises(ValueError, match="seq_length"):
        RunSpec(family="tiny", dispatcher="moeblaze", seq_length=0, micro_batch_size=1, train_iters=2)


# ---------------------------------------------------------------------------------------------
# compare_dispatchers.py


def test_loss_check_tolerance():
    compare = load_script("compare_dispatchers")
    fp32_u, bf16_u = 2.0**-24, 2.0**-8
    baseline = [6.0, 5.0, 4.0, 3.0]
    control = [6.0, 5.0 + 1e-3, 4.0, 3.0]  # the control diverged by 1e-3 at step 2
    same = compare.loss_check(baseline, list(baseline), control, fp32_u, 256)
    assert same["passed"] and same["worst_diff_over_tolerance"] == 0.0
    within = compare.loss_check(baseline, [6.0, 5.0, 4.0 + 3.9e-3, 3.0], control, fp32_u, 256)  # < 4 x envelope
    assert within["passed"]
    beyond = compare.loss_check(baseline, [6.0, 5.0, 4.0 + 4.1e-3, 3.0], control, fp32_u, 256)
    assert not beyond["passed"] and beyond["worst_diff_over_tolerance"] > 1.0
    # Before the control diverges the floor applies. fp32: 4 float32 ulps of the loss (ulp(6) = 2**-21).
    ulp6 = 2.0**-21
    assert compare.loss_check(baseline, [6.0 + 3 * ulp6, 5.0, 4.0, 3.0], control, fp32_u, 256)["passed"]
    assert not compare.loss_check(baseline, [6.0 + 5 * ulp6, 5.0, 4.0, 3.0], control, fp32_u, 256)["passed"]
    # bf16 over 4096 tokens: 4 * 2**-8 * 6 / 64 ~ 1.5e-3.
    assert compare.loss_check(baseline, [6.0 + 1.4e-3, 5.0, 4.0, 3.0], control, bf16_u, 4096)["passed"]
    assert not compare.loss_check(baseline, [6.0 + 1.6e-3, 5.0, 4.0, 3.0], control, bf16_u, 4096)["passed"]


@pytest.mark.parametrize("threshold,start,granule", [(37, 2, 1), (1, 4, 1), (5000, 4096, 256), (0, 2, 1), (10**9, 2, 1)])
def test_largest_fitting_search(threshold, start, granule):
    compare = load_script("compare_dispatchers")
    probed = []

    def fits(value):
        probed.append(value)
        return value <= threshold

    cap = 64 * start
    found = compare.largest_fitting(fits, start, granule, cap, time.perf_counter() + 60)
    want = min(threshold // granule * granule, cap // granule * granule)
    if want < granule:
        assert found["largest_fitting"] is None and found["smallest_failing"] == granule
    elif threshold >= cap:
        assert found["capped"] and found["largest_fitting"] > cap // 2
    else:
        assert found["largest_fitting"] == want and found["smallest_failing"] == want + granule
    assert all(v % granule == 0 and granule <= v <= cap for v in probed)
    assert len(probed) <= 2 * cap.bit_length() + 2
    assert not found["time_limited"]


def test_largest_fitting_stops_at_deadline():
    compare = load_script("compare_dispatchers")
    found = compare.largest_fitting(lambda v: True, 1, 1, 1 << 20, time.perf_counter() - 1)
    assert found["time_limited"] and found["largest_fitting"] is None


def test_compare_dispatchers_cli(tmp_path):
    """The README's command on the CPU, shortened: it trains both dispatchers and the control,
    checks the resume, writes the JSON, markdown and PNG, and exits 0."""
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "compare_dispatchers.py"), "--device", "cpu", "--steps", "8",
         "--seq-length", "32", "--data", "mock", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "losses agree" in result.stdout and "resumed under moeblaze" in result.stdout
    report = json.loads((out / "compare.json").read_text())
    assert report["loss_check"]["passed"] and report["resume"]["passed"]
    runs = report["runs"]
    assert [runs[k]["dispatcher"] for k in ("baseline", "candidate", "control")] == ["allgather", "moeblaze", "allgather"]
    assert all(len(runs[k]["losses"]) == 8 for k in runs)
    assert runs["baseline"]["losses"][0] == pytest.approx(runs["candidate"]["losses"][0], rel=LOSS_RTOL)
    assert runs["candidate"]["saved_activation_bytes"] > 0 and runs["candidate"]["tokens_per_second"] > 0
    markdown = (out / "report.md").read_text()
    assert "| moeblaze |" in markdown and "## Losses (agree" in markdown and "## Resume (ok)" in markdown
    assert (out / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_dispatchers_fails_on_divergence(tmp_path, monkeypatch):
    compare = load_script("compare_dispatchers")
    baseline, candidate, control = [6.0, 5.0, 4.0], [6.0, 5.5, 5.0], [6.0, 5.0, 4.0]

    def diverging(args, device, torch_module, progress):
        runs = {name: {"dispatcher": d, "losses": losses, "step_seconds": [1.0] * 3, "tokens_per_step": 64,
                       "median_step_seconds": 1.0, "tokens_per_second": 64.0, "saved_activation_bytes": 1}
                for name, d, losses in (("baseline", "allgather", baseline), ("candidate", "moeblaze", candidate),
                                        ("control", "allgather", control))}
        return {"config": {"family": "tiny", "memory_budget_gib": 80.0}, "environment": {"device": "cpu"},
                "runs": runs, "ratios": {"step_time_speedup": 1.0, "saved_activation_ratio": 1.0},
                "loss_check": compare.loss_check(baseline, candidate, control, 2.0**-24, 64)}

    monkeypatch.setattr(compare, "compare", diverging)
    assert compare.main(["--device", "cpu", "--out", str(tmp_path)]) == 1
    assert "## Losses (DIVERGE" in (tmp_path / "report.md").read_text()


def test_search_memory_with_a_simulated_allocator(monkeypatch):
    """search_memory's GPU bookkeeping on a stand-in device: a model of 40 GiB plus 1 GiB per
    1024 tokens under an 80 GiB budget fits micro-batches up to 10 of 4096 tokens; larger probes
    run out of memory (the allocator cap) and are reported as not fitting."""
    compare = load_script("compare_dispatchers")
    gib = 2**30
    state = {"fraction": 1.0, "peak": 0}
    total = 140 * gib

    class FakeTrainer:
        device = torch.device("cuda", 0)

        class args:
            micro_batch_size, seq_length = 2, 4096

        def random_batches(self, micro_batch_size, seq_length, generator):
            return [(micro_batch_size, seq_length)]

        def train_step(self, batches):
            mbs, seq = batches[0]
            need = 40 * gib + mbs * seq * gib // 1024
            if need > state["fraction"] * total:
                state["peak"] = int(state["fraction"] * total)
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            state["peak"] = max(state["peak"], need)

    class Properties:
        total_memory = total

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: state.update(fraction=fraction))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: state.update(peak=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: state["peak"])
    lines = []
    found = compare.search_memory(FakeTrainer(), "micro-batch", 80 * gib, 60.0, lines.append)
    assert found["largest_fitting"] == 10 and found["smallest_failing"] == 11
    assert state["fraction"] == 1.0  # the cap is lifted afterwards
    assert all(p["fits"] == (p["value"] <= 10) for p in found["probes"])
    assert all(p["peak_bytes"] <= 80 * gib for p in found["probes"])
    assert len(lines) == len(found["probes"]) and "does not fit" in lines[-1] + lines[-2]
    by_seq = compare.search_memory(FakeTrainer(), "seq-length", 80 * gib, 60.0, lines.append)
    assert by_seq["largest_fitting"] == 20480  # 2 x 20480 tokens = 40 GiB of activations
