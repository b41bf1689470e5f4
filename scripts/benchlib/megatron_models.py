"""A Megatron world in this process (or one rank of a torchrun job) with the plugin installed, and
the models the checks build from Megatron's own specs: a TransformerConfig with the checks'
defaults, the MoE layer of the local layer spec, a GPTModel of the local decoder block spec (SDPA
attention), and a random batch for it."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

import moeblaze_megatron


@contextlib.contextmanager
def megatron_world(device: torch.device, rank: int = 0, world_size: int = 1, expert_model_parallel_size: int = 1):
    """A Megatron world of ``world_size`` processes, this one ``rank`` (NCCL on CUDA; gloo and the
    CPU redirects on the CPU), Megatron's parallel state with that expert parallelism, the
    plugin installed."""
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    if device.type == "cpu":
        from moeblaze_megatron.training.cpu_shims import enable_cpu_megatron

        context = enable_cpu_megatron()
    else:
        torch.cuda.set_device(device)
        context = contextlib.nullcontext()
    with context:
        torch.distributed.init_process_group("gloo" if device.type == "cpu" else "nccl", rank=rank,
                                             world_size=world_size)
        parallel_state.initialize_model_parallel(expert_model_parallel_size=expert_model_parallel_size)
        moeblaze_megatron.install()
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


def seed(value: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(value)
    model_parallel_cuda_manual_seed(value)


def transformer_config(dispatcher, dtype, device, **fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    defaults = dict(
        num_layers=1, num_attention_heads=8, ffn_hidden_size=4 * fields.get("hidden_size", 1024),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, moe_router_dtype="fp32",
        use_cpu_initialization=device == "cpu", init_method_std=0.02,
    )
    defaults.update(fields)
    return TransformerConfig(**defaults)


def build_layer(config, device, pg_collection=None):
    """The MoE layer of Megatron's local layer spec (the plugin swaps in MoEBlaze's pieces)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts)
    kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
    return spec.submodules.mlp(config=config, **kwargs).to(device=device, dtype=config.params_dtype)


def build_gpt(config, device, vocab, seq):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from moeblaze_megatron.training.attention import SDPAttention, with_core_attention

    spec = with_core_attention(get_gpt_decoder_block_spec(config, use_transformer_engine=False), SDPAttention)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab,
                     max_sequence_length=seq, position_embedding_type="rope")
    return model.to(device=device, dtype=config.params_dtype)


def gpt_config(dispatcher, dtype, device, gpt):
    fields = {k: v for k, v in gpt.items() if k not in ("vocab", "seq", "batch")}
    return transformer_config(dispatcher, dtype, device, **fields)


def gpt_batch(gpt, device, seed_value):
    generator = torch.Generator(device=device).manual_seed(seed_value)
    tokens = torch.randint(0, gpt["vocab"], (gpt["batch"], gpt["seq"]), device=device, generator=generator)
    positions = torch.arange(gpt["seq"], device=device)[None].expand(gpt["batch"], -1)
    return tokens, positions
