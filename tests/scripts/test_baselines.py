"""bench_layer's Megatron peer on the CPU (routing given): the same layer as the float64 oracle,
top-1 included (Megatron's config refuses top-1 without pre-softmax routing, which a peer that
never runs its router must still set)."""

from __future__ import annotations

import pytest
import torch

from moe_testing import dense_moe_reference, run_distributed


def _peer_worker(rank, world_size, port, topk):
    import os

    from benchlib.baselines import MegatronSequential

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


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_both_grouped_mm_layouts_are_the_layer(activation):
    # bench_layer times the grouped_mm pipeline over contiguous [E, d, 2h] copies and over
    # transposed views of the layer's own weights (the faster form varies by shape): each must be
    # the same layer, with its gradients back in its own weights' layout.
    from benchlib.baselines import GroupedMM, GroupedMMViews, map_grads

    g = torch.Generator().manual_seed(7)
    E, d, h, T, K = 4, 16, 24, 37, 2
    width = 2 * h if activation == "swiglu" else h
    fc1 = torch.randn(E, width, d, generator=g, dtype=torch.float64) * d**-0.5
    fc2 = torch.randn(E, d, h, generator=g, dtype=torch.float64) * h**-0.5
    x = torch.randn(T, d, generator=g, dtype=torch.float64)
    scores = torch.rand(T, E, generator=g)
    scores[:, 3] = -1  # an expert with no tokens
    ids = scores.topk(K, dim=1).indices
    probs = torch.rand(T, K, generator=g, dtype=torch.float64)
    gy = torch.randn(T, d, generator=g, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (x, fc1, fc2)]
    want = dense_moe_reference(ref[0], ids, probs, ref[1], ref[2], activation)
    want.backward(gy)

    def rel(got, oracle):
        return ((got.double() - oracle).norm() / oracle.norm()).item()

    for cls in (GroupedMM, GroupedMMViews):
        impl = cls(fc1.float(), fc2.float(), activation, E, K)
        xi = x.float().requires_grad_()
        y = impl(xi, ids, probs.float())
        assert rel(y, want) < 1e-5
        y.backward(gy.float())
        # Back to the layer's [E, 2h|h, d] and [E, d, h] whatever the stored layout (what
        # bench_layer's float64 check compares).
        g1, g2 = map_grads(impl, [p.grad for p in impl.params()])
        assert g1.shape == fc1.shape and g2.shape == fc2.shape
        assert max(rel(xi.grad, ref[0].grad), rel(g1, ref[1].grad), rel(g2, ref[2].grad)) < 1e-5, cls.name
