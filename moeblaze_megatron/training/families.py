"""The model families the examples, the comparison and the tests train: Megatron flags only.

Each family's architecture is scaled to fit one GPU (fewer layers, narrower); the examples/*.sh
launch scripts carry exactly these flags (a test checks it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from .corpus import TOKENIZER_ARGS

__all__ = [
    "COMMON_MODEL_ARGS",
    "LOCAL_IMPL_ARGS",
    "MODEL_FAMILIES",
    "NO_APEX_ARGS",
    "NO_TE_ARGS",
    "TE_STOCK_ARGS",
    "TE_STOCK_VARIANTS",
    "StockVariant",
    "family_args",
    "have_apex_fusions",
    "te_stock_variant",
]

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

# Without Transformer Engine Megatron has only its local layers, and its fused RoPE is TE's.
LOCAL_IMPL_ARGS: tuple[str, ...] = ("--transformer-impl", "local", "--no-rope-fusion")

# Megatron's defaults that need Apex's fused CUDA extensions (fused_weight_gradient_mlp_cuda, the
# fused layer norm and softmax kernels): without Apex they must be off, with or without TE.
NO_APEX_ARGS: tuple[str, ...] = (
    "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
)

# Neither Transformer Engine nor Apex.
NO_TE_ARGS: tuple[str, ...] = (*LOCAL_IMPL_ARGS, *NO_APEX_ARGS)

# The module Megatron's gradient-accumulation fusion imports; Apex builds it with the other fused
# kernels the NO_APEX_ARGS turn off (examples/common.sh probes the same name).
APEX_PROBE_MODULE = "fused_weight_gradient_mlp_cuda"


def have_apex_fusions() -> bool:
    """Whether Apex's fused CUDA extensions are importable (found, not imported: no torch needed)."""
    return importlib.util.find_spec(APEX_PROBE_MODULE) is not None


@dataclass(frozen=True)
class StockVariant:
    """One form of Megatron's stock MoE with Transformer Engine (alltoall dispatcher at EP = 1).

    ``stock_args``: flags of the stock dispatch and experts only (MoEBlaze refuses or ignores them);
    ``shared_args``: model flags outside the dispatcher and experts (the router), given to both
    dispatchers so that the comparison keeps one model; ``env``: environment variables the form
    needs while it is built and trained."""

    name: str
    stock_args: tuple[str, ...]
    shared_args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    note: str = ""


_GROUPED = ("--moe-grouped-gemm", "--moe-permute-fusion")
_ROUTER_FUSION = ("--moe-router-fusion",)

# The speed options Megatron-Core 0.19 offers its stock MoE on one GPU with Transformer Engine:
# TEGroupedMLP (--moe-grouped-gemm), the fused permutation, the fused router (top-k, scores and
# aux loss in one TE kernel), TE's operation fuser for the grouped MLP, and overlapping the shared
# expert with the dispatch. compare_dispatchers.py --stock-variants times some and keeps the fastest.
TE_STOCK_VARIANTS: dict[str, StockVariant] = {v.name: v for v in (
    StockVariant("te", _GROUPED, _ROUTER_FUSION, note="grouped GEMM, fused permutation, fused router"),
    StockVariant("te_unfused_router", _GROUPED, (), note="grouped GEMM, fused permutation, Megatron's router"),
    StockVariant("te_op_fuser", (*_GROUPED, "--use-transformer-engine-op-fuser"), _ROUTER_FUSION,
                 env={"NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"},
                 note="as te, the grouped MLP through TE's operation fuser (Megatron asserts support)"),
    StockVariant("te_shared_overlap", (*_GROUPED, "--moe-shared-expert-overlap"), _ROUTER_FUSION,
                 note="as te, the shared expert overlapped with the dispatch (families with one)"),
)}

# What examples/common.sh adds for the stock dispatchers with TE (STOCK=te, the default there).
TE_STOCK_ARGS: tuple[str, ...] = (*TE_STOCK_VARIANTS["te"].stock_args, *TE_STOCK_VARIANTS["te"].shared_args)


def te_stock_variant(name: str) -> StockVariant:
    """The StockVariant called ``name``; ValueError naming the known ones otherwise."""
    if name not in TE_STOCK_VARIANTS:
        raise ValueError(f"stock variant must be one of {sorted(TE_STOCK_VARIANTS)}, got {name!r}")
    return TE_STOCK_VARIANTS[name]


def family_args(family: str) -> list[str]:
    """The Megatron flags of a model family (architecture only)."""
    if family not in MODEL_FAMILIES:
        raise ValueError(f"family must be one of {sorted(MODEL_FAMILIES)}, got {family!r}")
    return [*MODEL_FAMILIES[family], *COMMON_MODEL_ARGS]

