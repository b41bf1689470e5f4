"""The hooks Megatron's ``pretrain`` calls to train a GPT model with the plugin installed
(scripts/pretrain_gpt.py): the batch reader, the forward step and its loss, the dataset provider,
and the argument parsing with the plugin's flags.

Megatron-Core's wheel carries ``megatron.training`` but not Megatron-LM's ``pretrain_gpt.py``,
where these hooks live upstream; the model, attention and dataset builders they call are
``moeblaze_megatron.training.pretraining``'s.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from moeblaze_megatron import install
from moeblaze_megatron.training.pretraining import build_gpt_datasets, extra_args_provider, gpt_model_config, loss_func

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator):
    """This rank's micro-batch: read on tensor-parallel rank 0, broadcast to the TP group, split
    along the sequence for context parallelism. Ranks in the middle of a pipeline get None."""
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args

    args = get_args()
    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    if not (first or last):
        return (None,) * len(BATCH_KEYS)
    batch = {}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    if tp_rank == 0:
        sample = next(data_iterator)
        device = torch.cuda.current_device()
        batch = {key: sample[key].to(device, non_blocking=True) if sample.get(key) is not None else None
                 for key in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=first,
        is_pipeline_last_stage=last,
    )
    batch.setdefault("cu_seqlens", None)
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return tuple(batch.get(key) for key in BATCH_KEYS)


def checked_loss_func(loss_mask, output_tensor):
    """The GPT loss, with Megatron's NaN/Inf check when --check-for-nan-in-loss-and-grad is on."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    loss, num_tokens, report = loss_func(loss_mask, output_tensor)
    if get_args().check_for_nan_in_loss_and_grad:
        machine = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                    message=f"found {what} in local forward loss calculation")
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """Megatron's forward_step contract: (output tensor, loss function of it)."""
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(checked_loss_func, loss_mask)


def train_valid_test_datasets_provider(train_valid_test_num_samples, vp_stage=None):
    """GPT datasets from --data-path (or --mock-data), built on the ranks that read data."""
    from megatron.core import mpu
    from megatron.training import get_args, get_tokenizer, print_rank_0

    def is_built_on_rank():
        reads_data = mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage()
        return reads_data and mpu.get_tensor_model_parallel_rank() == 0

    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = build_gpt_datasets(get_args(), get_tokenizer(), train_valid_test_num_samples, is_built_on_rank)
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


# Megatron builds data loaders on every rank that has a dataset, per the provider's flag.
train_valid_test_datasets_provider.is_distributed = True


def use_prebuilt_dataset_helpers() -> None:
    """Megatron's initialization runs ``make`` in megatron/core/datasets to compile its C++ dataset
    helpers; the wheel ships them compiled and without the Makefile, so that ``make`` fails and
    Megatron exits. Skip the compilation when the compiled helpers import."""
    from megatron.core.datasets import utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    utils.compile_helpers = lambda: None


def help_printable(provider):
    """``provider`` (an extra_args_provider), then every help text that argparse cannot expand
    escaped: megatron-core 0.19.2's --moe-paged-stash-buffer-size-factor-cuda help holds a bare
    "10%)", which makes --help fail with a ValueError instead of printing."""

    def provide(parser):
        parser = provider(parser)
        formatter = parser._get_formatter()
        for action in parser._actions:
            try:
                formatter._expand_help(action)
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")
        return parser

    return provide


def parse_args(argv=None):
    """Megatron's parsed and validated arguments, with the plugin's and this script's flags."""
    from megatron.training.arguments import parse_and_validate_args

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    return parse_and_validate_args(extra_args_provider=help_printable(extra_args_provider))


def pretrain_gpt(argv=None) -> None:
    """Megatron's pretrain() of a GPT model on ``argv`` (default: the command line), the plugin
    installed."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    install()
    use_prebuilt_dataset_helpers()
    args = parse_args(argv)
    config = pretrain_cfg_container_from_args(args, gpt_model_config(args))
    pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
