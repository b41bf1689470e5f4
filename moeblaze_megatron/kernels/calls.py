"""A kernel launch described rather than run, and what the launch path and the compile workers
both read from it.

``KernelCall`` is one launch, ``kernel[grid](*args, **constexprs)``. Inside ``recording(device)``
``launch.launch`` appends each call to a list instead of running it: code run there on meta
tensors standing for ``device``'s (``stand_in``; ``gpu_of`` says which GPU a tensor stands for)
lists what it would launch, and the compile workers compile those launches ahead of time.
``one_config`` is the rule both the launch path and the workers apply to an autotuned launch
whose pruning keeps a single config: it runs that config, untimed.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import NamedTuple

import torch
import triton
from triton.runtime.autotuner import Autotuner

__all__ = ["KernelCall", "OneConfig", "compiles_in_process", "gpu_of", "one_config", "recording", "recording_into",
           "stand_in"]


class KernelCall(NamedTuple):
    """One launch, described: ``kernel[grid](*args, **constexprs)``."""

    kernel: object
    grid: object
    args: tuple
    constexprs: dict


class _Recording(NamedTuple):
    calls: list
    device: torch.device


_recording: ContextVar[_Recording | None] = ContextVar("moeblaze_launch_recording", default=None)


@contextlib.contextmanager
def recording(device):
    """Inside the block ``launch`` appends each call to the yielded list instead of running it;
    meta tensors stand for ``device``'s (``gpu_of``)."""
    calls = []
    token = _recording.set(_Recording(calls, torch.device(device)))
    try:
        yield calls
    finally:
        _recording.reset(token)


def recording_into() -> list | None:
    """The list a launch is recorded into (inside ``recording``), or None: launches run."""
    rec = _recording.get()
    return None if rec is None else rec.calls


def stand_in(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s dtype, shape and strides whose address has ``t``'s 16-byte
    alignment (what the kernels specialize on), for code run inside ``recording``."""
    offset = (t.data_ptr() % 16) // t.element_size()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
    return torch.empty(offset + extent, dtype=t.dtype, device="meta").as_strided(t.shape, t.stride(), offset)


def gpu_of(t: torch.Tensor) -> torch.device | None:
    """The GPU a tensor is on, or stands for (a meta tensor inside ``recording``); None for the
    others (CPU tensors, which the interpreter runs)."""
    if t.is_cuda:
        return t.device
    rec = _recording.get()
    return rec.device if rec is not None and t.is_meta and rec.device.type == "cuda" else None


class OneConfig(NamedTuple):
    """An autotuned kernel's one remaining config, launched as its kernel with the config's values:
    Triton 3.6 would time a lone config, and timing an in-place epilogue (the activation backward)
    needs a copy of what it overwrites, as large as the layer's pre-activations."""

    autotuner: Autotuner
    config: triton.Config


def one_config(kernel, args, constexprs):
    """(kernel, constexprs) to launch: an ``Autotuner`` whose pruning keeps a single config
    becomes that config's ``OneConfig`` with the config's values among the constexprs."""
    if not isinstance(kernel, Autotuner) or kernel.early_config_prune is None:
        return kernel, constexprs
    kept = kernel.early_config_prune(kernel.configs, dict(zip(kernel.arg_names, args)), **constexprs)
    if len(kept) != 1:
        return kernel, constexprs
    return OneConfig(kernel, kept[0]), {**constexprs, **kept[0].all_kwargs()}


def compiles_in_process(kernel) -> bool:
    """Gluon kernels compile in the process (one kernel, never tuned): the workers rebuild Triton
    JIT functions only."""
    return type(kernel).__name__ == "GluonJITFunction"
