"""The activations and their derivatives, as Triton functions that the row GEMM's epilogues call
(``row_gemm_kernel``'s and, unchanged, the Gluon kernel's in ``row_gemm_ws``). ``ACT`` is
``configs.ACT_*``: SiLU (and SwiGLU's gate) or the exact (erf) GELU."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["act", "act_grad", "silu_parts"]


@triton.jit
def silu_parts(g):
    sig = 1.0 / (1.0 + tl.exp(-g))
    return sig, g * sig


@triton.jit
def act(g, ACT: tl.constexpr):
    if ACT == 2:
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:
        sig, silu = silu_parts(g)
        return silu


@triton.jit
def act_grad(g, ACT: tl.constexpr):
    if ACT == 2:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        return cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:
        sig, silu = silu_parts(g)
        return sig * (1.0 + g * (1.0 - sig))
