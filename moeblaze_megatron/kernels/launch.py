"""Kernel launches with Triton's per-call host work done once per argument signature.

A Triton launch costs the host far more than the GPU needs to start a kernel (benchmarks/notes/
compile-latency.md, "Direct launches: the first launch of a signature through Triton, later ones
direct"). Where the GPU is idle (a layer's first launches, small shapes) the GPU waits on that
host time. ``launch`` runs the first launch of every argument
signature through Triton as usual (autotuning, compiling) and keeps what it resolved: the compiled
kernel, the config and the constexpr values. Later launches with the same signature call the
compiled kernel directly (the grid is evaluated anew each time: it may depend on more than the
arguments).

The signature is everything Triton specializes a compiled kernel on, and more: each tensor's
dtype and 16-byte alignment, each integer by value, each TMA descriptor's dtype, alignment, shape,
strides and box, and the constexprs. Launches take Triton's path under the interpreter, while
Triton launch hooks are set (a profiler's, which the direct call would skip) and with
MOEBLAZE_DIRECT_LAUNCH=0 (``SETTINGS.direct_launch``).

A launcher that benchmarks also run with one fixed config builds a ``KernelCall`` (kernel, grid,
arguments, constexprs) and hands it to ``launch_call``; ``tuning.run_with_config`` runs the same
call with a config of its choosing.

An autotuned launch whose pruning keeps one config (the activation backward always; every launch
under MOEBLAZE_AUTOTUNE=0 or the interpreter) runs that config directly, untimed
(``calls.one_config``). Before this process compiles anything itself, the compile workers get
their turn (``compile_workers.before_compile``); inside ``calls.recording`` launches are
described, not run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.runtime.autotuner import Autotuner
from triton.tools.tensor_descriptor import TensorDescriptor

from . import compile_workers
from .calls import KernelCall, OneConfig, compiles_in_process, one_config, recording_into
from .settings import SETTINGS

__all__ = ["KernelCall", "box_hook", "cdiv", "launch", "launch_call", "next_pow2", "spans_past_int32"]

# Signatures past this count start a fresh cache (shapes that change every step, as token counts
# under expert parallelism can, would otherwise grow it without bound).
MAX_ENTRIES = 4096

_entries: dict = {}


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a constexpr function: microseconds a call)."""
    return -(-a // b)


def spans_past_int32(*tensors) -> bool:
    """Whether an element offset from some tensor's start to its last element reaches 2**31:
    a kernel addressing them must then compute offsets in 64 bits."""
    return any(sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) >= 2**31
               for t in tensors if t.numel())


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), on the host."""
    return 1 << max(int(n) - 1, 0).bit_length()


def _signature(args) -> tuple:
    """``_arg_key`` of every argument, the common types inline (a launch has up to ~25)."""
    # Read here, not at import: the compile workers import this module with torch stubbed out.
    tensor, parameter = torch.Tensor, torch.nn.Parameter
    return tuple([(a.dtype, not a.data_ptr() & 15) if type(a) is tensor or type(a) is parameter
                  else a if type(a) is int else _arg_key(a) for a in args])


def _arg_key(arg):
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, TensorDescriptor):
        return (arg.base.dtype, arg.base.data_ptr() % 16 == 0, tuple(arg.shape), tuple(arg.strides),
                tuple(arg.block_shape), arg.padding)
    if hasattr(arg, "layout") and hasattr(arg, "block_shape"):
        # A Gluon descriptor: its shared-memory layout is part of the compiled kernel too.
        return (arg.base.dtype, arg.base.data_ptr() % 16 == 0, tuple(arg.shape), tuple(arg.strides),
                tuple(arg.block_shape), arg.padding, repr(arg.layout))
    return type(arg), arg


def _hooks_set() -> bool:
    runtime = triton.knobs.runtime
    return _hook_on(runtime.launch_enter_hook) or _hook_on(runtime.launch_exit_hook)


def _hook_on(hook) -> bool:
    # Triton 3.6 on: a HookChain, set when it holds calls; before, a callable or None.
    return hook is not None and bool(getattr(hook, "calls", True))


def box_hook(fn):
    """Marks a config pre-hook that only sizes TMA boxes (``block_shape``): the compiled kernel
    holds its boxes, so a direct call, which compiles nothing, skips it."""
    fn.only_sizes_boxes = True
    return fn


# Filled TMA descriptors kept per launch position (Triton 3.6's own expansion fills one per
# launch): a weight's is the same every step. A fill is a pure function of what keys it.
MAX_FILLED = 64


class _RawLaunch(NamedTuple):
    """What Triton 3.6's CUDA launcher does in Python around its C launch, done here with less
    host time: the C launch, the cooperative and PDL flags, and per TMA descriptor parameter its
    index, its compiled metadata and the descriptors filled for it (``_filled``)."""

    launch: object
    cooperative: object
    pdl: object
    descriptors: tuple


def _raw_launch(launcher) -> _RawLaunch | None:
    """``launcher``'s (a compiled kernel's ``run``) C launch and descriptor expansion where it is
    Triton 3.6's CUDA launcher (backends/nvidia/driver.py: ``__call__(gridX, gridY, gridZ,
    stream, function, *args)`` over ``launch``, the C function or its ``inner`` descriptor
    wrapper) with no scratch memory and one CTA per program; None otherwise, and the launcher
    then runs as it is (other Triton versions, other kernels)."""
    call = getattr(type(launcher), "__call__", None)
    inner = getattr(launcher, "launch", None)
    if (getattr(call, "__code__", None) is None or call.__code__.co_argcount != 6 or inner is None
            or getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1)
            or getattr(launcher, "num_ctas", 2) != 1):
        return None
    flags = launcher.launch_cooperative_grid, launcher.launch_pdl
    code = getattr(inner, "__code__", None)
    if code is None:  # no descriptor parameters: the C launch itself
        return _RawLaunch(inner, *flags, ()) if type(inner).__name__ == "builtin_function_or_method" else None
    if (inner.__name__ != "inner" or inner.__closure__ is None
            or set(code.co_freevars) != {"launcher", "tensordesc_indices", "tensordesc_meta"}):
        return None
    cells = {name: cell.cell_contents for name, cell in zip(code.co_freevars, inner.__closure__)}
    indices, metas = sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"]
    if len(metas) != len(indices) or any(meta is None for meta in metas):
        return None
    return _RawLaunch(cells["launcher"], *flags, tuple((index, meta, {}) for index, meta in zip(indices, metas)))


def _filled(desc, meta, kept):
    """[TMA map, *shape, *strides] of descriptor ``desc`` as Triton 3.6 passes it, from ``kept``
    where the same descriptor was filled before."""
    key = (desc.base.data_ptr(), *desc.shape, *desc.strides, desc.padding)
    hit = kept.get(key)
    if hit is None:
        from triton.backends.nvidia.driver import make_tensordesc_arg

        if len(kept) >= MAX_FILLED:
            kept.clear()
        hit = kept[key] = tuple(make_tensordesc_arg(desc, meta))
    return hit


class _Entry:
    """One argument signature's compiled kernel, launched without Triton's binding and lookups."""

    __slots__ = ("function", "kwargs", "metadata", "name", "names", "pre_hook", "raw", "run", "tail")

    def __init__(self, kernel, compiled, num_args, constexprs):
        if isinstance(kernel, OneConfig):
            config, fn = kernel.config, kernel.autotuner.fn
        elif isinstance(kernel, Autotuner):
            config, fn = kernel.best_config, kernel.fn
        else:
            config, fn = None, kernel
        self.kwargs = {**constexprs, **(config.all_kwargs() if config is not None else {})}
        self.names = fn.arg_names
        self.name = fn.__name__
        # The compiled launcher takes every parameter in order, constexprs included.
        params = fn.signature.parameters
        self.tail = tuple(self.kwargs[name] if name in self.kwargs else params[name].default
                          for name in self.names[num_args:])
        hook = config.pre_hook if config is not None else None
        self.pre_hook = None if getattr(hook, "only_sizes_boxes", False) else hook
        self.run, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata
        # Gluon kernels (the warp-specialized GEMM, off by default) keep Triton's launcher: the
        # raw launch is checked on the GPU for Triton kernels only (tests/gpu, bitwise).
        self.raw = None if compiles_in_process(fn) else _raw_launch(compiled.run)

    def __call__(self, grid, args, device):
        if self.pre_hook is not None:
            self.pre_hook({**dict(zip(self.names, args)), **self.kwargs})
        # The grid is evaluated every time: it may depend on more than the signature holds. A
        # callable one sees the constexprs and the config's values (not the arguments).
        grid = grid(self.kwargs) if callable(grid) else grid
        grid = (*grid, 1, 1)
        # What Triton's launch takes the stream from (torch.cuda.current_stream() costs more host time).
        stream = torch._C._cuda_getCurrentRawStream(device)
        raw = self.raw
        if raw is None:
            self.run(grid[0], grid[1], grid[2], stream, self.function, self.metadata, None, None, None, *args,
                     *self.tail)
            return
        params = [*args, *self.tail]
        for index, meta, kept in reversed(raw.descriptors):  # from the back: indices stay valid
            params[index:index + 1] = _filled(params[index], meta, kept)
        # Triton's arguments: no scratch, no launch metadata, no hooks (launch() checked).
        raw.launch(grid[0], grid[1], grid[2], stream, self.function, raw.cooperative, raw.pdl, None, None,
                   self.metadata, None, None, None, *params)


def launch_call(call: KernelCall) -> None:
    """``launch`` of a described call."""
    launch(*call)


def launch(kernel, grid, args, constexprs):
    """``kernel[grid](*args, **constexprs)`` for a ``triton.jit`` kernel or a ``triton.autotune``
    of one; ``args`` are the leading parameters, positional; ``constexprs`` by name; ``grid`` a
    tuple or a function of the constexprs and the config's values (``meta["BLOCK_M"]``).
    An autotuned launch whose pruning keeps one config runs that config without the autotuner."""
    recorded = recording_into()
    if recorded is not None:
        recorded.append(KernelCall(kernel, grid, args, constexprs))
        return
    if SETTINGS.interpret or not SETTINGS.direct_launch or _hooks_set():
        _through_triton(*one_config(kernel, args, constexprs), grid, args)
        return
    device = torch.cuda.current_device()
    key = (kernel, device, _signature(args), tuple(constexprs.items()))
    entry = _entries.get(key)
    if entry is not None:
        entry(grid, args, device)
        return
    # The pruning reads the constexprs only (both kernels' rules), so the key decides it too.
    kernel, constexprs = one_config(kernel, args, constexprs)
    compile_workers.before_compile(kernel, first=not _entries)
    compiled = _through_triton(kernel, constexprs, grid, args)
    if len(_entries) >= MAX_ENTRIES:
        _entries.clear()
    _entries[key] = _Entry(kernel, compiled, len(args), constexprs)


def _through_triton(kernel, constexprs, grid, args):
    """The launch through Triton's own path; returns the compiled kernel.

    An autotuner keeps the call's arguments (``nargs``) until the launch returns: a launch that
    raises (out of memory while tuning) would keep them, and every tensor of the call, alive
    until its next launch. Here they are dropped either way."""
    if isinstance(kernel, OneConfig):
        autotuner, config = kernel.autotuner, kernel.config
        if config.pre_hook is not None:
            config.pre_hook({**dict(zip(autotuner.arg_names, args)), **constexprs})
        autotuner.best_config = config  # as the autotuner's own launch records it
        return autotuner.fn[grid](*args, **constexprs)
    try:
        if isinstance(kernel, Autotuner):
            compile_workers.compile_ahead(KernelCall(kernel, grid, args, constexprs))
        return kernel[grid](*args, **constexprs)
    finally:
        if isinstance(kernel, Autotuner):
            kernel.nargs = None
