"""Megatron-LM's own entry point: ``python -m moeblaze_megatron.training.run pretrain_gpt.py ...`` or
``install()`` at the script's top. The stand-in script below makes the calls Megatron-LM's
``pretrain_gpt.py`` and ``gpt_builders.py`` make (``parse_and_validate_args``, then
``core_transformer_config_from_args`` imported by name at module import, the GPT decoder block
spec, ``GPTModel``), on the CPU with gloo, and reports what every MoE layer was given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from moeblaze_megatron.training.families import NO_TE_ARGS

REPO = Path(__file__).resolve().parents[2]

# The calls of Megatron-LM's entry point and its model builder, in their order. Importing
# core_transformer_config_from_args by name at the top is what gpt_builders.py does.
ENTRY = '''
{install}
import json
import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
{late_install}
from moeblaze_megatron.training.cpu_shims import enable_cpu_megatron

with enable_cpu_megatron():
    args = parse_and_validate_args(args_defaults={{"tokenizer_type": "NullTokenizer"}})
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(args.seed)
    config = core_transformer_config_from_args(args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64,
                     max_sequence_length=args.max_position_embeddings)
    tokens = torch.randint(0, 64, (1, args.seq_length))
    positions = torch.arange(args.seq_length)[None]
    causal = torch.ones(1, 1, args.seq_length, args.seq_length, dtype=torch.bool).tril().logical_not()
    loss = model(tokens, positions, causal, labels=tokens).float().mean()
    loss.backward()
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    print("REPORT " + json.dumps(dict(
        loss=loss.item(),
        layers=[dict(dispatcher=type(m.token_dispatcher).__name__, experts=type(m.experts).__name__,
                     dispatcher_options=vars(m.token_dispatcher.options), experts_options=vars(m.experts.options))
                for m in layers])))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
'''

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
         "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--swiglu",
         "--train-iters", "1", "--vocab-size", "64", "--moe-token-dispatcher-type", "moeblaze", *NO_TE_ARGS]
FLAGS = ["--moeblaze-recompute", "fc1", "--moeblaze-backend", "reference", "--moeblaze-routing-method", "torch",
         "--moeblaze-ep-mode", "auto", "--moeblaze-ring-mode", "token"]
WANT = dict(recompute="fc1", backend="reference", routing_method="torch", ep_mode="auto", ring_mode="token", fp8=None)


def _run(tmp_path, how: str, argv: list[str]):
    from moe_testing import free_port

    install = "import moeblaze_megatron\nmoeblaze_megatron.install()"
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(ENTRY.format(install=install if how == "top" else "",
                                   late_install=install if how == "after_imports" else "", port=free_port()))
    launcher = ["-m", "moeblaze_megatron.training.run"] if how == "launcher" else []
    command = [sys.executable, *launcher, str(script), *argv]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), CUDA_VISIBLE_DEVICES="")
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _report(done):
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):])


@pytest.mark.parametrize("how", ["launcher", "top", "after_imports"])
def test_every_plugin_flag_reaches_every_moe_layer(tmp_path, how):
    """Through the launcher, or install() at the script's top or after its imports (where
    core_transformer_config_from_args is already bound by name), the flags arrive in every layer."""
    report = _report(_run(tmp_path, how, MODEL + FLAGS))
    assert len(report["layers"]) == 2
    for layer in report["layers"]:
        assert layer["dispatcher"] == "MoEBlazeTokenDispatcher" and layer["experts"] == "MoEBlazeGroupedMLP"
        assert layer["dispatcher_options"] == WANT and layer["experts_options"] == WANT, layer
    assert report["loss"] == report["loss"]  # a number, not NaN


def test_refused_options_are_refused_in_one_line(tmp_path):
    done = _run(tmp_path, "launcher", MODEL + ["--moe-expert-capacity-factor", "1.0",
                                               "--moe-pad-expert-input-to-capacity"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert "does not support" in done.stderr and "moe_pad_expert_input_to_capacity" in done.stderr
    assert "Traceback" not in done.stderr and "usage:" not in done.stderr
    done = _run(tmp_path, "launcher", MODEL + ["--moeblaze-recompute", "full"])
    assert done.returncode == 2
    assert "argument --moeblaze-recompute: invalid choice: 'full'" in done.stderr and "Traceback" not in done.stderr


def test_launcher_usage_and_missing_script(capsys):
    from moeblaze_megatron.training import run

    with pytest.raises(SystemExit) as exit_info:
        run.main([])
    assert exit_info.value.code == 2
    assert "usage: python -m moeblaze_megatron.training.run SCRIPT.py" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="SCRIPT 'no_such_pretrain_gpt.py' is not a file"):
        run.main(["no_such_pretrain_gpt.py", "--num-layers", "2"])


def test_install_rebinds_names_imported_before_it():
    """A module that imported core_transformer_config_from_args before install() (as
    gpt_builders.py does) gets the options-attaching builder; uninstall() gives it back."""
    from megatron.training import arguments

    from moeblaze_megatron import megatron_plugin

    megatron_plugin.uninstall()
    original = arguments.core_transformer_config_from_args
    builders = types.ModuleType("stand_in_gpt_builders")
    builders.core_transformer_config_from_args = original
    sys.modules[builders.__name__] = builders
    try:
        megatron_plugin.install()
        assert builders.core_transformer_config_from_args is arguments.core_transformer_config_from_args
        assert builders.core_transformer_config_from_args is not original
        megatron_plugin.uninstall()
        assert builders.core_transformer_config_from_args is original
        assert arguments.core_transformer_config_from_args is original
    finally:
        del sys.modules[builders.__name__]
        megatron_plugin.install()
