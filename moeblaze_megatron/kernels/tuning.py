"""Tuning and test aids: a launch with one fixed tile config, and the autotuner's picks.

The hot-path launchers (``gather_gemm``, ``weight_grad``) always launch through the autotuner;
``scripts/tune_kernels.py`` and the tests that pin a config (persistent, TMA, tile edges) build
the same ``KernelCall`` and run it here with the config of their choice.
"""

from __future__ import annotations

from .configs import config_label
from .calls import KernelCall
from .launch import launch_call
from .gather_gemm import gather_gemm_call, gather_gemm_kernel
from .weight_grad import weight_grad_call, weight_grad_kernel

__all__ = ["autotune_picks", "gather_gemm_with", "run_with_config", "weight_grad_with"]


def run_with_config(call: KernelCall, config=None) -> None:
    """Launch ``call`` with one ``triton.Config`` (its pre-hook sizing the TMA boxes first), not
    through the autotuner; ``config=None`` launches it as the hot path does."""
    if config is None:
        launch_call(call)
        return
    kernel, grid, args, constexprs = call
    # The launcher sized its TMA boxes for the kernel's first config: the kernel's own pre-hook
    # resizes them to this config's tiles, whether or not the given config carries the hook.
    hook = config.pre_hook or kernel.configs[0].pre_hook
    if hook is not None:
        hook({**dict(zip(kernel.fn.arg_names, args)), **constexprs, **config.all_kwargs()})
    kernel.fn[grid](*args, **constexprs, **config.all_kwargs())


def gather_gemm_with(config, *args, **kwargs) -> None:
    """``gather_gemm(*args, **kwargs)`` with one fixed config of the Triton kernel (``config=None``: as
    the hot path launches it, the warp-specialized kernel included)."""
    if config is not None:
        kwargs = {"warp_specialize": False, **kwargs}
    run_with_config(gather_gemm_call(*args, **kwargs), config)


def weight_grad_with(config, *args, **kwargs) -> None:
    """``weight_grad(*args, **kwargs)`` with one fixed config."""
    run_with_config(weight_grad_call(*args, **kwargs), config)


def autotune_picks() -> dict[str, str]:
    """The config the autotuner chose for every shape key tuned so far in this process, by
    ``kernel(key)``: which tiles a benchmark actually ran."""
    return {f"{kernel.base_fn.__name__}{key}": config_label(config)
            for kernel in (gather_gemm_kernel, weight_grad_kernel) for key, config in kernel.cache.items()}
