"""Fixtures for every test, and the interpreter default. The shared helpers are in moe_testing.py
(``from moe_testing import ...``); the Megatron ones in megatron/megatron_testing.py."""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when moeblaze_megatron.kernels is
# first imported (and moeblaze_megatron.kernels.settings reads it once, then): set it here, before any
# test module imports the package. Without a GPU the interpreter is the only way the kernels run;
# with one, the real kernels are tested.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def generator():
    """A CPU generator with a fixed seed per test: inputs are random but every failure reproduces."""
    return torch.Generator().manual_seed(1234)
