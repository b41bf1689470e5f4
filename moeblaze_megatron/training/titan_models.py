"""torchtitan 0.3.0 Qwen3-MoE models for the example and the comparison, built by torchtitan's own
Qwen3 builders (``torchtitan.models.qwen3``, pinned 0.3.0: the same blocks, initializers and
sharding configs as its ``30B-A3B`` flavor) and sized by ``TITAN_FAMILIES``.

Vocabulary: the built-in byte corpus (``training.corpus``: bytes 0-255, end of document 256).
Attention: ``flex`` (torchtitan's default for language models: block-causal by document, compiled
with torch.compile) or ``sdpa`` (``ScaledDotProductAttention``, causal over the packed sequence:
no compilation; the CPU tests and, by default, the GPU comparison, where both runs use it alike).

Importing this module imports ``torchtitan.models.qwen3``, whose FSDP helpers import
``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.12): on torch 2.11 the caller installs
a stand-in first (``scripts/benchlib/titan_compare.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.qwen3 import (
    _EMBEDDING_INIT,
    _LINEAR_INIT,
    _build_qwen3_moe_layers,
    _qwen3_norm,
    parallelize_qwen3,
)
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
from torchtitan.protocols.model_spec import ModelSpec

from .corpus import BYTE_VOCAB_SIZE
from .titan_choices import ATTENTIONS

__all__ = ["ATTENTIONS", "TITAN_FAMILIES", "TitanFamily", "prepare_model_config", "titan_model_config",
           "titan_model_spec"]


@dataclass(frozen=True)
class TitanFamily:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    moe_hidden_dim: int
    num_experts: int
    top_k: int
    max_seq_len: int

    def parameters(self) -> int:
        """The parameter count: embeddings and output layer (the byte vocabulary), attention, and
        every layer's routed experts (gate, up, down) and router; norms left out."""
        attention = 2 * self.dim * self.n_heads * self.head_dim + 2 * self.dim * self.n_kv_heads * self.head_dim
        moe = self.num_experts * 3 * self.dim * self.moe_hidden_dim + self.dim * self.num_experts
        return 2 * BYTE_VOCAB_SIZE * self.dim + self.n_layers * (attention + moe)


TITAN_FAMILIES = {
    # Qwen3-30B-A3B's MoE layers (d 2048, 128 experts of 768, top-8, softmax with route_norm, 32
    # heads of 128 over 4 KV groups, QK-norm) in 4 layers: the Megatron comparison's qwen3_moe.
    "qwen3_moe": TitanFamily(n_layers=4, dim=2048, n_heads=32, n_kv_heads=4, head_dim=128, moe_hidden_dim=768,
                             num_experts=128, top_k=8, max_seq_len=32768),
    # The CPU-sized model of the tests and the CPU demo (widths multiples of 8: torch._grouped_mm
    # wants 16-byte strides in bfloat16).
    "tiny": TitanFamily(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, moe_hidden_dim=32,
                        num_experts=8, top_k=2, max_seq_len=1024),
}


def titan_model_config(family: str, attention: str = "flex") -> Qwen3Model.Config:
    """The model config of a family (torchtitan's Qwen3 MoE blocks), vocabulary 257."""
    if family not in TITAN_FAMILIES:
        raise ValueError(f"family must be one of {sorted(TITAN_FAMILIES)}, got {family!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    f = TITAN_FAMILIES[family]
    layers = _build_qwen3_moe_layers(
        n_layers=f.n_layers, dim=f.dim, n_heads=f.n_heads, n_kv_heads=f.n_kv_heads, head_dim=f.head_dim,
        moe_hidden_dim=f.moe_hidden_dim, num_experts=f.num_experts, top_k=f.top_k, attn_backend="flex",
        moe_comm_backend="standard", rope=CosSinRoPE.Config(dim=f.head_dim, max_seq_len=f.max_seq_len,
                                                              theta=1000000.0),
    )
    if attention == "sdpa":
        # torchtitan's builders refuse "sdpa" for language models (no per-document masks); the
        # inner attention is swapped after building, the same in every compared run.
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Qwen3Model.Config(
        vocab_size=BYTE_VOCAB_SIZE,
        dim=f.dim,
        norm=_qwen3_norm(f.dim),
        tok_embeddings=Embedding.Config(num_embeddings=BYTE_VOCAB_SIZE, embedding_dim=f.dim,
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=f.dim, out_features=BYTE_VOCAB_SIZE, param_init=_LINEAR_INIT),
        layers=layers,
    )


def titan_model_spec(family: str, attention: str = "flex") -> ModelSpec:
    """The ModelSpec torchtitan's Trainer takes (the Qwen3 parallelize function, the MoE
    load-balancing hook; no Hugging Face state-dict adapter: the checkpoints are torchtitan's)."""
    return ModelSpec(name="qwen3", flavor=f"moeblaze_{family}", model=titan_model_config(family, attention),
                     parallelize_fn=parallelize_qwen3, pipelining_fn=pipeline_llm,
                     post_optimizer_build_fn=register_moe_load_balancing_hook, state_dict_adapter=None)


def prepare_model_config(model_config: Qwen3Model.Config, *, seq_len: int, expert_parallel: bool = False) -> None:
    """What ``Qwen3Model.Config.update_from_config`` does for a one-process run without the
    Trainer (whose module imports ``datasets``): the RoPE cache sized to ``seq_len`` and the
    sharding configs (no sequence parallelism)."""
    if seq_len > model_config.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's RoPE maximum {model_config.max_seq_len}")
    for layer in model_config.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
    set_qwen3_sharding_config(model_config, enable_sp=False, enable_ep=expert_parallel)
