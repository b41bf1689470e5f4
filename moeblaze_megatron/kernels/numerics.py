"""Numerics shared by the kernels, with the Triton interpreter's traps mended.

Under TRITON_INTERPRET=1 (how the CPU suite runs the kernels) ``tl.dot`` on bfloat16 operands
returns garbage, a float32 -> bfloat16 cast truncates instead of rounding to nearest even, and
``tl.dot`` is numpy's matmul, whose float32 sums (OpenBLAS) follow an order that depends on the
block's shape (numpy 2.5: a [16, 16] @ [16, 32] product's first 16 columns differ in the last bit
from [16, 16] @ [16, 16]'s), where the GPU reduces every tile in the same k order. There ``dot``
forms each block's product in float64 (exact products, an order-free sum to float32 rounding) and
``to_storage`` rounds by hand, so the interpreter's bits do not depend on tile shapes, as the
GPU's do not; on the GPU both are the plain operations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .settings import SETTINGS


def dot_flags(dtype: torch.dtype):
    """(ROUND_BF16_BY_HAND, PRECISION) constexprs for a kernel whose operands have ``dtype``."""
    mend = SETTINGS.interpret and dtype == torch.bfloat16
    # float32 operands honour torch's TF32 switch, as torch.matmul does; 16-bit ones ignore it.
    precision = "tf32" if dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return mend, precision


INTERPRETED = tl.constexpr(SETTINGS.interpret)


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr):
    if INTERPRETED:
        return acc + tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def to_storage(x, dtype: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr):
    """float32 -> the storage dtype, rounding to nearest even."""
    if ROUND_BF16_BY_HAND:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


# Triton 3.6 folds a helper's constexpr globals (INTERPRETED) into a calling kernel's cache key only
# where the helper's own key was computed first (3.8 always does): computed here, at import, so that
# every process, the compile workers too, files a kernel under one key whatever it compiled first.
for _helper in (dot, to_storage):
    getattr(_helper, "cache_key", None)
del _helper
