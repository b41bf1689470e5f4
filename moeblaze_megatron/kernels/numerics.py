"""Numerics shared by the kernels, with the Triton interpreter's two bfloat16 traps mended.

Under TRITON_INTERPRET=1 (how the CPU suite runs the kernels) ``tl.dot`` on bfloat16 operands
returns garbage and a float32 -> bfloat16 cast truncates instead of rounding to nearest even.
``dot`` upcasts the operands and ``to_storage`` rounds by hand there, so the interpreter computes
what the GPU computes; on the GPU both are the plain operations.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_flags(dtype: torch.dtype):
    """(MEND_BF16, PRECISION) constexprs for a kernel whose operands have ``dtype``."""
    mend = interpreting() and dtype == torch.bfloat16
    # float32 operands honour torch's TF32 switch, as torch.matmul does; 16-bit ones ignore it.
    precision = "tf32" if dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return mend, precision


@triton.jit
def dot(a, b, acc, MEND_BF16: tl.constexpr, PRECISION: tl.constexpr):
    if MEND_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def to_storage(x, dtype: tl.constexpr, MEND_BF16: tl.constexpr):
    """float32 -> the storage dtype, rounding to nearest even."""
    if MEND_BF16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)
