"""bench_layer's Megatron peer on the CPU (routing given): the same layer as the float64 oracle,
top-1 included (Megatron's config refuses top-1 without pre-softmax routing, which a peer that
never runs its router must still set)."""

from __future__ import annotations

import pytest
import torch

from moe_testing import dense_moe_reference, run_distributed


def _peer_worker(rank, world_size, port, topk):
    import os

    from benchlib.peers import MegatronSequential

    from moeblaze_megatron.training.cpu_shims import enable_cpu_megatron

    os.environ["MASTER_PORT"] = str(port)
    g = torch.Generator().manual_seed(topk)
    E, d, h, T = 4, 16, 24, 40
    fc1 = torch.randn(E, 2 * h, d, generator=g, dtype=torch.float64) * d**-0.5
    fc2 = torch.randn(E, d, h, generator=g, dtype=torch.float64) * h**-0.5
    x = torch.randn(T, d, generator=g, dtype=torch.float64)
    ids = torch.rand(T, E, generator=g).topk(topk, dim=1).indices
    probs = torch.rand(T, topk, generator=g, dtype=torch.float64)
    with enable_cpu_megatron():
        impl = MegatronSequential(fc1.float(), fc2.float(), "swiglu", E, topk)
        y = impl(x.float(), ids, probs.float())
    want = dense_moe_reference(x, ids, probs, fc1, fc2, "swiglu")
    return ((y.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("topk", [1, 2])
def test_megatron_sequential_peer(topk):
    (err,) = run_distributed(_peer_worker, 1, topk, timeout=120)
    assert err < 1e-5, err
