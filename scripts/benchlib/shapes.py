"""The MoE layer shapes every benchmark names, and one layer's random inputs.

A shape is (T tokens, d hidden, h expert ffn hidden, E experts, K top-k). The ``paper-*`` shapes
are the configurations of the MoEBlaze paper's Table 1 (arXiv 2601.05296) that it publishes
(its conf1, conf3 and conf4; T = batch * seq); the paper does not publish its conf2, conf5, conf6
and conf7, so the ``filled-*`` shapes fill them from its stated ranges (d in {512,1024,2048}, E in
{4,8,16}, k in {1,2,4}, B in {16,32}, L in {512,1024,2048}, h = 4d). Each name says d, E and K;
the paper's names are accepted as aliases (``conf4``).
"""

from __future__ import annotations

import sys

import math

import torch

class _Shapes(dict):
    """The named shapes; ``NAME@rN`` (any name or alias) is NAME's widths with N rows per expert on
    average (T = N * E / K): the rows-per-expert sweeps."""

    def __missing__(self, name):
        base, sep, rows = name.partition("@r")
        if not sep or not rows.isdigit() or config_name(base) not in self:
            raise KeyError(name)
        _, d, h, E, K = self[config_name(base)]
        return (max(1, int(rows) * E // K), d, h, E, K)

    def __contains__(self, name):
        try:
            self[name]
        except KeyError:
            return False
        return True


CONFIGS = _Shapes({
    "paper-d512-e4-k1": (16 * 512, 512, 2048, 4, 1),
    "filled-d512-e8-k2": (16 * 1024, 512, 2048, 8, 2),
    "paper-d1024-e16-k4": (16 * 1024, 1024, 4096, 16, 4),
    "paper-d2048-e16-k4": (32 * 1024, 2048, 8192, 16, 4),
    "filled-d1024-e8-k2": (32 * 1024, 1024, 4096, 8, 2),
    "filled-d2048-e8-k2": (16 * 2048, 2048, 8192, 8, 2),
    "filled-d512-e16-k4": (32 * 2048, 512, 2048, 16, 4),
    "qwen3-30b-like": (32768, 2048, 768, 128, 8),
    "7b-fine-grained": (24576, 1536, 256, 128, 8),
    "dsv3-like": (8192, 7168, 2048, 256, 8),
})
# The MoEBlaze paper's names (Table 1), and short names.
PAPER_NAMES = {"conf1": "paper-d512-e4-k1", "conf2": "filled-d512-e8-k2", "conf3": "paper-d1024-e16-k4",
               "conf4": "paper-d2048-e16-k4", "conf5": "filled-d1024-e8-k2", "conf6": "filled-d2048-e8-k2",
               "conf7": "filled-d512-e16-k4"}
ALIASES = {**PAPER_NAMES, "qwen3": "qwen3-30b-like", "7b": "7b-fine-grained", "dsv3": "dsv3-like"}


def config_name(name: str) -> str:
    """The CONFIGS key a name or alias stands for (unknown names are returned as given); an
    alias keeps its ``@rN`` suffix (``qwen3@r512`` -> ``qwen3-30b-like@r512``)."""
    base, sep, rows = name.partition("@r")
    return ALIASES.get(base, base) + sep + rows


def config_names(comma_list: str) -> list[str]:
    """The CONFIGS keys of a comma list of names and aliases (empty items skipped)."""
    return [config_name(c) for c in comma_list.split(",") if c]


def known_config_names(comma_list: str, prog: str) -> list[str]:
    """``config_names(comma_list)``, or exit naming ``prog`` and the known configs if one is none."""
    configs = config_names(comma_list)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        sys.exit(f"{prog}: unknown configs {unknown}; known: {list(CONFIGS)}")
    return configs


def flops_fwdbwd(T, d, h, K, activation):
    """Forward+backward FLOPs of one layer's expert GEMMs."""
    # fc1 is 2h wide for SwiGLU: 6 GEMM passes of T*K*d*h*2 FLOPs (fwd 2, bwd 4) per projection.
    return (18 if activation == "swiglu" else 12) * T * K * d * h


def floor_bytes(T, d, h, K, activation):
    """The least a layer keeps for backward without recomputing fc1 (bf16): x and the
    pre-activations (two halves for SwiGLU)."""
    return 2 * T * d + (4 if activation == "swiglu" else 2) * T * K * h


def make_inputs(T, d, h, E, K, activation, dtype, device, seed):
    """(x [T, d], top-k ids [T, K], their softmax probabilities, fc1 [E, 2h|h, d], fc2 [E, d, h])
    drawn from ``seed``, scaled so that pre-activations and outputs are O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, d, device=device, dtype=dtype, generator=g)
    logits = torch.randn(T, E, device=device, generator=g)
    top, ids = logits.topk(K, dim=1)
    probs = torch.softmax(top, dim=1)
    rows = 2 * h if activation == "swiglu" else h
    fc1 = (torch.randn(E, rows, d, device=device, generator=g) / math.sqrt(d)).to(dtype)
    fc2 = (torch.randn(E, d, h, device=device, generator=g) / math.sqrt(h)).to(dtype)
    return x, ids, probs, fc1, fc2
