"""The model families the examples, the comparison and the tests train: Megatron flags only.

Each family's architecture is scaled to fit one GPU (fewer layers, narrower); the examples/*.sh
launch scripts carry exactly these flags (a test checks it).
"""

from __future__ import annotations

from .corpus import TOKENIZER_ARGS

__all__ = ["COMMON_MODEL_ARGS", "MODEL_FAMILIES", "NO_TE_ARGS", "family_args"]

# Architecture flags of each model family, scaled to fit one GPU (fewer layers, narrower).
# The examples/*.sh launch scripts carry exactly these flags (a test checks it).
MODEL_FAMILIES: dict[str, tuple[str, ...]] = {
    # A few-minute CPU demo: small enough for 2 cores, big enough that the loss visibly falls.
    "tiny": (
        "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
        "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
    ),
    # Mixtral-8x7B's shape of MoE (8 experts, top-2, expert width 3.5x hidden), 4 layers.
    "mixtral": (
        "--num-layers", "4", "--hidden-size", "2048", "--ffn-hidden-size", "7168",
        "--num-attention-heads", "16", "--group-query-attention", "--num-query-groups", "4",
        "--rotary-base", "1000000",
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "7168",
        "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
    ),
    # DeepSeek-V3's MoE: fine-grained experts (256, top-8), one shared expert, sigmoid router
    # with expert bias (aux-loss-free balancing), group-limited routing, scaled top-k weights, a
    # dense first layer. Attention is GQA here (not MLA). 4 layers at width 2048.
    "deepseek_v3": (
        "--num-layers", "4", "--hidden-size", "2048", "--ffn-hidden-size", "5632",
        "--num-attention-heads", "16", "--group-query-attention", "--num-query-groups", "4",
        "--moe-layer-freq", "([0]*1+[1]*3)",
        "--num-experts", "256", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "512",
        "--moe-shared-expert-intermediate-size", "512",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "1e-3", "--moe-router-topk-scaling-factor", "2.5",
        "--moe-router-num-groups", "8", "--moe-router-group-topk", "4",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
    ),
    # Qwen3-30B-A3B's MoE (128 experts, top-8, expert width 768, QK-norm, 32 heads of 128 over 4
    # KV groups) at its real width 2048, 4 of its 48 layers.
    "qwen3_moe": (
        "--num-layers", "4", "--hidden-size", "2048", "--ffn-hidden-size", "6144",
        "--num-attention-heads", "32", "--kv-channels", "128", "--group-query-attention",
        "--num-query-groups", "4", "--qk-layernorm", "--rotary-base", "1000000",
        "--num-experts", "128", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "768",
        "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3",
    ),
}

# Flags every family shares: a Llama-style block (RMSNorm, SwiGLU, RoPE, no biases), no dropout,
# fp32 routing, the byte-level tokenizer of the built-in corpus.
COMMON_MODEL_ARGS: tuple[str, ...] = (
    "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--moe-router-dtype", "fp32",
    *TOKENIZER_ARGS,
)

# Without Transformer Engine (and Apex) these fused kernels do not exist.
NO_TE_ARGS: tuple[str, ...] = (
    "--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
)


def family_args(family: str) -> list[str]:
    """The Megatron flags of a model family (architecture only)."""
    if family not in MODEL_FAMILIES:
        raise ValueError(f"family must be one of {sorted(MODEL_FAMILIES)}, got {family!r}")
    return [*MODEL_FAMILIES[family], *COMMON_MODEL_ARGS]

