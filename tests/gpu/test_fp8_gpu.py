"""The FP8 experts on the GPU (skipped without CUDA): the row quantization gives PyTorch's codes
bitwise (the hardware's cvt.rn.satfinite against torch's cast), the op's kernels meet the
quantized math's float64 reference within float32 accumulation (the tensor cores' FP8 products
summed per 128 of the reduction, then promoted), bitwise the same run to run, the same bytes saved
for backward as bf16, and no host synchronization (capturable as the bf16 layer is).

One tile config per kernel unless MOEBLAZE_AUTOTUNE is set, as the other GPU kernel tests."""

import os

os.environ.setdefault("MOEBLAZE_AUTOTUNE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from moeblaze_megatron import fp8 as fp8_module  # noqa: E402
from moeblaze_megatron import moe_mlp  # noqa: E402
from moeblaze_megatron.training.audit import saved_bytes_for_backward  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Against the float64 reference of the same quantized math: float32 sums of 128 FP8 products,
# bf16 storage of pre and the outputs, and the rare FP8 code of h or d pre that one float32 ulp
# moves across a rounding boundary.
KERNEL_TOL = 5e-3


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _problem(T, d, h, E, K, seed, pair=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randn(T, E, device="cuda", generator=g).topk(K, dim=1).indices.int()
    ids[torch.rand(T, K, device="cuda", generator=g) < 0.05] = -1
    fc1 = (torch.randn(E, 2 * h, d, device="cuda", generator=g) * d ** -0.5).bfloat16()
    return dict(
        x=torch.randn(T, d, device="cuda", generator=g).bfloat16(), ids=ids,
        probs=torch.rand(T, K, device="cuda", generator=g),
        fc1=tuple(w.contiguous() for w in fc1.chunk(2, dim=1)) if pair else fc1,
        fc2=(torch.randn(E, d, h, device="cuda", generator=g) * h ** -0.5).bfloat16(),
        grad_y=torch.randn(T, d, device="cuda", generator=g).bfloat16(),
    )


def _run(p, backend, fmt, recompute="activation"):
    leaves = [p["x"].clone().requires_grad_(), p["probs"].clone().requires_grad_()]
    fc1 = tuple(w.clone().requires_grad_() for w in p["fc1"]) if isinstance(p["fc1"], tuple) else \
        p["fc1"].clone().requires_grad_()
    fc2 = p["fc2"].clone().requires_grad_()
    y = moe_mlp(leaves[0], p["ids"], leaves[1], fc1, fc2, recompute=recompute, backend=backend, fp8=fmt,
                validate=False)
    y.backward(p["grad_y"])
    grad_fc1 = torch.cat([w.grad for w in fc1], dim=1) if isinstance(fc1, tuple) else fc1.grad
    return [y.detach(), leaves[0].grad, leaves[1].grad, grad_fc1, fc2.grad]


@pytest.mark.parametrize("fmt", [0, 1])
def test_row_quantization_is_pytorchs_on_the_gpu(fmt):
    from moeblaze_megatron.kernels.fp8 import quantize_rows

    x = (torch.randn(777, 2000, device="cuda") * torch.exp2(torch.randint(-40, 40, (777, 1), device="cuda"))).bfloat16()
    x[3] = 0
    codes = torch.full(x.shape, 0x7F, dtype=torch.uint8, device="cuda")
    scales = torch.full((777, 16), float("nan"), device="cuda")
    quantize_rows(x, codes, scales, fmt)
    want_codes, want_scales = fp8_module.quantize_rows(x, fmt)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("shape,fmt,recompute,pair", [
    ((4096, 1024, 512, 32, 4), "e4m3", "activation", False),
    ((3000, 1040, 200, 16, 2), "hybrid", "fc1", True),  # widths off the 128 blocks
    ((512, 2048, 768, 128, 8), "e4m3", "activation", True),  # 32 rows per expert
])
def test_kernels_meet_the_quantized_reference(shape, fmt, recompute, pair):
    p = _problem(*shape, seed=sum(shape), pair=pair)
    got, want = _run(p, "triton", fmt, recompute), _run(p, "reference", fmt, recompute)
    for name, a, b in zip(("y", "dx", "dprobs", "dfc1", "dfc2"), got, want):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) <= KERNEL_TOL, (name, _rel(a, b))


def test_bitwise_deterministic_and_the_bf16_floor():
    p = _problem(4096, 1024, 512, 32, 4, seed=5)
    first, second = _run(p, "triton", "e4m3"), _run(p, "triton", "e4m3")
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    sizes = {}
    for fmt in (None, "e4m3"):
        x = p["x"].clone().requires_grad_()
        _, sizes[fmt] = saved_bytes_for_backward(lambda: moe_mlp(x, p["ids"], p["probs"], p["fc1"], p["fc2"], fp8=fmt,
                                                                 validate=False), parameters=(p["fc1"], p["fc2"]))
    assert sizes["e4m3"] == sizes[None], sizes


def test_no_host_synchronization():
    p = _problem(2048, 1024, 512, 16, 4, seed=9)
    _run(p, "triton", "e4m3")  # compiles, and quantizes the weights once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(p, "triton", "e4m3")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replays_requantize_updated_weights():
    """Captured, the layer quantizes its weights inside the graph: a replay after the weights
    change in place (as an optimizer step changes them) gives the eager result for the new
    weights, not the capture's."""
    p = _problem(2048, 1024, 512, 16, 4, seed=11)
    x, fc1, fc2 = p["x"].clone(), p["fc1"].clone(), p["fc2"].clone()
    moe_mlp(x, p["ids"], p["probs"], fc1, fc2, fp8="e4m3", validate=False)  # compiles
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        y = moe_mlp(x, p["ids"], p["probs"], fc1, fc2, fp8="e4m3", validate=False)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.no_grad():
        fc2.mul_(-0.75)
    graph.replay()
    want = moe_mlp(x, p["ids"], p["probs"], fc1, fc2, fp8="e4m3", validate=False)
    assert torch.equal(y, want)
