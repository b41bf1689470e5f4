"""scripts/pretrain_gpt.py and examples/*.sh on the CPU: everything but Megatron's ``pretrain``
call itself (which needs CUDA): the example command lines parse with Megatron's parser plus the
plugin's flags, switching DISPATCHER changes nothing else, and the entry point's hooks
(benchlib.pretrain_hooks) with the package's model config, dataset provider and forward step train
the tiny model one step with either dispatcher; without a GPU the script says at once what to run
instead; the op demo ends with its verdict."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from benchlib import pretrain_hooks as entry
from moe_testing import rel_error

from moeblaze_megatron import install
from moeblaze_megatron.training.cpu_shims import enable_cpu_megatron
from moeblaze_megatron.training.families import (
    COMMON_MODEL_ARGS,
    LOCAL_IMPL_ARGS,
    MODEL_FAMILIES,
    NO_APEX_ARGS,
    NO_TE_ARGS,
    TE_STOCK_VARIANTS,
    family_args,
)
from moeblaze_megatron.training.pretraining import gpt_model_config
from moeblaze_megatron.training.train_loop import single_process

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = {"mixtral": "mixtral.sh", "deepseek_v3": "deepseek_v3.sh", "qwen3_moe": "qwen3_moe.sh"}


@pytest.fixture(scope="module")
def cpu_world():
    with enable_cpu_megatron(), single_process(torch.device("cpu")):
        yield


def parse(argv):
    """The entry point's parse (Megatron's parse + validate + global variables), quietly."""
    from megatron.training.global_vars import unset_global_variables

    unset_global_variables()
    with contextlib.redirect_stdout(io.StringIO()):
        return entry.parse_args(argv)


def bash_array(text: str, name: str) -> list[str]:
    match = re.search(rf"^\s*{name}=\(\n(.*?)^\s*\)", text, re.S | re.M)
    assert match, f"no {name}=( ... ) array"
    lines = [line.split("#", 1)[0] for line in match.group(1).splitlines()]
    return shlex.split(" ".join(lines))


def dry_run(script: str, **env) -> list[str]:
    """The Megatron arguments an example would launch scripts/pretrain_gpt.py with."""
    result = subprocess.run(
        ["bash", str(REPO / "examples" / script)], capture_output=True, text=True, timeout=60,
        env={**os.environ, "DRY_RUN": "1", "PYTHON": str(Path(os.sys.executable)), **env},
    )
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout)
    return words[words.index(str(REPO / "scripts" / "pretrain_gpt.py")) + 1:]


def fake_python(tmp_path, te: bool, apex: bool) -> str:
    """A python3 for the launchers that answers their Transformer Engine and Apex probes as told
    (exit 0: importable) and runs the real interpreter for everything else."""
    path = tmp_path / f"python-te{int(te)}-apex{int(apex)}"
    path.write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in\n'
        f'  *"import transformer_engine"*) exit {0 if te else 1} ;;\n'
        f"  *fused_weight_gradient_mlp_cuda*) exit {0 if apex else 1} ;;\n"
        "esac\n"
        f'exec {shlex.quote(os.sys.executable)} "$@"\n'
    )
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("family", sorted(EXAMPLES))
def test_example_model_flags_are_the_comparison_families(family):
    """compare_dispatchers.py --family X trains exactly the model examples/X.sh launches."""
    text = (REPO / "examples" / EXAMPLES[family]).read_text()
    assert bash_array(text, "MODEL_ARGS") == list(MODEL_FAMILIES[family])


def test_example_common_flags_match_the_loop():
    common = (REPO / "examples" / "common.sh").read_text()
    assert bash_array(common, "COMMON_MODEL_ARGS") == list(COMMON_MODEL_ARGS)
    assert bash_array(common, "IMPL_ARGS") == list(LOCAL_IMPL_ARGS)
    assert bash_array(common, "NO_APEX_ARGS") == list(NO_APEX_ARGS)
    assert list(NO_TE_ARGS) == [*LOCAL_IMPL_ARGS, *NO_APEX_ARGS]
    te = TE_STOCK_VARIANTS["te"]
    assert bash_array(common, "TE_STOCK_EXPERT_ARGS") == list(te.stock_args)
    assert bash_array(common, "TE_ROUTER_ARGS") == list(te.shared_args)


@pytest.mark.parametrize("te", [False, True], ids=["no_te", "te"])
@pytest.mark.parametrize("apex", [False, True], ids=["no_apex", "apex"])
def test_launcher_flags_follow_transformer_engine_and_apex(tmp_path, te, apex):
    """Local layers without TE; Apex's fusions off wherever Apex is missing, TE or not; with TE the
    stock dispatchers run TEGroupedMLP with the fused permutation and both dispatchers the fused
    router (STOCK=auto), and STOCK=sequential keeps SequentialMLP with TE layers."""
    python = fake_python(tmp_path, te, apex)
    argv = {d: dry_run("qwen3_moe.sh", DISPATCHER=d, DATA="mock", PYTHON=python) for d in ("alltoall", "moeblaze")}
    te_stock = TE_STOCK_VARIANTS["te"]
    for dispatcher, words in argv.items():
        impl = words[words.index("--transformer-impl") + 1]
        assert impl == ("transformer_engine" if te else "local")
        assert ("--no-rope-fusion" in words) == (not te)
        for flag in NO_APEX_ARGS:
            assert (flag in words) == (not apex), (dispatcher, flag)
        for flag in te_stock.stock_args:
            assert (flag in words) == (te and dispatcher == "alltoall"), (dispatcher, flag)
        for flag in te_stock.shared_args:
            assert (flag in words) == te, (dispatcher, flag)
    sequential = dry_run("qwen3_moe.sh", DISPATCHER="alltoall", DATA="mock", PYTHON=python, STOCK="sequential")
    assert not set(sequential) & {*te_stock.stock_args, *te_stock.shared_args}
    assert sequential[sequential.index("--transformer-impl") + 1] == ("transformer_engine" if te else "local")


def test_launcher_refuses_te_stock_without_te(tmp_path):
    for stock, message in (("te", "STOCK=te needs Transformer Engine"), ("grouped", "STOCK must be auto, te or sequential")):
        result = subprocess.run(
            ["bash", str(REPO / "examples" / "qwen3_moe.sh")], capture_output=True, text=True, timeout=60,
            env={**os.environ, "DRY_RUN": "1", "DATA": "mock", "STOCK": stock,
                 "PYTHON": fake_python(tmp_path, te=False, apex=False)},
        )
        assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.parametrize("family", sorted(EXAMPLES))
def test_example_commands_parse_and_switch_only_the_dispatcher(family):
    argvs = {d: dry_run(EXAMPLES[family], DISPATCHER=d, DATA="mock") for d in ("moeblaze", "alltoall")}
    differing = [(a, b) for a, b in zip(argvs["moeblaze"], argvs["alltoall"]) if a != b]
    assert differing == [("moeblaze", "alltoall")]
    expected_experts = int(MODEL_FAMILIES[family][MODEL_FAMILIES[family].index("--num-experts") + 1])
    for dispatcher, argv in argvs.items():
        args = parse(argv)
        assert args.moe_token_dispatcher_type == dispatcher
        assert args.num_experts == expected_experts
        assert args.bf16 and args.mock_data and args.transformer_impl == "local"


def test_example_knobs():
    argv = dry_run("mixtral.sh", SEQ_LEN="1024", MICRO_BATCH="3", NPROC="2", TRAIN_ITERS="50",
                   SAVE="/tmp/ckpt", LOAD="/tmp/ckpt", EXTRA_ARGS="--num-layers 2 --moeblaze-recompute fc1")
    args = parse(argv)
    assert (args.seq_length, args.micro_batch_size, args.global_batch_size, args.train_iters) == (1024, 3, 6, 50)
    assert args.save == args.load == "/tmp/ckpt" and args.num_layers == 2 and args.moeblaze_recompute == "fc1"
    assert args.data_path == [str(REPO / "data" / "pystdlib_text_document")]


def test_entry_point_trains_tiny_model_one_step(cpu_world, tmp_path):
    """parse -> GPTModelConfig -> GPTModelBuilder -> dataset provider -> forward_step -> loss, for
    both dispatchers from the same weights: the same loss and the same gradients."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.global_vars import unset_global_variables
    from megatron.training.models.gpt import GPTModelBuilder
    from torch.utils.data import DataLoader

    from moeblaze_megatron.training.corpus import build_byte_dataset, stdlib_source_files

    prefix = tmp_path / "corpus"
    build_byte_dataset(prefix, stdlib_source_files(), max_bytes=200_000)
    install()
    results = {}
    state = None
    for dispatcher in ("allgather", "moeblaze"):
        argv = family_args("tiny") + list(NO_TE_ARGS) + [
            "--moe-token-dispatcher-type", dispatcher, "--seq-length", "32", "--max-position-embeddings", "32",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
            "--data-path", str(prefix), "--split", "90,5,5", "--use-cpu-initialization",
            "--no-create-attention-mask-in-dataloader",
        ]
        args = parse(argv)
        assert args.padded_vocab_size == 384  # 257 padded to a multiple of 128
        model_parallel_cuda_manual_seed(args.seed)
        model = GPTModelBuilder(gpt_model_config(args)).build_model(ProcessGroupCollection.use_mpu_process_groups())
        layer = model.decoder.layers[0]
        assert type(layer.self_attention.core_attention).__name__ == "SDPAttention"
        assert type(layer.mlp.token_dispatcher).__name__ == (
            "MoEBlazeTokenDispatcher" if dispatcher == "moeblaze" else "MoEAllGatherTokenDispatcher")
        if state is None:
            state = model.state_dict()
        model.load_state_dict(state)
        train, valid, test = entry.train_valid_test_datasets_provider([8, 2, 2])
        assert len(train) > 0 and len(valid) > 0
        # Megatron torch.compiles its fused elementwise ops: seconds of C++ compilation on a CPU.
        with torch._dynamo.config.patch(disable=True):
            output, loss_fn = entry.forward_step(iter(DataLoader(train, batch_size=2)), model)
            loss, num_tokens, report = loss_fn(output)
            (loss / num_tokens).backward()
        assert int(num_tokens) == 64 and torch.equal(report["lm loss"], torch.stack([loss.detach(), num_tokens.float()]))
        results[dispatcher] = (loss.item() / 64, {n: p.grad.clone() for n, p in model.named_parameters()})
        unset_global_variables()
    (loss_a, grads_a), (loss_b, grads_b) = results["allgather"], results["moeblaze"]
    assert abs(loss_a - loss_b) <= 1e-5 * abs(loss_a)
    for name, grad in grads_a.items():
        # SequentialMLP's per-expert weights are slices of MoEBlaze's stacked weight1 / weight2.
        expert = re.fullmatch(r"(.*\.experts)\.local_experts\.(\d+)\.linear_fc([12])\.weight", name)
        got = grads_b[f"{expert[1]}.weight{expert[3]}"][int(expert[2])] if expert else grads_b[name]
        assert rel_error(got, grad) < 1e-5, name


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--reset-attention-mask"], "reset-attention-mask"),
        (["--window-size", "8,0"], "window-size"),
    ],
    ids=["reset_attention_mask", "sliding_window"],
)
def test_sdpa_refuses_what_it_cannot_honour(flags, message):
    argv = family_args("tiny") + list(NO_TE_ARGS) + [
        "--moe-token-dispatcher-type", "allgather", "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
        "--moeblaze-attention", "sdpa", *flags,
    ]
    args = parse(argv)
    with pytest.raises(ValueError, match=message):
        gpt_model_config(args)


def test_local_attention_choice_keeps_megatrons_core(cpu_world):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.training.models.gpt import GPTModelBuilder

    argv = family_args("tiny") + list(NO_TE_ARGS) + [
        "--moe-token-dispatcher-type", "allgather", "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
        "--moeblaze-attention", "local", "--use-cpu-initialization",
    ]
    args = parse(argv)
    model_parallel_cuda_manual_seed(1)
    model = GPTModelBuilder(gpt_model_config(args)).build_model(ProcessGroupCollection.use_mpu_process_groups())
    assert all(isinstance(layer.self_attention.core_attention, DotProductAttention) for layer in model.decoder.layers)


def test_entry_point_rejects_unknown_choices():
    argv = family_args("tiny") + ["--moeblaze-attention", "flash"]
    with pytest.raises(SystemExit):
        with contextlib.redirect_stderr(io.StringIO()):
            parse(argv)


def test_prebuilt_dataset_helpers_skip_make(monkeypatch):
    """The wheel has the compiled helpers but no Makefile: Megatron's initialization must not run make."""
    from megatron.core.datasets import utils

    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)
    entry.use_prebuilt_dataset_helpers()
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    utils.compile_helpers()
    assert calls == []


def test_without_a_gpu_the_entry_point_says_what_to_run_instead():
    """No GPU: one message naming the CPU demo and the comparison, before Megatron is imported
    (no argument dump), within seconds, exit status 1."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(REPO / "scripts" / "pretrain_gpt.py"), *family_args("tiny"),
         "--moe-token-dispatcher-type", "moeblaze"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "needs a CUDA GPU" in done.stderr
    assert "python examples/demo_moe_mlp.py" in done.stderr and "python scripts/compare_dispatchers.py" in done.stderr
    assert done.stdout == ""  # Megatron prints its arguments to stdout
    assert not re.search(r"\|\s+megatron\b", done.stderr), "megatron was imported before the refusal"
    assert time.perf_counter() - started < 60


def test_op_demo_ends_with_its_verdict():
    done = subprocess.run([sys.executable, str(REPO / "examples" / "demo_moe_mlp.py")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS: the output and every gradient within the relative tolerance 1.56e-02"), last
    assert len(re.findall(r"relative \d\.\d\de-0[3-9] vs float64", done.stdout)) == 5  # y and four gradients
