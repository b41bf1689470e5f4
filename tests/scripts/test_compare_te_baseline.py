"""compare_dispatchers.py's Transformer Engine baseline without TE: the argument checks of
--baseline alltoall_te, which flags each run gets, the stock variant selection (each variant from
the same weights, the fastest kept, failures reported), the control repeating either run, and
the loss check's envelope. Megatron's Trainer is replaced by a stand-in that records how it was
built (the real loop with TE runs on the GPU: scripts/gpu_suite.sh STEPS=te_select/te_compare)."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from benchlib import comparison
from benchlib import dispatcher_compare as compare
from benchlib import dispatcher_report

from moeblaze_megatron.training import families, pretraining, train_loop

TE = families.TE_STOCK_VARIANTS


def args_for(**overrides):
    fields = dict(device="cuda", family="qwen3_moe", baseline="alltoall_te", candidate="moeblaze", steps=6, warmup=2,
                  seq_length=32, micro_batch_size=2, lr=1e-3, seed=1, data="mock", search="none",
                  memory_budget_gib=80.0, search_time_limit=1.0, resume_check=False, megatron_args=[], out=None,
                  stock_variants=None, variant_steps=5, select_only=False, attention=None, control="baseline")
    fields.update(overrides)
    return argparse.Namespace(**fields)


@pytest.fixture
def with_te(monkeypatch):
    monkeypatch.setattr(pretraining, "have_transformer_engine", lambda: True)


CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it


def test_te_baseline_argument_checks(monkeypatch, with_te):
    with pytest.raises(SystemExit, match="needs a GPU"):
        compare.resolve_stock_form(args_for(), torch.device("cpu"))
    with pytest.raises(SystemExit, match="--stock-variants applies to --baseline alltoall_te"):
        compare.resolve_stock_form(args_for(baseline="alltoall", stock_variants="te"), CUDA)
    with pytest.raises(SystemExit, match="stock variant must be one of"):
        compare.resolve_stock_form(args_for(stock_variants="te,te_fastest"), CUDA)
    with pytest.raises(SystemExit, match="twice"):
        compare.resolve_stock_form(args_for(stock_variants="te,te"), CUDA)
    with pytest.raises(SystemExit, match="--variant-steps"):
        compare.resolve_stock_form(args_for(stock_variants="te,te_unfused_router", variant_steps=3), CUDA)
    with pytest.raises(SystemExit, match="--select-only"):
        compare.resolve_stock_form(args_for(baseline="alltoall", select_only=True), CUDA)
    monkeypatch.setattr(pretraining, "have_transformer_engine", lambda: False)
    with pytest.raises(SystemExit, match="needs Transformer Engine"):
        compare.resolve_stock_form(args_for(), CUDA)


def test_te_baseline_defaults_and_the_flags_of_each_run(with_te):
    args = args_for()
    compare.resolve_stock_form(args, CUDA)
    assert args.stock_variants == ["te"] and args.stock_variant == "te" and args.attention == "auto"
    dispatcher, extra, env = compare.form(args, "baseline")
    assert dispatcher == "alltoall" and extra == (*TE["te"].stock_args, *TE["te"].shared_args) and env == {}
    assert "--moe-grouped-gemm" in extra and "--moe-permute-fusion" in extra and "--moe-router-fusion" in extra
    # MoEBlaze shares the model's router flags, not the stock dispatch and expert flags.
    assert compare.form(args, "candidate") == ("moeblaze", ("--moe-router-fusion",), {})
    assert compare.label(args, "baseline") == "alltoall_te [te]"
    args.stock_variant = "te_op_fuser"
    assert compare.form(args, "baseline")[2] == {"NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"}
    args.stock_variant = "te_unfused_router"
    assert compare.form(args, "candidate") == ("moeblaze", (), {})
    sequential = args_for(baseline="alltoall")
    compare.resolve_stock_form(sequential, CUDA)
    assert compare.form(sequential, "baseline") == ("alltoall", (), {}) and sequential.attention == "sdpa"
    assert compare.form(sequential, "candidate") == ("moeblaze", (), {})


def test_environment_set_restores():
    os.environ.pop("MOEBLAZE_TEST_VAR", None)
    with compare.environment_set({"MOEBLAZE_TEST_VAR": "1"}):
        assert os.environ["MOEBLAZE_TEST_VAR"] == "1"
    assert "MOEBLAZE_TEST_VAR" not in os.environ


def test_fastest_variant():
    records = {"te": {"median_step_seconds": 0.30}, "te_unfused_router": {"median_step_seconds": 0.28},
               "te_op_fuser": {"error": "AssertionError: Fused GroupedMLP is not supported"}}
    assert compare.fastest_variant(records) == "te_unfused_router"
    assert compare.fastest_variant({"b": {"median_step_seconds": 1.0}, "a": {"median_step_seconds": 1.0}}) == "a"
    with pytest.raises(SystemExit, match="no variant ran.*te_op_fuser: AssertionError"):
        compare.fastest_variant({"te_op_fuser": records["te_op_fuser"]})


class FakeTrainer:
    """Trainer's surface the comparison uses; step time from the flags, losses from the run."""

    built = []
    SECONDS = {"--moe-router-fusion": -0.02, "--use-transformer-engine-op-fuser": None}

    def __init__(self, run, device, initial_state=None, perturb_ulps=0.0):
        env_seen = os.environ.get("NVTE_CUTEDSL_FUSED_GROUPED_MLP")
        FakeTrainer.built.append(dict(dispatcher=run.dispatcher, extra=list(run.extra_args), attention=run.attention,
                                      initial_state=initial_state, perturb=perturb_ulps, env=env_seen, closed=False))
        self.record = FakeTrainer.built[-1]
        if "--use-transformer-engine-op-fuser" in run.extra_args:
            raise AssertionError("Fused GroupedMLP is not supported for this configuration.")
        self.run, self.device, self.iteration = run, device, 0
        self.model = [torch.nn.Linear(2, 2)]
        self.seconds = 0.1 if run.dispatcher == "moeblaze" else 0.3
        self.seconds += sum(v for k, v in self.SECONDS.items() if k in run.extra_args and v)

    def unwrapped_state_dict(self):
        return {"w": torch.tensor([float(len(FakeTrainer.built))])}

    def train_step(self, batches=None, forward_context=None):
        self.iteration += 1
        loss = 5.0 - 0.1 * self.iteration + (1e-4 * self.iteration if self.record["perturb"] else 0.0)
        return train_loop.StepResult(loss=loss, seconds=self.seconds, tokens=64)

    def close(self):
        self.record["closed"] = True


def test_selection_then_comparison_with_the_chosen_form(monkeypatch, with_te):
    """Three variants timed from the first one's weights (the op fuser fails to build and is
    reported), the fastest becomes the baseline; MoEBlaze gets the shared router flag; the control
    repeats MoEBlaze (--control candidate) from the same weights moved by one ulp."""
    monkeypatch.setattr(train_loop, "Trainer", FakeTrainer)
    FakeTrainer.built = []
    args = args_for(stock_variants="te_unfused_router,te,te_op_fuser", control="candidate")
    compare.resolve_stock_form(args, CUDA)
    result = compare.compare(args, torch.device("cpu"), lambda message: None)
    selection = result["stock_selection"]
    assert selection["chosen"] == "te" and args.stock_variant == "te"
    assert "Fused GroupedMLP is not supported" in selection["variants"]["te_op_fuser"]["error"]
    assert selection["variants"]["te"]["median_step_seconds"] == pytest.approx(0.28)
    trials, runs = FakeTrainer.built[:3], FakeTrainer.built[3:]
    assert [t["initial_state"] for t in trials] == [None, {"w": torch.tensor([1.0])}, {"w": torch.tensor([1.0])}]
    assert trials[2]["env"] == "1" and trials[0]["env"] is None and "NVTE_CUTEDSL_FUSED_GROUPED_MLP" not in os.environ
    assert all(t["closed"] for t in FakeTrainer.built if t is not trials[2])  # the op fuser never built
    assert [(r["dispatcher"], r["perturb"]) for r in runs] == [("alltoall", 0.0), ("moeblaze", 0.0), ("moeblaze", 1.0)]
    assert runs[0]["extra"] == [*TE["te"].stock_args, *TE["te"].shared_args]
    assert runs[1]["extra"] == runs[2]["extra"] == ["--moe-router-fusion"]
    assert all(r["initial_state"] == {"w": torch.tensor([1.0])} for r in runs)
    assert all(r["attention"] == "auto" for r in FakeTrainer.built)
    assert result["runs"]["baseline"]["label"] == "alltoall_te [te]"
    assert result["ratios"]["step_time_speedup"] == pytest.approx(0.28 / 0.08)
    check = result["loss_check"]
    assert check["passed"] and check["control_of"] == "candidate"
    markdown = dispatcher_report.markdown({**result, "command": "test"})
    assert "| te (chosen) |" in markdown and "not run: AssertionError" in markdown
    assert "| alltoall_te [te] |" in markdown and "repeats the candidate" in markdown


def test_one_variant_is_not_timed_apart(monkeypatch, with_te):
    monkeypatch.setattr(train_loop, "Trainer", FakeTrainer)
    FakeTrainer.built = []
    partials = []
    args = args_for(stock_variants="te_unfused_router")
    compare.resolve_stock_form(args, CUDA)
    result = compare.compare(args, torch.device("cpu"), lambda message: None,
                             save_partial=lambda r: partials.append((sorted(r["runs"]), "loss_check" in r)))
    assert "stock_selection" not in result and len(FakeTrainer.built) == 3
    assert FakeTrainer.built[2]["dispatcher"] == "alltoall" and FakeTrainer.built[2]["perturb"] == 1.0
    assert partials == [(["baseline"], False), (["baseline", "candidate"], False),
                        (["baseline", "candidate", "control"], False), (["baseline", "candidate", "control"], True)]


def test_loss_check_envelope_follows_the_control():
    baseline, candidate = [6.0, 5.0, 4.0], [6.0, 5.0 + 3e-3, 4.0]
    control_of_candidate = [6.0, 5.0 + 2.9e-3, 4.0]  # 1e-4 from the candidate, 2.9e-3 from the baseline
    u = 2.0**-24
    assert comparison.loss_check(baseline, candidate, control_of_candidate, u, 64, "baseline")["passed"]
    assert not comparison.loss_check(baseline, candidate, control_of_candidate, u, 64, "candidate")["passed"]
    with pytest.raises(ValueError, match="control_of"):
        comparison.loss_check(baseline, candidate, candidate, u, 64, "stock")


def test_run_spec_flags_follow_te_and_apex(monkeypatch):
    """The training loop's command line: local layers only without TE, Apex's fusions off wherever
    Apex is missing (TE or not), the variant's flags appended."""
    spec = train_loop.RunSpec(family="tiny", dispatcher="alltoall", seq_length=16, micro_batch_size=1, train_iters=2,
                              warmup_iters=0, extra_args=list(TE["te"].stock_args))
    for te in (False, True):
        for apex in (False, True):
            monkeypatch.setattr(train_loop, "have_transformer_engine", lambda te=te: te)
            monkeypatch.setattr(train_loop, "have_apex_fusions", lambda apex=apex: apex)
            argv = spec.megatron_argv(torch.device("cpu"))
            assert ("--transformer-impl" in argv) == (not te)
            assert all((flag in argv) == (not apex) for flag in families.NO_APEX_ARGS)
            assert argv[-len(TE["te"].stock_args):] == list(TE["te"].stock_args)


def test_every_variant_flag_is_a_megatron_flag():
    """Megatron-Core 0.19's parser knows every flag of every stock variant (parsed, not validated:
    validation wants TE)."""
    import sys

    from megatron.training.arguments import parse_args

    from moeblaze_megatron.training.pretraining import extra_args_provider

    for variant in TE.values():
        saved = sys.argv
        sys.argv = ["x", *families.family_args("tiny"), *variant.stock_args, *variant.shared_args,
                    *variant.candidate_args]
        try:
            args = parse_args(extra_args_provider)
        finally:
            sys.argv = saved
        flags = (*variant.stock_args, *variant.shared_args, *variant.candidate_args)
        starts = [i for i, token in enumerate(flags) if token.startswith("--")]
        for i, end in zip(starts, [*starts[1:], len(flags)]):
            flag, values = flags[i], list(flags[i + 1:end])
            got = getattr(args, flag.removeprefix("--").replace("-", "_"))
            if not values:
                assert got is True, (variant.name, flag)
            elif flag not in variant.candidate_args:  # the candidate's own scope is given after, and wins
                assert [getattr(v, "name", str(v)) for v in (got if isinstance(got, list) else [got])] == values, (
                    variant.name, flag, got)


def test_apex_probe_looks_for_megatrons_fused_kernel_module(monkeypatch):
    import importlib.util

    asked = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: asked.append(name) or (object() if name else None))
    assert families.have_apex_fusions() is True and asked == ["fused_weight_gradient_mlp_cuda"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert families.have_apex_fusions() is False


def test_every_runs_megatron_arguments_are_checked_first(monkeypatch, with_te):
    """Before the TE baseline trains: each variant's baseline and candidate command lines (the
    candidate first), and the resume check's, through the check a Trainer's parse would make."""
    parsed = []

    def problem(argv):
        parsed.append(argv)
        return None

    monkeypatch.setattr(train_loop, "megatron_argv_problem", problem)
    args = args_for(stock_variants="te,te_op_fuser", resume_check=True, megatron_args=["--moe-aux-loss-coeff", "1e-2"])
    compare.resolve_stock_form(args, CUDA)
    compare.check_megatron_args(args, CUDA)
    dispatchers = [argv[argv.index("--moe-token-dispatcher-type") + 1] for argv in parsed]
    assert dispatchers == ["moeblaze", "alltoall"] * 4  # two variants, then both again for the resume check
    assert ["--use-transformer-engine-op-fuser" in argv for argv in parsed[:4]] == [False, False, False, True]
    assert all(argv[-2:] == ["--moe-aux-loss-coeff", "1e-2"] for argv in parsed)
    assert args.stock_variant == "te"  # the first until the selection runs


def test_the_te_form_refuses_fp8_as_the_plugin_says_it(monkeypatch, with_te):
    # Megatron's validation asks the GPU's compute capability: a Hopper's, with no GPU here.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    args = args_for(stock_variants="te,te_unfused_router", megatron_args=["--fp8-format", "e4m3"])
    compare.resolve_stock_form(args, CUDA)
    with pytest.raises(comparison.ArgumentError, match=r"^--megatron-args --fp8-format e4m3: "
                       r"moe_token_dispatcher_type='moeblaze' does not support: fp8_recipe='delayed'") as error:
        compare.check_megatron_args(args, CUDA)
    assert error.value.code == 2
    args.megatron_args = []
    compare.check_megatron_args(args, CUDA)  # every variant's runs parse and validate
    # Megatron-Core's Hopper recipe: both runs take it (MoEBlaze's experts in FP8, stock's TE ones).
    args.megatron_args = ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--moe-router-padding-for-fp8"]
    compare.check_megatron_args(args, CUDA)


def test_recipe_forms_give_both_runs_the_recipe(with_te):
    """te_recipe: Megatron's performance recipe (CUDA graphs over attn moe_router moe_preprocess,
    the shared-expert overlap, --manual-gc) for both runs, the stock dispatch flags for the stock
    run only; te_recipe_moe_graph: MoEBlaze's graphs capture the attention and the whole MoE
    layer (its scope after the shared flags, so it wins)."""
    args = args_for(stock_variants="te_recipe", family="deepseek_v3")
    compare.resolve_stock_form(args, CUDA)
    dispatcher, extra, _ = compare.form(args, "baseline")
    assert dispatcher == "alltoall" and extra[:2] == ("--moe-grouped-gemm", "--moe-permute-fusion")
    recipe = ("--moe-router-fusion", "--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn",
              "moe_router", "moe_preprocess", "--moe-shared-expert-overlap", "--manual-gc")
    assert extra[2:] == recipe
    assert compare.form(args, "candidate") == ("moeblaze", recipe, {})
    args.stock_variant = "te_recipe_moe_graph"
    assert compare.form(args, "baseline")[1][2:] == recipe
    assert compare.form(args, "candidate") == ("moeblaze", (*recipe, "--cuda-graph-modules", "attn", "moe"), {})


@pytest.mark.parametrize("variant", ["te_recipe", "te_recipe_moe_graph"])
def test_recipe_flags_pass_megatron_and_the_plugin(variant, monkeypatch):
    """Each run's whole command line of a recipe form goes through Megatron's parser and
    validation and the plugin's refusal (what compare_dispatchers.py checks before training)."""
    from moeblaze_megatron.training.train_loop import megatron_argv_problem

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # a Hopper card
    form = TE[variant]
    base = [*families.family_args("deepseek_v3"), "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "2", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--bf16"]
    stock = [*base, "--moe-token-dispatcher-type", "alltoall", *form.stock_args, *form.shared_args]
    moeblaze = [*base, "--moe-token-dispatcher-type", "moeblaze", *form.shared_args, *form.candidate_args]
    for argv in (stock, moeblaze):
        assert megatron_argv_problem(argv) is None, argv
