"""Megatron GPT pretraining pieces shared by ``scripts/pretrain_gpt.py`` and ``train_loop``.

Everything here reads Megatron's parsed arguments (``megatron.training.arguments``) so that the
torchrun entry point and the in-process comparison loop build the same model, attention core and
datasets from the same flags.
"""

from __future__ import annotations

import argparse

import torch

from ..megatron_plugin import moeblaze_extra_args_provider, transformer_config_from_args
from .attention import ATTENTION_CHOICES, SDPAttention, with_core_attention


def add_pretraining_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The entry point's own flag: which attention core the model uses."""
    group = parser.add_argument_group(title="moeblaze pretraining")
    group.add_argument(
        "--moeblaze-attention", choices=ATTENTION_CHOICES, default="auto",
        help="Attention core of every layer. 'sdpa': torch scaled_dot_product_attention (flash "
        "kernels on GPU); 'local': Megatron's DotProductAttention (materializes the score "
        "matrix); 'auto': Transformer Engine's attention when --transformer-impl "
        "transformer_engine and TE is installed, SDPA otherwise.",
    )
    return parser


# Megatron's extra_args_provider for the entry point: the plugin's --moeblaze-* flags (and
# --moe-token-dispatcher-type moeblaze), then the attention flag.
extra_args_provider = moeblaze_extra_args_provider(add_pretraining_args)


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attention(args) -> str:
    """'te', 'sdpa' or 'local': the core that ``--moeblaze-attention`` selects for these args."""
    choice = args.moeblaze_attention
    uses_te_spec = args.transformer_impl == "transformer_engine" and have_transformer_engine()
    if choice == "auto":
        return "te" if uses_te_spec else "sdpa"
    return choice


def check_pretraining_args(args) -> None:
    """Refuse flag combinations the selected attention core cannot honour."""
    if resolve_attention(args) != "sdpa":
        return
    problems = []
    if args.context_parallel_size > 1:
        problems.append("--context-parallel-size > 1 (needs Transformer Engine's attention)")
    if args.reset_attention_mask:
        problems.append("--reset-attention-mask (document masks need an explicit mask; SDPA runs causal)")
    if getattr(args, "sft", False) or getattr(args, "dataloader_inter_document_masking", False):
        problems.append("packed sequences (--sft, --dataloader-inter-document-masking)")
    if args.window_size is not None:
        problems.append("--window-size (sliding-window attention)")
    if problems:
        raise ValueError("--moeblaze-attention sdpa does not support: " + "; ".join(problems)
                         + ". Use --moeblaze-attention local, or Transformer Engine's attention.")


def gpt_layer_spec(args):
    """The ``transformer_layer_spec`` callable for GPTModelConfig: Megatron's default spec for
    these arguments (local or Transformer Engine, dense or MoE) with the selected attention core."""
    from megatron.training.models.gpt import default_layer_spec

    attention = resolve_attention(args)

    def spec(model_config, vp_stage=None):
        base = default_layer_spec(model_config, vp_stage)
        return with_core_attention(base, SDPAttention) if attention == "sdpa" else base

    return spec


def gpt_model_config(args):
    """Megatron's GPTModelConfig for these arguments, with the MoEBlaze options attached to the
    TransformerConfig and the attention core chosen by ``--moeblaze-attention``."""
    from megatron.training.argument_utils import gpt_config_from_args

    check_pretraining_args(args)
    model_config = gpt_config_from_args(args, config=transformer_config_from_args(args))
    if args.spec is None:
        model_config.transformer_layer_spec = gpt_layer_spec(args)
    return model_config


def gpt_dataset_config(args, tokenizer):
    """Megatron's GPTDatasetConfig for --data-path / --split / --mock-data style arguments."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
    )


def build_gpt_datasets(args, tokenizer, train_valid_test_num_samples, is_built_on_rank):
    """(train, valid, test) GPT datasets: MockGPTDataset with --mock-data, GPTDataset otherwise."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_valid_test_num_samples, is_built_on_rank, gpt_dataset_config(args, tokenizer)
    ).build()


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's GPT loss contract: (sum of masked token losses, token count, report).

    The schedule divides by the token count; the report carries [sum, count] so that logging
    reduces it exactly across micro-batches and data-parallel ranks.
    """
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}
