"""Shared helpers for the Megatron-Core tests: a CPU Megatron fixture, config and layer builders,
weight copying between stock and MoEBlaze experts, comparisons, and a multi-process launcher.

Not a conftest.py: a second conftest.py without a package would share the module name
``conftest`` with tests/conftest.py (pytest loads both under that one name). Test modules import
what they need from here, fixtures included, as the other tests import tests/moe_testing.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import moeblaze_megatron
from moe_testing import free_port
from moeblaze_megatron.training.cpu_shims import enable_cpu_megatron

# Relative-error bars against a float64 evaluation of the same model (the "oracle"): fp32 paths
# differ from the oracle only by rounding (~1e-7 per op, well under 1e-5 after a few layers);
# bf16 paths round every intermediate to 8 bits (u = 2**-9 ~ 2e-3), several roundings in sequence
# give a few times u; 8 u catches any routing or indexing mistake (errors of order 1).
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 8 * 2.0**-9}


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.norm().item()
    diff = (got - want).norm().item()
    return diff if scale == 0 else diff / scale


@contextlib.contextmanager
def megatron_on_cpu(rank: int = 0, world_size: int = 1, port: int | None = None, **parallel):
    """Megatron-Core on the CPU with gloo: the CPU redirects, the plugin installed, a process group
    and Megatron's parallel state (``parallel`` goes to ``initialize_model_parallel``)."""
    from megatron.core import parallel_state

    with enable_cpu_megatron():
        moeblaze_megatron.install()
        own_group = not torch.distributed.is_initialized()
        if own_group:
            torch.distributed.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port or free_port()}", rank=rank, world_size=world_size
            )
        parallel_state.initialize_model_parallel(**parallel)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if own_group:
                torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def cpu_megatron():
    """One CPU Megatron world of size 1 for a test module."""
    with megatron_on_cpu():
        yield


def seed_everything(seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Configs and layers

ACTIVATIONS = {
    "swiglu": dict(gated_linear_unit=True, activation_func=F.silu),
    "silu": dict(gated_linear_unit=False, activation_func=F.silu),
    "gelu": dict(gated_linear_unit=False, activation_func=F.gelu),
}


def moe_config(dispatcher: str, activation: str = "swiglu", dtype=torch.float32, **overrides):
    """A small MoE TransformerConfig (CPU initialization, no linear bias)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        moe_ffn_hidden_size=24,
        num_moe_experts=6,
        moe_router_topk=2,
        moe_token_dispatcher_type=dispatcher,
        use_cpu_initialization=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        moe_router_dtype="fp32" if dtype == torch.bfloat16 else None,
        init_method_std=0.05,
        **ACTIVATIONS[activation],
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_moe_layer(config, pg_collection=None):
    """An MoE layer from Megatron's own local layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=False
    )
    kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
    layer = spec.submodules.mlp(config=config, **kwargs)
    return layer.to(config.params_dtype)


def build_gpt(config, vocab_size: int = 64, seq_len: int = 16):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_len,
        position_embedding_type="rope",
    )
    return model.to(config.params_dtype)


def copy_parameters(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Give ``target`` the weights of ``source`` through the state-dict formats (stock and MoEBlaze
    experts read each other's), buffers such as the router's expert bias included."""
    target.load_state_dict(source.state_dict(), strict=True)


# ---------------------------------------------------------------------------------------------
# Multi-process runs



