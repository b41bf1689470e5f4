"""GPU checks of the Triton kernels (skipped without CUDA): real bf16/fp16 tensor-core paths,
shapes past the interpreter's reach, and 64-bit indexing.

These many small shapes would each autotune every GEMM (seconds per shape, minutes in all), so
they run with one tile config unless MOEBLAZE_AUTOTUNE is set (=1 checks the tuned configs, as
scripts/bench_layer.py's float64 checks do). Set at collection, before any kernel is imported:
kernels/settings.py reads it once, and the tile-config lists are built from it at import."""

import os

os.environ.setdefault("MOEBLAZE_AUTOTUNE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from moe_testing import check_saturated_activations, per_expert_weight_grad64  # noqa: E402
from moeblaze_megatron import build_routing_plan, moe_mlp  # noqa: E402
from moeblaze_megatron.kernels.settings import SETTINGS  # noqa: E402

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
    # bf16 with empty experts: empty groups in the grouped weight gradients, empty ragged slices.
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
    y_ref = moe_mlp(ref[0], ids, *ref[1:], act, plan, backend="reference")
    y_ref.backward(gy.double())
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
    y_ref = moe_mlp(xr, ids[rows], pr, fc1.double(), fc2.double(), "swiglu", sub, backend="reference")
    y_ref.backward(gy[rows].double())
    assert _rel(y[rows], y_ref) < 1.5e-2
    assert _rel(xg.grad[rows], xr.grad) < 1.5e-2
    assert _rel(pg.grad[rows], pr.grad) < 1.5e-2


def _step(x, ids, probs, fc1, fc2, gy, act="swiglu"):
    ins = [t.clone().requires_grad_() for t in (x, probs, fc1, fc2)]
    y = moe_mlp(ins[0], ids, ins[1], ins[2], ins[3], act, backend="triton")
    y.backward(gy)
    return [y] + [t.grad for t in ins]


def _layer_inputs(T, d, h, E, K, dtype, seed, act="swiglu"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, d, device="cuda", dtype=dtype, generator=g)
    ids = torch.randn(T, E, device="cuda", generator=g).topk(K, dim=1).indices
    probs = torch.rand(T, K, device="cuda", generator=g)
    rows = 2 * h if act == "swiglu" else h
    fc1 = (torch.randn(E, rows, d, device="cuda", generator=g) / d**0.5).to(dtype)
    fc2 = (torch.randn(E, d, h, device="cuda", generator=g) / h**0.5).to(dtype)
    gy = torch.randn(T, d, device="cuda", dtype=dtype, generator=g)
    return x, ids, probs, fc1, fc2, gy


@pytest.mark.parametrize("dtype,act", [(torch.bfloat16, "swiglu"), (torch.float16, "gelu"), (torch.float32, "silu")])
def test_direct_launches_match_triton_launches(dtype, act, monkeypatch):
    """Launches that reuse a cached signature (kernels/launch.py) compute what Triton's own launch
    path computes, bitwise, for fresh data every step, and a new signature (another shape, a
    misaligned view) is resolved anew."""
    from moeblaze_megatron.kernels import launch as launch_mod

    for seed, (T, d, h, E, K) in enumerate([(1500, 256, 384, 16, 4)] * 3 + [(777, 264, 136, 5, 5)] * 2):
        x, ids, probs, fc1, fc2, gy = _layer_inputs(T, d, h, E, K, dtype, seed, act)
        if seed == 4:
            # A storage offset of one element: 16-byte alignment, which Triton specializes on, changes.
            x = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(T, d)
            assert x.data_ptr() % 16 != 0
        direct = _step(x, ids, probs, fc1, fc2, gy, act)
        with monkeypatch.context() as m:
            m.setattr(SETTINGS, "direct_launch", False)  # every launch through Triton's path
            triton_path = _step(x, ids, probs, fc1, fc2, gy, act)
        for a, b in zip(direct, triton_path):
            assert torch.equal(a, b)
    assert launch_mod._entries


def test_direct_launches_with_autotuned_configs(monkeypatch):
    """With several configs to choose from (the autotuner's pick and its pre-hook, which sizes the
    TMA boxes), cached launches still match Triton's launch path bitwise."""
    import triton

    from moeblaze_megatron.kernels import configs, gather_gemm, weight_grad
    from moeblaze_megatron.kernels import launch as launch_mod

    def two(kernel, configs, hook):
        for config in configs:
            config.pre_hook = hook
        monkeypatch.setattr(kernel, "configs", configs)
        monkeypatch.setattr(kernel, "cache", {})

    two(gather_gemm.gather_gemm_kernel, [triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8},
                                                 num_warps=4, num_stages=3),
                                   triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 4},
                                                 num_warps=8, num_stages=3)], configs.set_gather_gemm_boxes)
    two(weight_grad.weight_grad_kernel, [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4,
                                                       num_stages=3),
                                         triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=8,
                                                       num_stages=3)], configs.set_tma_box)
    monkeypatch.setattr(launch_mod, "_entries", {})  # none resolved with the configs replaced here
    x, ids, probs, fc1, fc2, gy = _layer_inputs(1024, 256, 512, 8, 2, torch.bfloat16, 7)
    for _ in range(2):
        direct = _step(x, ids, probs, fc1, fc2, gy)
        with monkeypatch.context() as m:
            m.setattr(SETTINGS, "direct_launch", False)
            triton_path = _step(x, ids, probs, fc1, fc2, gy)
        for a, b in zip(direct, triton_path):
            assert torch.equal(a, b)


def test_launch_hooks_see_every_launch():
    """With a Triton launch hook set (a profiler's), launches go through Triton, so the hook sees them."""
    import triton

    seen = []
    hook = triton.knobs.runtime.launch_enter_hook
    # Experts narrower than the model, so the weight gradients run on the Triton kernel too.
    x, ids, probs, fc1, fc2, gy = _layer_inputs(512, 256, 128, 4, 2, torch.bfloat16, 1)
    _step(x, ids, probs, fc1, fc2, gy)  # the signatures are cached
    record = lambda metadata: seen.append(metadata)  # noqa: E731
    hook.add(record)
    try:
        _step(x, ids, probs, fc1, fc2, gy)
    finally:
        hook.remove(record)
    # The plan's two kernels (a plan this small scans its tile counts in the scatter:
    # plan_three_step.FOLD_CELLS), fc1, fc2, the combine, dH, dW2, dW1, dX and dx's combine: ten
    # Triton launches.
    assert len(seen) == 10


def test_direct_launch_takes_each_calls_grid():
    """Two launches with the same arguments and different grids (a grid may depend on values the
    arguments do not hold): each runs its own grid."""
    import triton
    import triton.language as tl

    from moeblaze_megatron.kernels.launch import launch

    @triton.jit
    def mark(out_ptr, BLOCK: tl.constexpr):
        tl.store(out_ptr + tl.program_id(0), tl.program_id(0) + 1)

    out = torch.zeros(16, dtype=torch.int32, device="cuda")
    for programs in (4, 4, 9, 16, 3):
        out.zero_()
        launch(mark, (programs,), (out,), {"BLOCK": 1})
        expected = torch.zeros(16, dtype=torch.int32)
        expected[:programs] = torch.arange(1, programs + 1)
        assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("gather_a", [True, False])
@pytest.mark.parametrize("kind", ["random", "one_expert_set", "dropped"])
def test_gathered_weight_grad_on_the_gpu(gather_a, kind):
    """The grouped GEMM's weight gradients (experts at least as wide as the model) against float64
    per expert, with the rows of unused slots poisoned and experts that get no rows."""
    from moeblaze_megatron.kernels.weight_grad import gathered_weight_grad

    torch.manual_seed(11)
    T, E, K, rows_width, token_width = 3000, 16, 4, 520, 264
    ids = _routing(T, E, K, kind, "cuda")
    plan = build_routing_plan(ids, E)
    offsets = plan.expert_token_offsets.tolist()
    rows = torch.randn(T * K, rows_width, device="cuda").bfloat16()
    rows[offsets[-1]:] = float("nan")
    tokens = torch.randn(T, token_width, device="cuda").bfloat16()
    buffer = torch.full((T * K, token_width), float("nan"), device="cuda", dtype=torch.bfloat16)
    a, b = (tokens, rows) if gather_a else (rows, tokens)
    out = gathered_weight_grad(a, b, plan, gather_a=gather_a, buffer=buffer)
    expected = per_expert_weight_grad64(tokens, rows, plan, gather_a)
    assert torch.isfinite(out).all()
    assert _rel(out, expected) < 1e-2
    for e in range(E):
        if offsets[e] == offsets[e + 1]:
            assert (out[e] == 0).all()


@pytest.mark.parametrize("gather_a", [True, False])
def test_weight_grad_depths_give_the_same_bits(gather_a, monkeypatch):
    """Where the ordered operand goes through TMA, the autotuner times one tile at several depths
    (configs.prune_weight_grad): whichever wins, the gradient's bits are the same, and they match
    float64 per expert."""
    from moeblaze_megatron.kernels import configs as cf
    from moeblaze_megatron.kernels.tuning import weight_grad_with
    from moeblaze_megatron.kernels.weight_grad import weight_grad_call

    monkeypatch.setattr(SETTINGS, "autotune", True)
    torch.manual_seed(5)
    T, E, K, rows_width, token_width = 8192, 16, 4, 768, 512  # 2048 rows an expert: the strict pruning
    plan = build_routing_plan(_routing(T, E, K, "random", "cuda"), E)
    rows = torch.randn(T * K, rows_width, device="cuda").bfloat16()
    tokens = torch.randn(T, token_width, device="cuda").bfloat16()
    a, b = (tokens, rows) if gather_a else (rows, tokens)
    call = weight_grad_call(a, b, torch.empty(E, a.shape[1], b.shape[1], device="cuda"), plan,
                            gather_a=gather_a, gather_b=not gather_a)
    assert call.constexprs["TMA"]
    named = dict(zip(call.kernel.arg_names, call.args))  # as the autotuner hands them to the pruning
    kept = cf.prune_weight_grad(cf.weight_grad_configs(), named, **call.constexprs)
    assert len(kept) >= 2 and len({(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) for c in kept}) == 1
    results = []
    for config in kept:
        out = torch.full((E, a.shape[1], b.shape[1]), float("nan"), device="cuda", dtype=torch.bfloat16)
        weight_grad_with(config, a, b, out, plan, gather_a=gather_a, gather_b=not gather_a)
        results.append(out)
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert _rel(results[0], per_expert_weight_grad64(tokens, rows, plan, gather_a)) < 1e-2


@pytest.mark.parametrize("recompute", ["activation", "fc1"])
@pytest.mark.parametrize("T,d,h,E,K", [(2048, 512, 768, 8, 2), (1500, 384, 256, 32, 8), (640, 2048, 768, 128, 8)])
def test_gate_up_halves_match_the_stacked_weight(T, d, h, E, K, recompute):
    """fc1 as torchtitan's (w1, w3) pair through the fused layer (each half read in place, two
    accumulators in the SwiGLU forward, dX reducing over both halves): bitwise the stacked
    weight's result (h a multiple of every k tile), both halves' gradients included, and a
    second run bitwise the first."""
    from moeblaze_megatron.fused import fused_backward, fused_forward

    torch.manual_seed(T + h)
    dev, dtype = "cuda", torch.bfloat16
    x = torch.randn(T, d, device=dev, dtype=dtype)
    ids = _routing(T, E, K, "dropped", dev)
    probs = torch.rand(T, K, device=dev, dtype=dtype)
    w1, w3 = ((torch.randn(E, h, d, device=dev) * d**-0.5).to(dtype) for _ in range(2))
    fc2 = (torch.randn(E, d, h, device=dev) * h**-0.5).to(dtype)
    gy = torch.randn(T, d, device=dev, dtype=dtype)
    plan = build_routing_plan(ids, E)

    def run(fc1):
        y, probs_sorted, pre = fused_forward(x, probs, fc1, fc2, plan, "swiglu", save_pre=recompute == "activation")
        gx, gp, g1, g2 = fused_backward(gy, x, probs_sorted, fc1, fc2, plan, "swiglu", pre, (True,) * 4)
        return y, gx, gp, torch.cat(g1, dim=1) if isinstance(g1, tuple) else g1, g2

    halves, again, stacked = run((w1, w3)), run((w1, w3)), run(torch.cat([w1, w3], dim=1))
    for name, a, b, c in zip(("y", "dx", "dprobs", "dfc1", "dfc2"), halves, again, stacked):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name}: a second run differs"
        assert torch.equal(a, c), f"{name}: {_rel(a, c):.2e} from the stacked weight's"


@pytest.mark.parametrize("activation", ["swiglu", "silu"])  # GELU has no sigmoid
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("warp_specialize", [False, True], ids=["triton", "gluon"])
def test_activations_where_the_sigmoid_saturates(activation, dtype, warp_specialize):
    """The flush-to-zero exponential and approximate reciprocal of the epilogues' sigmoid at
    pre-activations from -1e4 to 1e4, element by element against float64, in both kernels."""
    from moeblaze_megatron.kernels.gather_gemm_ws import on_hopper

    if warp_specialize and not on_hopper(torch.cuda.get_device_capability()):
        pytest.skip("the warp-specialized kernel needs a Hopper GPU")
    if warp_specialize and dtype == torch.float32:
        pytest.skip("the warp-specialized kernel runs 16-bit dtypes only")
    check_saturated_activations("cuda", dtype, activation, warp_specialize=warp_specialize)
