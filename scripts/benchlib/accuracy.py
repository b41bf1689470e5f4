"""Relative errors, and one implementation's outputs and gradients against a float64 reference."""

from __future__ import annotations

import math

import torch

from moeblaze_megatron import moe_mlp

from .baselines import map_grads
from .shapes import make_inputs

CHECK_TOKENS = 2048  # tokens of bench_layer's float64 check (the full shape's d, h, K)
CHECK_TOL = 3e-2  # the check passes when every relative error is below this


def rel_err(got, want, chunk=1 << 26):
    """||got - want|| / ||want|| in float64, over ``chunk`` elements of dim-0 slices at a time
    (dsv3-like's dW1 would take 56 GiB in float64 at once); 0 when both are zero, inf when only
    ``want`` is."""
    got, want = got.detach(), want.detach()
    if got.dim() == 0:  # a loss
        got, want = got.reshape(1), want.reshape(1)
    step = max(1, chunk // max(1, got[0].numel()))
    num = den = 0.0
    for i in range(0, got.shape[0], step):
        a, b = got[i:i + step].double(), want[i:i + step].double()
        num += (a - b).square().sum().item()
        den += b.square().sum().item()
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return math.sqrt(num / den)


def check_impl(cls, T, d, h, E, K, activation, dtype, device, seed):
    """Relative errors of y, dx, dprobs, dfc1, dfc2 against a float64 reference."""
    x, ids, probs, fc1, fc2 = make_inputs(T, d, h, E, K, activation, dtype, device, seed)
    gy = torch.randn(T, d, device=device, dtype=dtype)
    ref_in = [t.double().requires_grad_() for t in (x, probs, fc1, fc2)]
    y_ref = moe_mlp(*ref_in[:1], ids, *ref_in[1:], activation, backend="reference", routing_method="torch")
    y_ref.backward(gy.double())
    impl = cls(fc1, fc2, activation, E, K)
    xi = x.clone().requires_grad_()
    pi = probs.clone().requires_grad_()
    y = impl(xi, ids, pi)
    y.backward(gy)
    g1, g2 = map_grads(impl, [p.grad for p in impl.params()])
    return {
        "y": rel_err(y, y_ref), "dx": rel_err(xi.grad, ref_in[0].grad),
        "dprobs": rel_err(pi.grad, ref_in[1].grad) if pi.grad is not None else float("nan"),
        "dfc1": rel_err(g1, ref_in[2].grad), "dfc2": rel_err(g2, ref_in[3].grad),
    }
