"""The warp-specialized fused epilogues (kernels/gather_gemm_ws.py, Gluon, Hopper only) against the
Triton kernel they stand in for and against float64. The activation backward (128 x 128 tiles, the
saved pre-activations by TMA): d pre and p * act(pre) bitwise the Triton kernel's 128 x 256 tiles'
(the same k order and roundings per element), the router-gradient partials' row sums to the
float64 value within float32 rounding. The activation forward (fc1,
stacked or as torchtitan's gate and up halves): pre and act(pre) bitwise the Triton kernel's.
Every unused slot's row left unwritten, and the same bits run to run. Awkward plans as in
test_gather_gemm_persistent_gpu.py (empty experts, every token on the same experts, K = E, unused
slots, no tokens), widths off the 128- and 256-column tiles and more tiles than multiprocessors; then the
fused layer's forward and backward with the knob on against it off."""

import pytest
import torch

from moe_testing import GPU_PERSISTENT_CASES, make_topk_ids
from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels.gather_gemm import EPI_ACT_BWD, EPI_ACT_FWD, gather_gemm, gather_gemm_ds_tiles
from moeblaze_megatron.kernels.gather_gemm_ws import on_hopper

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not on_hopper(torch.cuda.get_device_capability()),
                                reason="needs a Hopper GPU")


def _per_expert64(plan, rows64, weight64):
    """rows64 (the used rows, in expert order) @ weight64(e) for each expert's rows, in float64: one
    product per expert (a per-row weight copy took 121 GiB on the random case)."""
    bounds = plan.expert_token_offsets.tolist()
    return torch.cat([rows64[lo:hi] @ weight64(e) for e, (lo, hi) in enumerate(zip(bounds, bounds[1:]))])


def _act_bwd(plan, dy, fc2, pre_saved, probs_sorted, activation, warp_specialize):
    rows, h = plan.expert_token_indices.shape[0], fc2.shape[2]
    pre = pre_saved.clone()
    h_scaled = torch.full((rows, h), float("nan"), dtype=dy.dtype, device=dy.device)
    ds = torch.full((rows, gather_gemm_ds_tiles(h)), float("nan"), dtype=torch.float32, device=dy.device)
    gather_gemm(dy, fc2, h_scaled, plan, transpose_weight=False, epilogue=EPI_ACT_BWD, activation=activation,
             gather_a=True, pre=pre, probs_sorted=probs_sorted, ds_partial=ds, n=h, warp_specialize=warp_specialize)
    return h_scaled, pre, ds


def _act64(pre, activation):
    if activation == "swiglu":
        gate, up = pre.chunk(2, dim=-1)
        return gate * torch.sigmoid(gate) * up
    if activation == "silu":
        return pre * torch.sigmoid(pre)
    return torch.nn.functional.gelu(pre)


@pytest.mark.parametrize("case", list(GPU_PERSISTENT_CASES))
@pytest.mark.parametrize("activation,dtype", [("swiglu", torch.bfloat16), ("gelu", torch.float16),
                                              ("silu", torch.bfloat16)])
def test_warp_specialized_act_bwd_matches_triton_and_float64(case, activation, dtype):
    kind, tokens, E, K, d, h = GPU_PERSISTENT_CASES[case]
    d = -(-d // 64) * 64  # the kernel takes K (= d) in whole 64-column steps
    g = torch.Generator().manual_seed(hash((case, activation)) % 2**31)
    plan = build_routing_plan(make_topk_ids(kind, tokens, E, K, g).cuda(), E)
    rows = plan.expert_token_indices.shape[0]
    width = 2 * h if activation == "swiglu" else h
    on = lambda t: t.to(dtype).cuda()  # noqa: E731
    dy = on(torch.randn(tokens, d, generator=g))
    fc2 = on(torch.randn(E, d, h, generator=g) * d**-0.5)
    pre_saved = on(torch.randn(rows, width, generator=g))
    probs_sorted = on(torch.rand(rows, generator=g))

    ws = _act_bwd(plan, dy, fc2, pre_saved, probs_sorted, activation, True)
    triton_out = _act_bwd(plan, dy, fc2, pre_saved, probs_sorted, activation, False)
    used = int(plan.expert_token_offsets[-1])
    for got, want in zip(ws[:2], triton_out[:2]):
        assert torch.equal(got[:used], want[:used])
        assert not got[:used].isnan().any()
    assert ws[0][used:].isnan().all()  # unused slots' rows are not written
    assert torch.equal(ws[1][used:], pre_saved[used:])

    # float64: dH = dY[src] @ fc2[e] per row, then the activation backward.
    src = plan.expert_token_indices[:used].long()
    dh64 = _per_expert64(plan, dy.double()[src], lambda e: fc2.double()[e])
    pre64 = pre_saved[:used].double().requires_grad_()
    h64 = _act64(pre64, activation)
    p64 = probs_sorted[:used].double()[:, None]
    (dpre64,) = torch.autograd.grad(h64, pre64, dh64 * p64)
    ds64 = (dh64 * h64.detach()).sum(dim=1)
    tol = 2e-2
    rel = lambda a, b: ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()  # noqa: E731
    assert rel(ws[0][:used], (h64 * p64).detach()) < tol
    assert rel(ws[1][:used], dpre64) < tol
    assert not ws[2][:used].isnan().any()  # every partial written: one per 128 columns
    ds = ws[2][:used].sum(dim=1)
    assert rel(ds, ds64) < tol
    # The partials sum like the Triton kernel's within float32 rounding of the same bf16 dH.
    ds_triton = triton_out[2][:used].sum(dim=1)
    assert torch.allclose(ds, ds_triton, rtol=1e-5, atol=1e-5 * ds_triton.abs().amax().item() if used else 0.0)

    again = _act_bwd(plan, dy, fc2, pre_saved, probs_sorted, activation, True)
    for a, b in zip(ws, again):
        assert torch.equal(a[:used], b[:used])


def _act_fwd(plan, x, fc1, activation, n, store_pre, warp_specialize):
    rows = plan.expert_token_indices.shape[0]
    width = 2 * n if activation == "swiglu" else n
    nan = lambda *shape: torch.full(shape, float("nan"), dtype=x.dtype, device=x.device)  # noqa: E731
    pre, h = nan(rows, width), nan(rows, n)
    gather_gemm(x, fc1, h, plan, transpose_weight=True, epilogue=EPI_ACT_FWD, activation=activation, gather_a=True,
             pre=pre if store_pre else None, store_pre=store_pre, n=n, warp_specialize=warp_specialize)
    return h, pre


@pytest.mark.parametrize("case", list(GPU_PERSISTENT_CASES))
@pytest.mark.parametrize("activation,dtype,halves", [("swiglu", torch.bfloat16, False),
                                                     ("swiglu", torch.bfloat16, True),
                                                     ("gelu", torch.float16, False), ("silu", torch.bfloat16, False)])
def test_warp_specialized_act_fwd_matches_triton_and_float64(case, activation, dtype, halves):
    kind, tokens, E, K, d, h = GPU_PERSISTENT_CASES[case]
    d = -(-d // 64) * 64
    g = torch.Generator().manual_seed(hash((case, activation, halves)) % 2**31)
    plan = build_routing_plan(make_topk_ids(kind, tokens, E, K, g).cuda(), E)
    width = 2 * h if activation == "swiglu" else h
    x = torch.randn(tokens, d, generator=g).to(dtype).cuda()
    fc1 = (torch.randn(E, width, d, generator=g) * d**-0.5).to(dtype).cuda()
    weight = (fc1[:, :h].contiguous(), fc1[:, h:].contiguous()) if halves else fc1
    used = int(plan.expert_token_offsets[-1])
    for store_pre in (True, False):
        ws = _act_fwd(plan, x, weight, activation, h, store_pre, True)
        want = _act_fwd(plan, x, weight, activation, h, store_pre, False)
        assert torch.equal(ws[0][:used], want[0][:used]) and not ws[0][:used].isnan().any()
        assert ws[0][used:].isnan().all()
        if store_pre:
            assert torch.equal(ws[1][:used], want[1][:used]) and ws[1][used:].isnan().all()
        else:
            assert ws[1].isnan().all()
    src = plan.expert_token_indices[:used].long()
    pre64 = _per_expert64(plan, x.double()[src], lambda e: fc1.double()[e].T)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()  # noqa: E731
    assert rel(ws[0][:used], _act64(pre64, activation)) < 2e-2
    again = _act_fwd(plan, x, weight, activation, h, False, True)
    assert torch.equal(again[0][:used], ws[0][:used])


def test_warp_specialized_act_bwd_refuses_what_it_cannot_take():
    plan = build_routing_plan(torch.randint(0, 4, (64, 1), device="cuda"), 4)
    dy = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)  # K = 96: not whole 64-column steps
    fc2 = torch.randn(4, 96, 128, device="cuda", dtype=torch.bfloat16)
    pre = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K a multiple of 64 and at least 128 .* or 192 .*bfloat16 A of shape "
                                         "\\(64, 96\\)"):
        _act_bwd(plan, dy, fc2, pre, torch.rand(64, device="cuda", dtype=torch.bfloat16), "swiglu", True)
    # The default falls back to the Triton kernel.
    h_scaled, _, _ = _act_bwd(plan, dy, fc2, pre, torch.rand(64, device="cuda", dtype=torch.bfloat16), "swiglu",
                              None)
    assert not h_scaled.isnan().any()


@pytest.mark.parametrize("activation,halves", [("swiglu", False), ("swiglu", True), ("gelu", False)])
def test_the_layer_with_warp_specialized_epilogues(monkeypatch, activation, halves):
    """The fused layer's forward and backward with MOEBLAZE_WARP_SPECIALIZE on (fc1 stacked or as
    torchtitan's halves): the output and the x, fc1 and fc2 gradients bitwise the Triton kernels'
    (the fused epilogues give the same bits), the router-probability gradient within float32
    rounding (its partials sum in another order)."""
    from moeblaze_megatron.fused import fused_backward, fused_forward
    from moeblaze_megatron.kernels import gather_gemm as gather_gemm_module
    from moeblaze_megatron.kernels.settings import SETTINGS

    torch.manual_seed(7)
    T, d, h, E, K = 3000, 384, 320, 16, 4
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    plan = build_routing_plan(torch.randn(T, E, device="cuda").topk(K, dim=1).indices, E)
    probs = torch.rand(T, K, device="cuda", dtype=torch.bfloat16)
    width = 2 * h if activation == "swiglu" else h
    fc1 = (torch.randn(E, width, d, device="cuda") / d**0.5).to(torch.bfloat16)
    weight = (fc1[:, :h].contiguous(), fc1[:, h:].contiguous()) if halves else fc1
    fc2 = (torch.randn(E, d, h, device="cuda") / h**0.5).to(torch.bfloat16)
    gy = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)

    def run(warp_specialize):
        monkeypatch.setattr(SETTINGS, "warp_specialize", frozenset({"fwd", "bwd"} if warp_specialize else ()))
        monkeypatch.setattr(gather_gemm_module, "WS_MIN_COLUMNS", {EPI_ACT_FWD: 0, EPI_ACT_BWD: 0})  # h = 320 here
        y, probs_sorted, pre = fused_forward(x, probs, weight, fc2, plan, activation, save_pre=True)
        gx, gp, g1, g2 = fused_backward(gy, x, probs_sorted, weight, fc2, plan, activation, pre, (True,) * 4)
        return y, gx, gp, torch.cat(g1, dim=1) if isinstance(g1, tuple) else g1, g2

    ws, triton_out = run(True), run(False)
    for name, a, b in zip(("y", "dx", "dprobs", "dfc1", "dfc2"), ws, triton_out):
        assert torch.isfinite(a).all(), name
        if name == "dprobs":
            assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3), name  # bf16 of nearby float32 sums
        else:
            assert torch.equal(a, b), name


def test_by_default_the_wide_activation_forwards_run_warp_specialized(monkeypatch):
    """MOEBLAZE_WARP_SPECIALIZE's default ("fwd"): fc1 with its activation in the Gluon kernel from
    WS_MIN_COLUMNS output columns on (the faster there in the layer: benchmarks/notes/kernels.md,
    "WS_MIN_COLUMNS: the warp-specialized fc1 from 1024 columns"), in the Triton kernel below; dH
    with the activation backward in the Triton kernel. With "1", dH in the Gluon kernel at every
    width."""
    from moeblaze_megatron.kernels.settings import SETTINGS, read_settings
    from moeblaze_megatron.kernels.gather_gemm import WS_MIN_COLUMNS, gather_gemm_call, gather_gemm_kernel
    from moeblaze_megatron.kernels.gather_gemm_ws import gather_gemm_ws_kernel

    assert read_settings({}).warp_specialize == {"fwd"}
    plan = build_routing_plan(torch.randn(64, 4, device="cuda").topk(2, dim=1).indices, 4)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    rows = plan.expert_token_indices.shape[0]

    def kernels(n):
        h, pre = x.new_empty(rows, n), x.new_empty(rows, 2 * n)
        fc1 = torch.randn(4, 2 * n, 256, device="cuda").to(x.dtype)
        fc2 = torch.randn(4, 256, n, device="cuda").to(x.dtype)
        fwd = gather_gemm_call(x, fc1, h, plan, transpose_weight=True, epilogue=EPI_ACT_FWD, activation="swiglu",
                            gather_a=True, pre=pre, n=n)
        bwd = gather_gemm_call(x, fc2, h, plan, transpose_weight=False, epilogue=EPI_ACT_BWD, activation="swiglu",
                            gather_a=True, pre=pre, probs_sorted=x.new_empty(rows),
                            ds_partial=torch.empty(rows, gather_gemm_ds_tiles(n), device="cuda"), n=n)
        return fwd.kernel, bwd.kernel

    assert kernels(WS_MIN_COLUMNS[EPI_ACT_FWD]) == (gather_gemm_ws_kernel, gather_gemm_kernel)
    assert kernels(WS_MIN_COLUMNS[EPI_ACT_FWD] - 128) == (gather_gemm_kernel, gather_gemm_kernel)
    monkeypatch.setattr(SETTINGS, "warp_specialize", read_settings({"MOEBLAZE_WARP_SPECIALIZE": "1"}).warp_specialize)
    assert kernels(256) == (gather_gemm_kernel, gather_gemm_ws_kernel)
