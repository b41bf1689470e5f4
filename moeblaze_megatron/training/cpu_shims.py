"""Run Megatron-Core on CPU: a testing and CPU-demo aid, never applied by ``install()``.

Megatron-Core assumes CUDA in a few places that an MoE layer or a small GPTModel touches:

* model code allocates with ``device=torch.cuda.current_device()`` (router buffers, the
  tensor-parallel mappings, ``GlobalMemoryBuffer``) and ``Router.gating`` moves its weight there;
* the alltoall and flex dispatchers create CUDA streams and events;
* the RNG tracker (weight init, dropout forks, activation checkpointing) saves and restores the
  CUDA generator's state.

``enable_cpu_megatron()`` redirects exactly these: ``torch.cuda.current_device()`` answers the CPU
device, streams and events become no-ops that run on the host in program order, and the "CUDA"
generator state is the CPU generator's (on a CPU-only run every random op draws from it, so that
is what Megatron's tracker must save, fork and restore). It patches process-wide state of
``torch.cuda`` and ``megatron.core.tensor_parallel.random``: use it only in processes that run
Megatron on the CPU (tests, the CPU demo), never in a GPU job.

    with enable_cpu_megatron():
        torch.distributed.init_process_group("gloo", ...)
        parallel_state.initialize_model_parallel(...)
        model_parallel_cuda_manual_seed(123)
        ...

It can also be entered once for the whole process (``enable_cpu_megatron().__enter__()``), e.g.
from a pytest fixture or a spawned worker. Entering it again while active is harmless.
"""

from __future__ import annotations

import contextlib
import logging

import torch

__all__ = ["enable_cpu_megatron", "cpu_megatron_enabled"]

_depth = 0


class _HostStream:
    """Stands in for ``torch.cuda.Stream``: host work runs in program order, so every wait is
    already satisfied."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _HostEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _HostEvent:
    """Stands in for ``torch.cuda.Event``."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


_HOST_STREAM = _HostStream()


def _current_device():
    return torch.device("cpu")


def _current_stream(device=None):
    return _HOST_STREAM


def _stream_context(stream):
    return contextlib.nullcontext(stream)


def _get_rng_state(device="cuda", *args, **kwargs):
    return torch.get_rng_state()


def _set_rng_state(new_state, device="cuda", *args, **kwargs):
    torch.set_rng_state(new_state)


def _manual_seed(seed):
    torch.default_generator.manual_seed(seed)


def cpu_megatron_enabled() -> bool:
    """Whether ``enable_cpu_megatron()`` is active in this process."""
    return _depth > 0


@contextlib.contextmanager
def enable_cpu_megatron():
    """Redirect Megatron-Core's CUDA-only calls to the CPU while the context is active."""
    global _depth
    if _depth > 0:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return

    from megatron.core.tensor_parallel import random as mcore_random

    patches = [
        (torch.cuda, "current_device", _current_device),
        (torch.cuda, "Stream", _HostStream),
        (torch.cuda, "Event", _HostEvent),
        (torch.cuda, "current_stream", _current_stream),
        (torch.cuda, "default_stream", _current_stream),
        (torch.cuda, "stream", _stream_context),
        (torch.cuda, "synchronize", lambda device=None: None),
        (torch.cuda, "get_rng_state", _get_rng_state),
        (torch.cuda, "set_rng_state", _set_rng_state),
        (torch.cuda, "manual_seed", _manual_seed),
        (torch.cuda, "manual_seed_all", _manual_seed),
        (mcore_random, "_get_cuda_rng_state", _get_rng_state),
        (mcore_random, "_set_cuda_rng_state", _set_rng_state),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    # The RNG tracker warns when the CPU generator moves inside a "CUDA" fork; on the CPU they are
    # one generator, so the warning would fire on every dropout or init.
    rng_logger = logging.getLogger(mcore_random.__name__)
    saved_level = rng_logger.level
    for owner, name, value in patches:
        setattr(owner, name, value)
    rng_logger.setLevel(logging.ERROR)
    _depth = 1
    try:
        yield
    finally:
        _depth = 0
        rng_logger.setLevel(saved_level)
        for owner, name, value in saved:
            setattr(owner, name, value)
