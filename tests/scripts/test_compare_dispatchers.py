"""compare_dispatchers.py's loss check, memory search (benchlib.comparison, dispatcher_compare and
benchlib.memory_search), verdict and command line. (The training loop it drives is tested in
tests/training/test_train_loop.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from benchlib import comparison
from benchlib import dispatcher_compare as compare
from benchlib.memory_search import largest_fitting, search_memory

import compare_dispatchers

REPO = Path(__file__).resolve().parents[2]
# fp32 losses of two dispatchers from the same weights differ only by summation order in the
# MoE layers (a few ulps, 1e-7 relative); after a handful of steps that grows to ~1e-6. 1e-5
# relative still catches a wrong expert, probability or weight mapping (differences of 1e-2+).
LOSS_RTOL = 1e-5


def test_loss_check_tolerance():
    fp32_u, bf16_u = 2.0**-24, 2.0**-8
    baseline = [6.0, 5.0, 4.0, 3.0]
    control = [6.0, 5.0 + 1e-3, 4.0, 3.0]  # the control diverged by 1e-3 at step 2
    same = comparison.loss_check(baseline, list(baseline), control, fp32_u, 256)
    assert same["passed"] and same["worst_diff_over_tolerance"] == 0.0
    within = comparison.loss_check(baseline, [6.0, 5.0, 4.0 + 3.9e-3, 3.0], control, fp32_u, 256)  # < 4 x envelope
    assert within["passed"]
    beyond = comparison.loss_check(baseline, [6.0, 5.0, 4.0 + 4.1e-3, 3.0], control, fp32_u, 256)
    assert not beyond["passed"] and beyond["worst_diff_over_tolerance"] > 1.0
    # Before the control diverges the floor applies. fp32: 4 float32 ulps of the loss (ulp(6) = 2**-21).
    ulp6 = 2.0**-21
    assert comparison.loss_check(baseline, [6.0 + 3 * ulp6, 5.0, 4.0, 3.0], control, fp32_u, 256)["passed"]
    assert not comparison.loss_check(baseline, [6.0 + 5 * ulp6, 5.0, 4.0, 3.0], control, fp32_u, 256)["passed"]
    # bf16 over 4096 tokens: 4 * 2**-8 * 6 / 64 ~ 1.5e-3.
    assert comparison.loss_check(baseline, [6.0 + 1.4e-3, 5.0, 4.0, 3.0], control, bf16_u, 4096)["passed"]
    assert not comparison.loss_check(baseline, [6.0 + 1.6e-3, 5.0, 4.0, 3.0], control, bf16_u, 4096)["passed"]


@pytest.mark.parametrize("threshold,start,granule", [(37, 2, 1), (1, 4, 1), (5000, 4096, 256), (0, 2, 1), (10**9, 2, 1)])
def test_largest_fitting_search(threshold, start, granule):
    probed = []

    def fits(value):
        probed.append(value)
        return value <= threshold

    cap = 64 * start
    found = largest_fitting(fits, start, granule, cap, time.perf_counter() + 60)
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


def test_largest_fitting_recheck_catches_a_probe_that_spoils_the_next():
    """Sizes up to 27 fit, but once a probe has failed every later probe fails (memory a failed
    probe left behind): the bracket then ends at 16 / 17, and the recheck of 16 says not to trust it."""
    state = {"spoiled": False}

    def fits(value):
        ok = value <= 27 and not state["spoiled"]
        state["spoiled"] |= not ok
        return ok

    found = largest_fitting(fits, 2, 1, 128, time.perf_counter() + 60, recheck=True)
    assert (found["largest_fitting"], found["smallest_failing"], found["recheck_fits"]) == (16, 17, False)
    state["spoiled"] = False
    clean = largest_fitting(lambda v: v <= 27, 2, 1, 128, time.perf_counter() + 60, recheck=True)
    assert (clean["largest_fitting"], clean["recheck_fits"]) == (27, True)
    # Without a failure (capped) or without recheck, nothing is probed again.
    assert largest_fitting(lambda v: True, 2, 1, 8, time.perf_counter() + 60, recheck=True)["recheck_fits"] is None
    assert largest_fitting(lambda v: v <= 27, 2, 1, 128, time.perf_counter() + 60)["recheck_fits"] is None


def test_comparison_ratios_name_their_direction():
    base = {"median_step_seconds": 0.3, "saved_activation_bytes": 400, "saved_moe_bytes": 300, "peak_memory_bytes": 80}
    cand = {"median_step_seconds": 0.1, "saved_activation_bytes": 100, "saved_moe_bytes": 30, "peak_memory_bytes": 60}
    search = {"baseline": {"largest_fitting": 8}, "candidate": {"largest_fitting": 14}}
    ratios = comparison.comparison_ratios(base, cand, search, byte_keys=("saved_activation_bytes", "saved_moe_bytes"))
    assert ratios == pytest.approx({"step_time_speedup": 3.0, "saved_activation_fraction": 0.25,
                                    "saved_moe_fraction": 0.1, "peak_memory_fraction": 0.75,
                                    "largest_fitting_ratio": 1.75})
    # No peak (CPU), no search or a search that found nothing: those ratios are left out.
    plain = comparison.comparison_ratios({**base, "peak_memory_bytes": None}, cand,
                                      {"baseline": {"largest_fitting": None}, "candidate": {"largest_fitting": 4}})
    assert set(plain) == {"step_time_speedup", "saved_activation_fraction"}


def test_largest_fitting_stops_at_deadline():
    found = largest_fitting(lambda v: True, 1, 1, 1 << 20, time.perf_counter() - 1)
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


def test_compare_dispatchers_fails_on_divergence(tmp_path, monkeypatch, capsys):
    """A candidate off the baseline's curve fails the run (exit status 1), and the report says so;
    without --out the outputs go to runs/compare/<family>-<device> (git-ignored), and the run
    says where."""
    baseline, candidate, control = [6.0, 5.0, 4.0], [6.0, 5.5, 5.0], [6.0, 5.0, 4.0]

    def diverging(args, device, progress, save_partial=None):
        runs = {name: {"dispatcher": d, "losses": losses, "step_seconds": [1.0] * 3, "tokens_per_step": 64,
                       "median_step_seconds": 1.0, "tokens_per_second": 64.0, "saved_activation_bytes": 1}
                for name, d, losses in (("baseline", "allgather", baseline), ("candidate", "moeblaze", candidate),
                                        ("control", "allgather", control))}
        return {"config": {"family": "tiny", "memory_budget_gib": 80.0}, "environment": {"device": "cpu"},
                "runs": runs, "ratios": {"step_time_speedup": 1.0, "saved_activation_fraction": 1.0},
                "loss_check": comparison.loss_check(baseline, candidate, control, 2.0**-24, 64)}

    assert compare.DEFAULT_OUT == REPO / "runs" / "compare"
    assert "/runs/" in (REPO / ".gitignore").read_text().split()
    monkeypatch.setattr(compare, "compare", diverging)
    monkeypatch.setattr(compare, "DEFAULT_OUT", tmp_path / "runs")
    args = compare_dispatchers.parse_args(["--device", "cpu"])
    assert compare.run(args, "python scripts/compare_dispatchers.py --device cpu") == 1
    out = tmp_path / "runs" / "tiny-cpu"
    assert "## Losses (DIVERGE" in (out / "report.md").read_text()
    printed = capsys.readouterr().out
    assert f"outputs go to {out}/" in printed and f"wrote {out}/compare.json" in printed
    assert "FAILED: losses diverge beyond rounding noise" in printed


def test_search_memory_with_a_simulated_allocator(monkeypatch):
    """search_memory's GPU bookkeeping on a stand-in device: a model of 40 GiB plus 1 GiB per
    1024 tokens under an 80 GiB budget fits micro-batches up to 10 of 4096 tokens; larger probes
    run out of memory (the allocator cap) and are reported as not fitting."""
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

        def forget_failed_step(self):
            state["forgotten"] = state.get("forgotten", 0) + 1
            return ["Dispatcher.probs"]

    class Properties:
        total_memory = total

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: state.update(fraction=fraction))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: state.update(peak=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: state["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 40 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 41 * gib)
    lines = []
    found = search_memory(FakeTrainer(), "micro-batch", 80 * gib, 60.0, lines.append)
    assert found["largest_fitting"] == 10 and found["smallest_failing"] == 11
    assert state["fraction"] == 1.0  # the cap is lifted afterwards
    assert all(p["fits"] == (p["value"] <= 10) for p in found["probes"])
    assert all(p["peak_bytes"] <= 80 * gib for p in found["probes"])
    assert len(lines) == len(found["probes"]) and "does not fit" in lines[-1] + lines[-2]
    # Each probe records where the allocator started and why it failed.
    assert all((p["allocated_at_start_bytes"], p["reserved_at_start_bytes"]) == (40 * gib, 41 * gib)
               for p in found["probes"]) and "41.0 reserved" in lines[0]
    assert all((p["error"] is None) == p["fits"] for p in found["probes"])
    assert "CUDA out of memory (simulated)" in {p["error"] for p in found["probes"]}
    # Each failed probe has the trainer forget its step, and says what that dropped.
    failed = [p for p in found["probes"] if not p["fits"]]
    assert state["forgotten"] == len(failed) and all(p["dropped"] == ["Dispatcher.probs"] for p in failed)
    assert all(p["held_after_failure"] == [] for p in failed) and any("dropped Dispatcher.probs" in line for line in lines)
    by_seq = search_memory(FakeTrainer(), "seq-length", 80 * gib, 60.0, lines.append)
    assert by_seq["largest_fitting"] == 20480  # 2 x 20480 tokens = 40 GiB of activations


def test_graph_holders_list_plain_tensors_and_skip_a_compilers_fake_ones():
    # torch.compile keeps fake tensors (symbolic sizes, no memory) that gc still finds; reading
    # their sizes raised on the GPU (TE's layer spec compiles parts of the model). A plain tensor
    # with a graph, held by an object, is listed with its owner.
    from benchlib.memory_search import graph_holders
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    class Owner:
        pass

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    fake_owner, plain_owner = Owner(), Owner()
    with mode:
        fake_owner.kept = mode.from_tensor(torch.randn(8, 4, requires_grad=True), symbolic_context=context) * 2
    plain_owner.kept = torch.randn(8, 4, requires_grad=True) * 2
    held = graph_holders(torch.device("cpu"))
    assert [h["owners"] for h in held] == [["Owner.kept"]]
    assert held[0]["shape"] == [8, 4] and held[0]["grad_fn"] == "MulBackward0"
    del plain_owner.kept
    assert graph_holders(torch.device("cpu")) == []


def test_family_parameters_match_the_models_megatron_builds():
    """The CPU rule's sizes: each family's parameter count from its flags against the GPTModel
    Megatron builds from them (on the meta device: no memory), norms being all it leaves out."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    from moeblaze_megatron.training import families
    from moeblaze_megatron.training.cpu_shims import enable_cpu_megatron
    from moeblaze_megatron.training.pretraining import gpt_model_config
    from moeblaze_megatron.training.train_loop import RunSpec, parse_megatron_args, single_process

    cpu = torch.device("cpu")
    with enable_cpu_megatron(), single_process(cpu):
        for family in families.MODEL_FAMILIES:
            run = RunSpec(family=family, dispatcher="allgather", seq_length=64, micro_batch_size=1, train_iters=2,
                          warmup_iters=0)
            args = parse_megatron_args(run.megatron_argv(cpu))
            with torch.device("meta"):
                model = GPTModelBuilder(gpt_model_config(args)).build_model(ProcessGroupCollection.use_mpu_process_groups())
            built = sum(p.numel() for p in model.parameters())
            estimate = families.family_parameters(family)
            assert estimate <= built <= 1.002 * estimate, (family, estimate, built)
    assert families.megatron_cpu_families() == ["tiny"]


def test_a_family_too_large_for_the_cpu_is_refused_before_anything_is_built(tmp_path):
    """On the CPU, --family deepseek_v3 (37 GiB of fp32 training state) is refused by name in one
    line, with what to run instead, before a model is built or an output folder made."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "compare_dispatchers.py"), "--device", "cpu",
                           "--family", "deepseek_v3", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and len(errors) == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert errors[0].startswith("compare_dispatchers.py: error: --family deepseek_v3 does not run on the CPU")
    assert "use --family tiny" in errors[0] and "on a GPU" in errors[0]
    assert "building" not in done.stdout and not (tmp_path / "out").exists()


@pytest.fixture
def nothing_trains(monkeypatch):
    """A Trainer that fails the test if a run is ever built."""
    from moeblaze_megatron.training import train_loop

    def trained(*args, **kwargs):
        raise AssertionError("a run was built before every argument was checked")

    monkeypatch.setattr(train_loop, "Trainer", trained)


@pytest.mark.parametrize("argv,message", [
    (["--candidate", "moeblze"], "--candidate must be one of allgather, alltoall, flex, moeblaze, got 'moeblze'"),
    (["--baseline", "moeblaze"], "--baseline must be one of allgather, alltoall, flex, alltoall_te, got 'moeblaze'"),
    (["--megatron-args=--no-such-flag"], "--megatron-args --no-such-flag: unrecognized arguments: --no-such-flag"),
    (["--megatron-args", "--moe-router-topk", "many"], "--megatron-args --moe-router-topk many: argument --moe-router-topk"),
    (["--data", "/no/such/prefix"], "--data: no Megatron indexed dataset at /no/such/prefix"),
    (["--warmup", "8", "--steps", "8"], "--warmup (8) must be at least 0 and smaller than --steps (8)"),
    (["--baseline", "alltoall_te"], "--baseline alltoall_te needs a GPU"),
    (["--search", "micro-batch"], "--search needs a GPU"),
])
def test_every_argument_is_checked_before_anything_trains(nothing_trains, capsys, argv, message):
    """A bad argument, the candidate's and Megatron's included, fails before any run is built,
    in one line that names the user's own flag."""
    assert compare_dispatchers.main(["--device", "cpu", *argv]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[-1].startswith(f"compare_dispatchers.py: error: {message}"), errors


def test_fp8_recipe_is_refused_by_the_plugin_before_anything_trains(nothing_trains, capsys):
    """fp8 in --megatron-args (either form) under Megatron's default recipe (delayed): the plugin's
    own refusal, as one error line naming --megatron-args, exit status 2, no traceback."""
    for argv in (["--megatron-args=--fp8-format e4m3"], ["--megatron-args", "--fp8-format", "e4m3"]):
        assert compare_dispatchers.main(["--device", "cpu", *argv]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if "error:" in line]
        assert errors == [
            "compare_dispatchers.py: error: --megatron-args --fp8-format e4m3: moe_token_dispatcher_type='moeblaze' "
            "does not support: fp8_recipe='delayed': MoEBlaze's FP8 experts run the blockwise recipe only; use "
            "--fp8-recipe blockwise (Megatron-Core's recipe for Hopper)"], err
        assert "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["--megatron-args", "--moe-router-topk", "4", "--moe-aux-loss-coeff", "1e-2"],
    ["--megatron-args=--moe-router-topk 4 --moe-aux-loss-coeff 1e-2"],
    ["--megatron-args", "--moe-router-topk 4 --moe-aux-loss-coeff 1e-2"],
    ["--megatron-args=--moe-router-topk 4", "--megatron-args", "--moe-aux-loss-coeff", "1e-2"],
])
def test_megatron_args_take_the_rest_of_the_line_or_one_value(argv):
    args = compare_dispatchers.parse_args(["--steps", "6", *argv])
    assert args.megatron_args == ["--moe-router-topk", "4", "--moe-aux-loss-coeff", "1e-2"] and args.steps == 6


def test_megatron_args_refuse_this_scripts_own_flags_after_them(capsys):
    with pytest.raises(SystemExit) as exit_:
        compare_dispatchers.parse_args(["--megatron-args", "--moe-router-topk", "4", "--steps", "6"])
    assert exit_.value.code == 2
    assert "--steps is this script's own: put it before --megatron-args" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare_dispatchers.parse_args(["--megatron-args"])
    assert "--megatron-args: expected Megatron flags after it" in capsys.readouterr().err
    # Documented where a user looks: --help, with an example.
    with pytest.raises(SystemExit):
        compare_dispatchers.parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert "--megatron-args --moe-router-topk 4" in help_text and "--megatron-args='--moe-router-topk 4'" in help_text


def test_ratios_are_said_on_their_side_of_one():
    from benchlib import wording

    assert wording.faster(1.27) == "1.27x faster" and wording.faster(1 / 1.27) == "1.27x slower"
    assert wording.faster(1.0004) == "level (1.00x)"
    assert wording.less(0.25) == "4.00x less" and wording.less(1.3) == "1.30x more"
    assert wording.larger(1.75) == "1.75x larger" and wording.larger(0.5) == "2.00x smaller"
    with pytest.raises(ValueError, match="finite and positive"):
        wording.faster(0.0)


def test_a_slower_candidate_is_reported_slower():
    """report.md words a speedup below 1 as slower (0.79: 1.27x slower), never "0.79x faster"."""
    from benchlib.dispatcher_report import markdown

    rows = [{"step": 1, "baseline": 5.0, "candidate": 5.0, "control": 5.0, "abs_diff": 0.0, "tolerance": 1e-3}]
    run = lambda name, seconds, saved: {"dispatcher": name, "median_step_seconds": seconds,  # noqa: E731
                                         "tokens_per_second": 64 / seconds, "saved_activation_bytes": saved}
    result = {"config": {"family": "tiny", "memory_budget_gib": 80.0}, "environment": {"device": "cpu"},
              "command": "test", "runs": {"baseline": run("allgather", 0.79, 100), "candidate": run("moeblaze", 1.0, 130)},
              "ratios": {"step_time_speedup": 0.79, "saved_activation_fraction": 1.3},
              "loss_check": {**comparison.loss_check([5.0], [5.0], [5.0], 2.0**-24, 64), "steps": rows}}
    text = markdown(result)
    assert "step time 1.27x slower with moeblaze" in text and "saved activations 1.30x more" in text
    assert "faster" not in text
