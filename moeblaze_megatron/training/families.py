"""The model families the examples, the comparison and the tests train: Megatron flags only.

Each family's architecture is scaled to fit one GPU (fewer layers, narrower); the examples/*.sh
launch scripts carry exactly these flags (a test checks it).
"""

from __future__ import annotations

import importlib.util
import re
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
    "CPU_TRAINING_STATE_BYTES",
    "StockVariant",
    "cpu_refusal",
    "family_args",
    "family_parameters",
    "fits_cpu",
    "have_apex_fusions",
    "megatron_cpu_families",
    "te_stock_variant",
    "training_state_bytes",
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
    ``shared_args``: flags given to both dispatchers (the router, CUDA graphs, the shared-expert
    overlap, the collector), so that the comparison keeps one model and one recipe;
    ``candidate_args``: flags given to MoEBlaze only, after the shared ones (so they win: a wider
    CUDA graph scope); ``env``: environment variables the form needs while it is built and trained."""

    name: str
    stock_args: tuple[str, ...]
    shared_args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    note: str = ""
    candidate_args: tuple[str, ...] = ()


_GROUPED = ("--moe-grouped-gemm", "--moe-permute-fusion")
_ROUTER_FUSION = ("--moe-router-fusion",)
# Megatron-Core 0.19's MoE README, its CPU-overhead recipe on Hopper: TE's CUDA graphs over the
# attention, the router and the dispatch preprocessing, the shared-expert overlap, the collector
# run by hand. (The overlap flag is inert in a family without a shared expert.)
_RECIPE = (*_ROUTER_FUSION, "--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "moe_router",
           "moe_preprocess", "--moe-shared-expert-overlap", "--manual-gc")

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
    StockVariant("te_recipe", _GROUPED, _RECIPE,
                 note="as te, with Megatron's MoE performance recipe for both: CUDA graphs over attn moe_router "
                      "moe_preprocess, the shared-expert overlap (where there is a shared expert), --manual-gc"),
    StockVariant("te_recipe_moe_graph", _GROUPED, _RECIPE, candidate_args=("--cuda-graph-modules", "attn", "moe"),
                 note="as te_recipe; MoEBlaze's CUDA graphs capture the attention and the whole MoE layer"),
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



# What a family may need to train on the CPU: its fp32 training state (weights, gradients and
# Adam's two moments, TRAINING_STATE_BYTES_PER_PARAMETER bytes a parameter) within this budget,
# a small share of any machine's memory. The CPU demo (tiny) needs a few MB; the GPU families
# need 20-40 GB, and a CPU that tries them runs out of memory.
CPU_TRAINING_STATE_BYTES = 2**30
TRAINING_STATE_BYTES_PER_PARAMETER = 16


def _flag_value(argv: list[str], flag: str, default: str | None = None) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else default


def _moe_layers(pattern: str, layers: int) -> int:
    """How many of ``layers`` are MoE layers under ``--moe-layer-freq``: an int k (every k-th
    layer), or a per-layer pattern of 0s and 1s written as Megatron reads it, ``([0]*1+[1]*3)``."""
    if pattern.isdigit():
        return sum(1 for i in range(layers) if i % int(pattern) == 0)
    runs = re.findall(r"\[([01])\]\*(\d+)", pattern)
    if not runs or sum(int(n) for _, n in runs) != layers:
        raise ValueError(f"--moe-layer-freq {pattern!r}: expected an int or ([0]*a+[1]*b...) over {layers} layers")
    return sum(int(n) for flag, n in runs if flag == "1")


def family_parameters(family: str) -> int:
    """The parameter count of a family, from its flags: embeddings and output layer (the padded
    vocabulary), attention, dense MLPs and MoE layers (routed experts, shared expert, router);
    norms left out."""
    argv = family_args(family)
    number = lambda flag, default=None: int(_flag_value(argv, flag, default))  # noqa: E731
    layers, d, heads = number("--num-layers"), number("--hidden-size"), number("--num-attention-heads")
    head_dim = number("--kv-channels", str(d // heads))
    groups = number("--num-query-groups") if "--group-query-attention" in argv else heads
    matrices = 3 if "--swiglu" in argv else 2  # gate, up, down (SwiGLU) or up, down
    attention = 2 * d * heads * head_dim + 2 * d * groups * head_dim  # q and out, k and v
    dense = matrices * d * number("--ffn-hidden-size")
    experts = number("--num-experts")
    moe = (experts * matrices * d * number("--moe-ffn-hidden-size") + d * experts
           + matrices * d * number("--moe-shared-expert-intermediate-size", "0"))
    moe_layers = _moe_layers(_flag_value(argv, "--moe-layer-freq", "1"), layers)
    outputs = 2 if "--untie-embeddings-and-output-weights" in argv else 1
    # Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by (128).
    divisor = number("--make-vocab-size-divisible-by", "128")
    vocab = -(-number("--vocab-size") // divisor) * divisor
    return outputs * vocab * d + layers * attention + moe_layers * moe + (layers - moe_layers) * dense


def training_state_bytes(parameters: int) -> int:
    """Bytes of fp32 training state (weights, gradients, Adam's moments) of ``parameters``."""
    return parameters * TRAINING_STATE_BYTES_PER_PARAMETER


def fits_cpu(parameters: int) -> bool:
    """Whether a model of ``parameters`` trains within the CPU budget."""
    return training_state_bytes(parameters) <= CPU_TRAINING_STATE_BYTES


def cpu_refusal(flag: str, family: str, parameters: int, cpu_families) -> str | None:
    """Why ``family`` (``parameters`` of them) cannot train on the CPU, as one line naming
    ``flag`` and the families that can (``cpu_families``); None where it fits the CPU budget."""
    if fits_cpu(parameters):
        return None
    state = training_state_bytes(parameters)
    return (f"{flag} {family} does not run on the CPU: {parameters / 1e9:.2f} billion parameters, "
            f"{state / 2**30:.0f} GiB of fp32 training state (the CPU takes up to "
            f"{CPU_TRAINING_STATE_BYTES / 2**30:g} GiB); on the CPU use {flag} {' or '.join(cpu_families)}, "
            f"or run {flag} {family} on a GPU")


def megatron_cpu_families() -> list[str]:
    """The Megatron families that fit the CPU budget."""
    return [f for f in MODEL_FAMILIES if fits_cpu(family_parameters(f))]
