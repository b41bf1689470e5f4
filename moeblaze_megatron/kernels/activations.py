"""The activations and their derivatives, as Triton functions that the gather GEMM's epilogues call
(``gather_gemm_kernel``'s and, unchanged, the Gluon kernel's in ``gather_gemm_ws``, so that the two give
the same bits). ``ACT`` is ``configs.ACT_*``: SiLU (and SwiGLU's gate) or the exact (erf) GELU."""

from __future__ import annotations

import triton
import triton.language as tl

from .numerics import INTERPRETED

__all__ = ["act", "act_bwd", "sigmoid"]

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def sigmoid(g):
    """1 / (1 + 2^(-g log2 e)). On the GPU a flush-to-zero ex2 and an approximate reciprocal (one
    MUFU each, ~2 ulp): tl.exp's and the division's handling of denormal and huge operands, which
    this formula never needs (ex2 -> inf gives 0, ex2 -> 0 gives 1), cost more instructions than
    the rest of the activation backward."""
    x = g * -_LOG2E
    if INTERPRETED:
        return 1.0 / (1.0 + tl.exp2(x))
    else:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _gelu_cdf(g):
    return 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))


@triton.jit
def act(g, ACT: tl.constexpr):
    if ACT == 2:
        return g * _gelu_cdf(g)
    else:
        return g * sigmoid(g)


@triton.jit
def act_bwd(dh, g, up, ACT: tl.constexpr, GLU: tl.constexpr):
    """(h, d g, d up) of h = act(g) * up (GLU) or act(g), given dh = d h; float32 throughout.
    Without GLU, up is ignored and d up is d g (one return shape for both)."""
    if ACT == 2:
        cdf = _gelu_cdf(g)
        a = g * cdf
        a_grad = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:
        sig = sigmoid(g)
        a = g * sig
        # silu' = sig (1 + g (1 - sig)) = sig + silu (1 - sig): one FFMA fewer per element.
        a_grad = sig + a * (1.0 - sig)
    if GLU:
        return a * up, (dh * up) * a_grad, dh * a
    else:
        return a, dh * a_grad, dh * a_grad


# The sigmoid reads INTERPRETED: its cache key computed at import, as numerics' helpers' are.
getattr(sigmoid, "cache_key", None)
