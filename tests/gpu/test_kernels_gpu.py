"""GPU checks of the Triton kernels (skipped without CUDA): real bf16/fp16 tensor-core paths,
shapes past the interpreter's reach, and 64-bit indexing.

These many small shapes would each autotune every GEMM (seconds per shape, minutes in all), so
they run with one tile config unless MOEBLAZE_AUTOTUNE is set (=1 checks the tuned configs, as
scripts/bench_layer.py's float64 checks do). Set at collection, before any kernel is imported."""

import os

os.environ.setdefault("MOEBLAZE_AUTOTUNE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from moeblaze_megatron import build_routing_plan, moe_mlp  # noqa: E402
from moeblaze_megatron.reference import ReferenceMoEMLP  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _routing(T, E, K, kind, device):
    if kind == "one_expert_set":
        ids = torch.arange(K, device=device).expand(T, K).clone()
    elif kind == "skewed":
        scores = torch.randn(T, E, device=device) + torch.linspace(4, 0, E, device=device)
        ids = scores.topk(K, dim=1).indices
    else:
        ids = torch.randn(T, E, device=device).topk(K, dim=1).indices
    if kind == "dropped":
        ids[torch.rand(T, K, device=device) < 0.2] = -1
    return ids


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("T,E,K", [(4096, 8, 2), (1000, 16, 4), (333, 128, 8), (50000, 64, 1), (3000, 4, 4), (0, 8, 2)])
@pytest.mark.parametrize("kind", ["random", "one_expert_set", "skewed", "dropped"])
def test_routing_paths_identical(T, E, K, kind):
    ids = _routing(T, E, K, kind, "cuda") if T else torch.empty(0, K, dtype=torch.long, device="cuda")
    ref = build_routing_plan(ids, E, method="torch")
    assert build_routing_plan(ids, E, method="three_step") == ref
    assert build_routing_plan(ids, E, method="sort") == ref
    assert build_routing_plan(ids, E, method="auto") == ref


CASES = [
    # T, d, h, E, K, activation, dtype, routing
    (2048, 512, 1024, 8, 2, "swiglu", torch.bfloat16, "random"),
    (1000, 256, 384, 16, 4, "silu", torch.bfloat16, "skewed"),
    (777, 264, 136, 5, 5, "gelu", torch.float16, "random"),
    (512, 128, 256, 4, 1, "swiglu", torch.float32, "one_expert_set"),
    (1500, 384, 512, 32, 8, "swiglu", torch.bfloat16, "dropped"),
    (640, 256, 256, 128, 8, "swiglu", torch.bfloat16, "random"),
    # bf16 with empty experts: fc2 and dX run as torch._grouped_mm there, with empty groups.
    (600, 128, 256, 6, 2, "swiglu", torch.bfloat16, "one_expert_set"),
]


@pytest.mark.parametrize("recompute", ["activation", "fc1"])
@pytest.mark.parametrize("T,d,h,E,K,act,dtype,routing", CASES)
def test_moe_mlp_matches_float64(T, d, h, E, K, act, dtype, routing, recompute):
    torch.manual_seed(T + E)
    dev = "cuda"
    x = torch.randn(T, d, device=dev, dtype=dtype)
    ids = _routing(T, E, K, routing, dev)
    probs = torch.rand(T, K, device=dev)
    rows = 2 * h if act == "swiglu" else h
    fc1 = (torch.randn(E, rows, d, device=dev) / d**0.5).to(dtype)
    fc2 = (torch.randn(E, d, h, device=dev) / h**0.5).to(dtype)
    gy = torch.randn(T, d, device=dev, dtype=dtype)
    ref = [t.double().requires_grad_() for t in (x, probs, fc1, fc2)]
    plan = build_routing_plan(ids, E, method="torch")
    ReferenceMoEMLP.apply(*ref, plan, act, "activation").backward(gy.double())
    y_ref = ReferenceMoEMLP.apply(*[t.detach() for t in ref], plan, act, "activation")
    ins = [t.clone().requires_grad_() for t in (x, probs, fc1, fc2)]
    for t in ins:
        t.grad = None
    y = moe_mlp(ins[0], ids, ins[1], ins[2], ins[3], act, recompute=recompute, backend="triton")
    y.backward(gy)
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    errs = [_rel(y, y_ref)] + [_rel(a.grad, b.grad) for a, b in zip(ins, ref)]
    assert max(errs) < tol, errs
    # Bitwise deterministic.
    ins2 = [t.detach().clone().requires_grad_() for t in (x, probs, fc1, fc2)]
    y2 = moe_mlp(ins2[0], ids, ins2[1], ins2[2], ins2[3], act, recompute=recompute, backend="triton")
    y2.backward(gy)
    assert torch.equal(y, y2)
    for a, b in zip(ins, ins2):
        assert torch.equal(a.grad, b.grad)


def test_index_ranges_past_int32():
    """T*K*2h and E*2h*d past 2^31 elements: rows and experts far from the origin stay right."""
    dev = "cuda"
    T, d, h, E, K = 65536, 2048, 8192, 72, 4  # T*K*2h = 4.3e9 and E*2h*d = 2.4e9 elements
    torch.manual_seed(0)
    x = torch.randn(T, d, device=dev, dtype=torch.bfloat16)
    ids = torch.randn(T, E, device=dev).topk(K, dim=1).indices
    ids[-8:] = torch.arange(E - K, E, device=dev)  # last tokens on the last experts
    probs = torch.rand(T, K, device=dev)
    fc1 = (torch.randn(E, 2 * h, d, device=dev, dtype=torch.bfloat16) / d**0.5)
    fc2 = (torch.randn(E, d, h, device=dev, dtype=torch.bfloat16) / h**0.5)
    assert T * K * 2 * h > 2**31 and E * 2 * h * d > 2**31
    xg, pg = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y = moe_mlp(xg, ids, pg, fc1, fc2, backend="triton")
    gy = torch.randn_like(y)
    y.backward(gy)
    # A token's output and its input and probability gradients depend on that token alone.
    rows = torch.tensor([0, 1, T // 2, T - 9, T - 1], device=dev)
    sub = build_routing_plan(ids[rows], E, method="torch")
    xr, pr = x[rows].double().requires_grad_(), probs[rows].double().requires_grad_()
    y_ref = ReferenceMoEMLP.apply(xr, pr, fc1.double(), fc2.double(), sub, "swiglu", "activation")
    y_ref.backward(gy[rows].double())
    assert _rel(y[rows], y_ref) < 1.5e-2
    assert _rel(xg.grad[rows], xr.grad) < 1.5e-2
    assert _rel(pg.grad[rows], pr.grad) < 1.5e-2
