"""The kernels' environment settings, read once when the kernels are imported.

``MOEBLAZE_AUTOTUNE=0``: every GEMM runs one general tile config instead of timing the list on
the first call of each shape (seconds per shape; the tuned configs are up to ~1.5x faster).
``MOEBLAZE_DIRECT_LAUNCH=0``: every launch goes through Triton's own launch path (the same
kernels and results, more host time per launch; see launch.py).
``MOEBLAZE_COMPILE_WORKERS=N``: worker processes that compile kernels side by side (a layer's
whole set at its first call, an autotuned launch's configs before they are timed; see
compile_workers.py). Default: this rank's share of the CPUs (the CPU count over torchrun's
LOCAL_WORLD_SIZE), at most 8; 0 compiles everything in the process, one kernel after another, as
Triton does. (It replaced ``MOEBLAZE_COMPILE_THREADS``, which is refused with a pointer here.)
``MOEBLAZE_WARP_SPECIALIZE``: which fused-epilogue GEMMs run, on Hopper, in ``gather_gemm_ws.py``'s
Gluon kernel, whose epilogue runs in warps of its own beside the next tile's main loop, instead
of the Triton kernel, whose epilogue runs in the warps that multiplied the tile (the same results
but the router-gradient partials' last bits): ``fwd`` (the default: fc1 with the activation, the
faster there on an H100), ``1`` (fc1 and dH with the activation
backward), ``bwd`` (dH only) or ``0`` (neither), each where the layer is wide enough
(``gather_gemm.WS_MIN_COLUMNS``); the measurements: benchmarks/notes/kernels.md,
"WS_MIN_COLUMNS: the warp-specialized fc1 from 1024 columns" and
"The warp-specialized dH stays off by default".
``TRITON_INTERPRET=1``: Triton runs the kernels on CPU tensors in its interpreter (how CI tests
them); Triton itself reads it when a kernel is decorated, so it must be set before the import.

``SETTINGS`` holds the values; a benchmark or a test that wants another setting for a while sets
its attribute (``SETTINGS.direct_launch = False``), never the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["SETTINGS", "Settings", "read_settings"]


def default_compile_workers(environ: Mapping[str, str] = os.environ) -> int:
    local_ranks = environ.get("LOCAL_WORLD_SIZE", "1")
    local_ranks = int(local_ranks) if local_ranks.isdigit() and int(local_ranks) > 0 else 1
    return max(1, min(8, (os.cpu_count() or 1) // local_ranks))


@dataclass
class Settings:
    autotune: bool = True
    direct_launch: bool = True
    interpret: bool = False
    # The fused epilogues (WS_EPILOGUES' names) that run in the warp-specialized kernel where it can.
    warp_specialize: frozenset = frozenset({"fwd"})
    compile_workers: int = field(default_factory=default_compile_workers)


def _flag(environ: Mapping[str, str], name: str, default: str) -> bool:
    value = environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


# MOEBLAZE_WARP_SPECIALIZE's values: the fused epilogues each one puts in the Gluon kernel.
WARP_SPECIALIZE_CHOICES = {"0": frozenset(), "fwd": frozenset({"fwd"}), "bwd": frozenset({"bwd"}),
                           "1": frozenset({"fwd", "bwd"})}


def _choice(environ: Mapping[str, str], name: str, choices: Mapping[str, object], default: str):
    value = environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return choices[value]


def _count(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name)
    if value is None:
        return default
    if not value.isdigit():
        raise ValueError(f"{name} must be a whole number (0 or more), got {value!r}")
    return int(value)


def read_settings(environ: Mapping[str, str]) -> Settings:
    """The settings an environment gives; a ValueError naming a variable set to something it cannot take."""
    if "MOEBLAZE_COMPILE_THREADS" in environ:
        raise ValueError("MOEBLAZE_COMPILE_THREADS is gone: compiling side by side now runs in worker processes, "
                         "set MOEBLAZE_COMPILE_WORKERS=N instead (0: compile in the process)")
    return Settings(
        autotune=_flag(environ, "MOEBLAZE_AUTOTUNE", "1"),
        direct_launch=_flag(environ, "MOEBLAZE_DIRECT_LAUNCH", "1"),
        warp_specialize=_choice(environ, "MOEBLAZE_WARP_SPECIALIZE", WARP_SPECIALIZE_CHOICES, "fwd"),
        compile_workers=_count(environ, "MOEBLAZE_COMPILE_WORKERS", default_compile_workers(environ)),
        # Triton's own reading: anything but "1" runs the compiled kernels.
        interpret=environ.get("TRITON_INTERPRET") == "1",
    )


SETTINGS = read_settings(os.environ)
