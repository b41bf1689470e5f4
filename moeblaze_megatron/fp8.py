"""FP8 experts under the blockwise recipe: the formats, the quantization in PyTorch (the
reference's, and the weights' for the kernels), and the expert weights' quantized copies, cached
until the next optimizer step.

The recipe is Transformer Engine's ``Float8BlockScaling`` with its defaults (Megatron's
``--fp8-recipe blockwise``): activations and gradients in 1x128 blocks along the GEMM's reduction
(a row's 128 consecutive values), weights in 128x128 blocks, the weight gradients' operands in
128x1 blocks along the tokens (each expert's rows from its first); power-of-two scales; E4M3
throughout (``"e4m3"``) or E5M2 for the gradients (``"hybrid"``). The layer input and the output
gradient are quantized once, on [tokens, hidden]: the GEMMs gather a token's FP8 row for each of
its experts. The kernels (``kernels/fp8.py``) quantize the same blocks the same way; this module's
functions are their oracle.

SwiGLU's fc1 is quantized as its two halves (gate rows, then up rows), each in 128x128 blocks from
its own first row: the same blocks as one [2F, D] tensor wherever F is a multiple of 128.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .kernels.fp8_formats import FP8_BLOCK, FP8_E4M3, FP8_E5M2, FP8_MAX

__all__ = ["FP8_TORCH_DTYPES", "Fp8ExpertWeights", "Fp8Weight", "dequantize_columns", "dequantize_rows",
           "expert_weights", "format_ids", "quantize_blocks", "quantize_rows"]

FP8_TORCH_DTYPES = {FP8_E4M3: torch.float8_e4m3fn, FP8_E5M2: torch.float8_e5m2}


def format_ids(fp8: str) -> tuple[int, int]:
    """(forward operands' format, gradients' format) of an FP8 format option."""
    return (FP8_E4M3, FP8_E5M2) if fp8 == "hybrid" else (FP8_E4M3, FP8_E4M3)


def block_scales(amax: torch.Tensor, fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inverse scale) per block of absolute maximum ``amax`` (float32): the largest power
    of two with amax * scale <= the format's maximum (exponent clamped to [-126, 126]), 1 for 0."""
    amax = amax.float()
    ratio = FP8_MAX[fmt] / torch.where(amax == 0, 1.0, amax)
    e = (ratio.view(torch.int32) >> 23) & 255
    e = torch.where(amax == 0, 127, e.clamp(1, 253))
    return (e << 23).view(torch.float32), ((254 - e) << 23).view(torch.float32)


def _codes(v: torch.Tensor, scale: torch.Tensor, fmt: int) -> torch.Tensor:
    bound = FP8_MAX[fmt]
    return (v * scale).clamp(-bound, bound).to(FP8_TORCH_DTYPES[fmt]).view(torch.uint8)


def _padded(t: torch.Tensor, dim: int) -> torch.Tensor:
    pad = -t.shape[dim] % FP8_BLOCK
    if not pad:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def quantize_rows(x: torch.Tensor, fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] in 1x128 blocks along its rows: (codes [R, C] uint8, inverse scales [R, cdiv(C, 128)])."""
    rows, cols = x.shape
    v = _padded(x.float(), 1).view(rows, -1, FP8_BLOCK)
    scale, inv = block_scales(v.abs().amax(dim=2), fmt)
    return _codes(v, scale[..., None], fmt).view(rows, -1)[:, :cols], inv


def dequantize_rows(codes: torch.Tensor, inv: torch.Tensor, fmt: int) -> torch.Tensor:
    """``quantize_rows``'s result back to float64 values."""
    values = codes.view(FP8_TORCH_DTYPES[fmt]).double()
    return values * inv.double().repeat_interleave(FP8_BLOCK, dim=1)[:, :codes.shape[1]]


def quantize_blocks(w: torch.Tensor, fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, R, C] in 128x128 blocks: (codes [E, R, C] uint8, inverse scales [E, cdiv(R, 128), cdiv(C, 128)])."""
    experts, rows, cols = w.shape
    v = _padded(_padded(w.float(), 1), 2)
    blocks = v.view(experts, v.shape[1] // FP8_BLOCK, FP8_BLOCK, v.shape[2] // FP8_BLOCK, FP8_BLOCK)
    scale, inv = block_scales(blocks.abs().amax(dim=(2, 4)), fmt)
    codes = _codes(blocks, scale[:, :, None, :, None], fmt).view(v.shape)[:, :rows, :cols]
    return codes.contiguous(), inv


def dequantize_blocks(codes: torch.Tensor, inv: torch.Tensor, fmt: int) -> torch.Tensor:
    """``quantize_blocks``'s result back to float64 values."""
    rows, cols = codes.shape[1:]
    scale = inv.double().repeat_interleave(FP8_BLOCK, dim=1).repeat_interleave(FP8_BLOCK, dim=2)
    return codes.view(FP8_TORCH_DTYPES[fmt]).double() * scale[:, :rows, :cols]


def dequantize_columns(a: torch.Tensor, fmt: int) -> torch.Tensor:
    """a [R, C] quantized in 128x1 blocks down its columns (from row 0) and back, in float64: one
    expert's rows as a weight gradient's operand."""
    rows = a.shape[0]
    v = _padded(a.float(), 0).view(-1, FP8_BLOCK, a.shape[1])
    scale, inv = block_scales(v.abs().amax(dim=1), fmt)
    codes = _codes(v, scale[:, None, :], fmt)
    return (codes.view(FP8_TORCH_DTYPES[fmt]).double() * inv.double()[:, None, :]).view(-1, a.shape[1])[:rows]


@dataclass(frozen=True)
class Fp8Weight:
    """One quantized weight as a GEMM's B operand, K-major: codes [E, N, K] uint8 and inverse
    scales [E, cdiv(N, 128), cdiv(K, 128)] float32."""

    codes: torch.Tensor
    inv_scales: torch.Tensor

    def dequantized(self, fmt: int) -> torch.Tensor:
        return dequantize_blocks(self.codes, self.inv_scales, fmt)

    def transposed(self) -> "Fp8Weight":
        # 128x128 blocks are the same blocks either way round: the transpose is exact.
        return Fp8Weight(self.codes.transpose(1, 2).contiguous(), self.inv_scales.transpose(1, 2).contiguous())

    @property
    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes, self.inv_scales


@dataclass(frozen=True)
class Fp8ExpertWeights:
    """The experts' weights quantized for the six GEMMs: ``fc1`` its halves (gate, up) for SwiGLU
    or itself, [E, F, D] each (fc1's forward), ``fc1_t`` the same transposed, [E, D, F] (dX's),
    ``fc2`` [E, D, F] (fc2's forward), ``fc2_t`` [E, F, D] (dH's); ``fmt`` their format."""

    fc1: tuple[Fp8Weight, ...]
    fc1_t: tuple[Fp8Weight, ...]
    fc2: Fp8Weight
    fc2_t: Fp8Weight
    fmt: int

    @property
    def shape(self):
        """fc2's shape [E, D, F], as the passes read a weight's."""
        return self.fc2.codes.shape


# Advanced by every optimizer step (a hook on torch.optim's steps, installed at the first
# quantization): the cached copies are then stale. A weight changed in place by other means
# changes its version counter, which the cache also keys on.
_generation = [0]
_hook = []


def _advance(*_):
    _generation[0] += 1


def expert_weights(fc1, fc2: torch.Tensor, fmt: int) -> Fp8ExpertWeights:
    """The quantized copies of fc1 ([E, 2F, D] for SwiGLU, [E, F, D] otherwise, or SwiGLU's (gate,
    up) pair) and fc2 [E, D, F], made once per optimizer step: kept on fc2 (an attribute) with the
    step and the tensors' addresses and version counters, and reused by every micro-batch; made
    afresh, uncached, inside a CUDA graph's capture."""
    if not _hook:
        _hook.append(register_optimizer_step_post_hook(_advance))
    # Inside a CUDA graph's capture the quantization is captured too and reruns at every replay:
    # a cached copy would be replayed stale after the optimizer updates the weights in place.
    capturing = fc2.is_cuda and torch.cuda.is_current_stream_capturing()
    halves = tuple(fc1) if isinstance(fc1, tuple) else None
    key = (_generation[0], fmt, *((t.data_ptr(), t._version, tuple(t.shape)) for t in (*(halves or (fc1,)), fc2)))
    cached = getattr(fc2, "_moeblaze_fp8", None)
    if cached is not None and cached[0] == key and not capturing:
        return cached[1]
    with torch.no_grad():
        if halves is None and fc1.shape[1] == 2 * fc2.shape[2]:
            halves = tuple(fc1.detach().chunk(2, dim=1))
        parts = tuple(Fp8Weight(*quantize_blocks(w.detach(), fmt)) for w in (halves or (fc1,)))
        second = Fp8Weight(*quantize_blocks(fc2.detach(), fmt))
        weights = Fp8ExpertWeights(parts, tuple(p.transposed() for p in parts), second, second.transposed(), fmt)
    if not capturing:
        fc2._moeblaze_fp8 = (key, weights)
    return weights
