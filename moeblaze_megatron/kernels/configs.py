"""Tile configs of the expert GEMMs, their pruning, and what the hardware and a tensor can take.

The config lists are the measured winners (benchmarks/notes/kernels.md and
benchmarks/notes/weight-gradients.md give the measurement behind each choice); under the interpreter
one small tile, with ``MOEBLAZE_AUTOTUNE=0`` one general tile per kernel. ``SETTINGS`` is read when
the lists are built (at import) and when they are pruned (each new shape).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .settings import SETTINGS
from .calls import gpu_of
from .launch import box_hook

EPI_STORE, EPI_ACT_FWD, EPI_ACT_BWD = 0, 1, 2
# The fused epilogues by the names MOEBLAZE_WARP_SPECIALIZE takes (settings.WARP_SPECIALIZE_CHOICES).
WS_EPILOGUES = {EPI_ACT_FWD: "fwd", EPI_ACT_BWD: "bwd"}
ACT_SWIGLU, ACT_SILU, ACT_GELU = 0, 1, 2
ACTIVATION_IDS = {"swiglu": ACT_SWIGLU, "silu": ACT_SILU, "gelu": ACT_GELU}

# The activation backward writes one router-gradient partial per DS_COLS columns, summed
# afterwards: its rounding depends on the tile width, so the Triton kernel runs this one width
# (bitwise the same run to run, whatever the autotuner's noise), two partials per tile.
ACT_BWD_BLOCK_N = 256
# The partials' column span: the warp-specialized dH's tile width, half the Triton kernel's, so
# ds_partial has one layout whichever kernel writes it.
DS_COLS = 128

# Ragged TMA descriptors for A and C of a plain GEMM in expert order are faster on the GPU but cost
# the host tens of microseconds a launch: below this many FLOPs (~0.2 ms of GPU, where the host-bound
# small shapes begin) a GEMM keeps its pointers. 2**37 takes in the 7B-like fc2
# (benchmarks/notes/kernels.md, "TMA_ROWS_MIN_FLOPS: ragged TMA rows from 2^37 FLOPs a launch").
TMA_ROWS_MIN_FLOPS = 2**37


@box_hook
def set_gather_gemm_boxes(nargs):
    """Config pre-hook: each descriptor's box is the config's tile of its operand: the weight's
    (each half's, for a weight in two tensors), and, for rows in expert order (ragged, led by
    [1, 1]), A's [BLOCK_M, BLOCK_K] and C's [BLOCK_M, BLOCK_N]."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    for name in ("b_ptr", "b2_ptr"):  # b2: the up half of a weight in two tensors (or b itself)
        b = nargs.get(name)
        if isinstance(b, TensorDescriptor):
            b.block_shape = [1, 2, bn, bk] if len(b.shape) == 4 else [1, bn, bk] if nargs["TRANS_B"] else [1, bk, bn]
    if isinstance(nargs["a_ptr"], TensorDescriptor):
        nargs["a_ptr"].block_shape = [1, 1, bm, bk]
        nargs["c_ptr"].block_shape = [1, 1, bm, bn]


def gather_gemm_configs():
    """The gather GEMM's configs, each sizing its TMA boxes through ``set_gather_gemm_boxes``."""
    configs = _gather_gemm_tiles()
    for config in configs:
        config.pre_hook = set_gather_gemm_boxes
    return configs


def _gather_gemm_tiles():
    if SETTINGS.interpret:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, num_warps=4)]
    if not SETTINGS.autotune:
        # BLOCK_K 32: four stages fit shared memory in float32 too. The first serves every
        # epilogue but the SwiGLU forward, which takes the second (see prune_gather_gemm).
        return [
            triton.Config({"BLOCK_M": 128, "BLOCK_N": n, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=4)
            for n in (ACT_BWD_BLOCK_N, 128)
        ]
    # Persistent programs (one per multiprocessor, looping over tiles) let the next tile's loads
    # start during this one's epilogue. The first config is the activation backward's only one.
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8, "PERSISTENT": persistent},
                      num_warps=w, num_stages=s)
        for bm, bn, w, s, persistent in (
            (128, 256, 8, 4, False),
            (128, 256, 8, 4, True),
            (128, 256, 8, 3, True),
            (128, 128, 8, 4, True),
            (128, 128, 8, 3, True),
            (128, 128, 8, 4, False),
            (128, 128, 8, 3, False),
            (128, 64, 8, 4, False),
            (64, 128, 4, 4, False),
        )
    ]


# Narrow tiles (64 rows or 64 columns) are timed only where the experts average fewer rows than
# this: with more, they never won a SwiGLU forward or a plain GEMM on the H200, and every config
# timed lengthens a shape's first call by its compiling and timing (benchmarks/notes/kernels.md,
# "NARROW_TILE_ROWS_PER_EXPERT: narrow tiles only where experts average under 128 rows").
NARROW_TILE_ROWS_PER_EXPERT = 128


def few_rows_per_expert(args) -> bool:
    """Whether a launch's experts average fewer than ``NARROW_TILE_ROWS_PER_EXPERT`` rows (its
    rows rounded up to a power of two, as the tuning key holds them); True where the launch's
    arguments are not given, so that nothing is left out unasked."""
    if "rows_bucket" not in args or "E" not in args:
        return True
    return args["rows_bucket"] < NARROW_TILE_ROWS_PER_EXPERT * args["E"]


def _narrow(config) -> bool:
    return min(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]) < 128


def prune_gather_gemm(configs, named_args, **kwargs):
    """The configs worth timing for one launch (Triton passes the constexprs in kwargs)."""
    args = {**named_args, **kwargs}
    if args.get("TMA_ROWS"):
        # C's store buffer does not fit shared memory beside a persistent program's four pipeline
        # stages (sm_90a: 262 KB).
        configs = [c for c in configs if not (c.kwargs.get("PERSISTENT") and c.num_stages >= 4)]
    wide_only = args["EPILOGUE"] in (EPI_STORE, EPI_ACT_FWD) and not few_rows_per_expert(args)
    if args["EPILOGUE"] == EPI_ACT_BWD:
        keep = [c for c in configs if c.kwargs["BLOCK_N"] == ACT_BWD_BLOCK_N and not c.kwargs.get("PERSISTENT")][:1]
    elif args["ACT"] == ACT_SWIGLU and args["EPILOGUE"] == EPI_ACT_FWD:
        # The SwiGLU forward holds the gate and up halves of its tile: it spills past 128 columns.
        keep = [c for c in configs if c.kwargs["BLOCK_N"] <= 128 and not (wide_only and _narrow(c))]
    elif args["EPILOGUE"] == EPI_STORE:
        # 128x128 tiles never won a plain GEMM: timing them only lengthens a shape's first call.
        keep = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) != (128, 128)
                and not (wide_only and _narrow(c))]
        if wide_only and args.get("TMA_ROWS"):
            # Through ragged TMA rows the persistent 128x256 tile won nearly every tuning on record:
            # it runs untimed (benchmarks/notes/kernels.md,
            # "Through ragged TMA rows the persistent 128x256 tile runs untimed").
            keep = [c for c in keep if c.kwargs.get("PERSISTENT")][:1] or keep
    else:
        keep = configs
    if not SETTINGS.autotune:
        keep = keep[:1]
    return keep or configs[-1:]


@box_hook
def set_tma_box(nargs):
    """Config pre-hook: a ragged descriptor's box is the config's tile, [1, 1, BLOCK_K, width]."""
    for name, width in (("a_ptr", "BLOCK_M"), ("b_ptr", "BLOCK_N")):
        if isinstance(nargs[name], TensorDescriptor):
            nargs[name].block_shape = [1, 1, nargs["BLOCK_K"], nargs[width]]


def weight_grad_configs():
    """The weight gradient's configs, each sizing its TMA box through ``set_tma_box``."""
    if SETTINGS.interpret:
        configs = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=4)]
    elif not SETTINGS.autotune:
        configs = [triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=8, num_stages=5)]
    else:
        # The row ids are loaded inside the loop and take pipeline stages of their own: s stages
        # hold ceil(s / 2) buffers of A and B (Triton 3.6). The first tile of each orientation is the
        # TMA operand's winner, listed at each depth worth timing (the same tile gives the same
        # bits at any depth); 256x128x64 is the pointer form's.
        configs = [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in (
                (256, 128, 32, 8, 8),
                (256, 128, 32, 8, 12),
                (128, 256, 64, 8, 5),
                (128, 256, 64, 8, 7),
                (256, 128, 64, 8, 5),
                (128, 256, 32, 8, 8),
                (128, 128, 64, 8, 5),
            )
        ]
    for config in configs:
        config.pre_hook = set_tma_box
    return configs


def prune_weight_grad(configs, named_args, **kwargs):
    """Only tiles long on the operand in expert order: every measured shape ran fastest so, and the
    autotuner's noise cannot then pick the other orientation. The square tile only where the
    experts have few rows (it never won otherwise)."""
    args = {**named_args, **kwargs}
    if args["GATHER_A"] == args["GATHER_B"]:
        return configs
    long_side, short_side = ("BLOCK_N", "BLOCK_M") if args["GATHER_A"] else ("BLOCK_M", "BLOCK_N")
    strict = not few_rows_per_expert(args)
    keep = [c for c in configs if c.kwargs[long_side] > c.kwargs[short_side]
            or (c.kwargs[long_side] == c.kwargs[short_side] and not strict)] or configs
    if strict and args.get("TMA"):
        # With the ordered operand through TMA, the first long tile of the list won every tuning
        # on record; which depth wins depends on the shape, and one tile gives the same bits at any
        # depth (benchmarks/notes/weight-gradients.md,
        # "Weight-gradient depths: 256x128x32 at s8 and s12, 128x256x64 at s5 and s7").
        keep = [c for c in keep if _tile(c) == _tile(keep[0])]
    return keep


def fp8_gemm_configs():
    """The FP8 gather GEMM's configs: 128 columns (one scaling block of the SwiGLU forward's output,
    one scale of a 128x128 weight block per reduction step) and 128 deep (one promotion a step)."""
    if SETTINGS.interpret:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 128, "GROUP_M": 2}, num_warps=4)]
    # Each accumulator takes a second register tile for the block's product before its promotion
    # (two for the SwiGLU forward's gate and up): 64-row tiles over 8 warps are offered for the
    # register pressure that makes (untimed yet: benchmarks/notes/fp8.md).
    tiles = ((128, 8, 3), (128, 8, 4), (64, 8, 3), (64, 4, 4), (64, 4, 3))
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, w, s in tiles[:1 if not SETTINGS.autotune else len(tiles)]]


def prune_fp8_gemm(configs, named_args, **kwargs):
    """One config for the activation backward (it rewrites pre: never timed); all for the others."""
    args = {**named_args, **kwargs}
    return configs[:1] if args["EPILOGUE"] == EPI_ACT_BWD or not SETTINGS.autotune else configs


def fp8_weight_grad_configs():
    """The FP8 weight gradient's configs (128 rows of the reduction a step: one scaling block)."""
    if SETTINGS.interpret:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4)]
    tiles = ((128, 128, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3))
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in tiles[:1 if not SETTINGS.autotune else len(tiles)]]


def _tile(config) -> tuple:
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"], config.num_warps


def config_label(config) -> str:
    """``BLOCK_MxBLOCK_NxBLOCK_K/gGROUP_M/wWARPS/sSTAGES[/p][/rREGS]`` of a tile config (``g-``: no
    grouping, ``/p``: persistent, ``/rREGS``: registers per thread capped)."""
    kw = config.kwargs
    regs = f"/r{config.maxnreg}" if getattr(config, "maxnreg", None) else ""
    return (f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}/g{kw.get('GROUP_M', '-')}"
            f"/w{config.num_warps}/s{config.num_stages}{'/p' if kw.get('PERSISTENT') else ''}{regs}")


@functools.cache
def capability(index):
    return torch.cuda.get_device_capability(index)


@functools.cache
def sm_count(device) -> int:
    """A persistent launch's programs: one per multiprocessor (the interpreter: 4)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def tma_takes(t) -> bool:
    """Whether a TMA descriptor can take ``t``: Hopper or newer (or the interpreter), unit last
    stride, the other strides and the start 16-byte aligned."""
    device = gpu_of(t)
    if device is not None and capability(device.index) < (9, 0):
        return False
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((stride * t.element_size()) % 16 == 0 for stride in t.stride()[:-1]))


def ragged_tma_takes(ordered, rows_total: int) -> bool:
    """Whether a ragged TMA descriptor can take ``ordered``: as ``tma_takes``, and at most 2**30
    rows (the ragged descriptor's row coordinates)."""
    return rows_total <= 2**30 and tma_takes(ordered)


# Descriptor layouts Triton's checks passed (alignment, dtype, shape, strides, box): the checks,
# not the descriptor, are most of its host time, and a weight's layout is the same every step.
_checked_layouts: set = set()


def tma_descriptor(t, box) -> TensorDescriptor:
    """``TensorDescriptor.from_tensor(t, box)``, with Triton's checks run once per layout."""
    shape, strides = t.shape, t.stride()
    layout = (t.data_ptr() % 16, t.dtype, tuple(shape), strides, tuple(box))
    if layout not in _checked_layouts:
        TensorDescriptor.from_tensor(t, list(box))  # raises where Triton would
        _checked_layouts.add(layout)
    desc = object.__new__(TensorDescriptor)  # the other fields keep their class defaults
    desc.base, desc.shape, desc.strides, desc.block_shape = t, shape, strides, list(box)
    return desc
