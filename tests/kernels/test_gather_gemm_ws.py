"""The warp-specialized fused epilogues' host side on the CPU: which launches they take, their
knob, and how the launch path treats a Gluon kernel. (The kernel itself has no interpreter: it is
compiled for sm_90a in tests/kernels/test_hopper_compile.py and run on the GPU in
tests/gpu/test_gather_gemm_ws_gpu.py.)"""

import pytest
import torch

from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels import compile_workers, launch
from moeblaze_megatron.kernels.configs import DS_COLS
from moeblaze_megatron.kernels.settings import read_settings
from moeblaze_megatron.kernels.gather_gemm import (
    EPI_ACT_BWD,
    EPI_ACT_FWD,
    EPI_STORE,
    gather_gemm_call,
    gather_gemm_ds_tiles,
    gather_gemm_kernel,
)
from moeblaze_megatron.kernels.gather_gemm_ws import WS_TILES, gather_gemm_ws_kernel, ws_call, ws_takes

HOPPER = (9, 0)


def _tensors(d=256, h=256, E=4, T=64, dtype=torch.bfloat16):
    ids = torch.randint(0, E, (T, 2))
    ids[:, 1] = (ids[:, 0] + 1) % E
    plan = build_routing_plan(ids, E)
    rows = plan.expert_token_indices.shape[0]
    dy = torch.randn(T, d).to(dtype)
    fc2 = torch.randn(E, d, h).to(dtype)
    out, pre = torch.empty(rows, h, dtype=dtype), torch.empty(rows, 2 * h, dtype=dtype)
    probs, ds = torch.empty(rows, dtype=dtype), torch.empty(rows, gather_gemm_ds_tiles(h))
    return plan, dy, fc2, out, pre, probs, ds


def test_the_knob():
    # The activation forward by default (the faster there on every benchmarked shape), dH not.
    assert read_settings({}).warp_specialize == {"fwd"}
    assert read_settings({"MOEBLAZE_WARP_SPECIALIZE": "1"}).warp_specialize == {"fwd", "bwd"}
    assert read_settings({"MOEBLAZE_WARP_SPECIALIZE": "bwd"}).warp_specialize == {"bwd"}
    assert read_settings({"MOEBLAZE_WARP_SPECIALIZE": "0"}).warp_specialize == set()
    with pytest.raises(ValueError, match="MOEBLAZE_WARP_SPECIALIZE must be one of 0, fwd, bwd, 1, got 'yes'"):
        read_settings({"MOEBLAZE_WARP_SPECIALIZE": "yes"})


def test_which_act_bwd_launches_it_takes():
    _, dy, fc2, out, pre, _, _ = _tensors()
    takes = lambda *a: ws_takes(*a[:4], EPI_ACT_BWD, *a[4:])  # noqa: E731
    assert takes(dy, fc2, out, pre, False, HOPPER)
    assert not takes(dy, fc2, out, pre, False, (8, 0))  # not Hopper
    assert not takes(dy, fc2, out, pre, False, (10, 0))  # Blackwell: another MMA
    assert not takes(dy, fc2, out, pre, False, None)  # no GPU
    assert not takes(dy, fc2, out, pre, True, HOPPER)  # the backward reads the weight as it is
    assert not takes(dy, fc2.transpose(1, 2).contiguous().transpose(1, 2), out, pre, False, HOPPER)
    f32 = _tensors(dtype=torch.float32)
    assert not takes(f32[1], f32[2], f32[3], f32[4], False, HOPPER)  # wgmma takes 16-bit operands here
    # The saved pre-activations come by TMA: unit column stride, 16-byte aligned rows and start.
    assert not takes(dy, fc2, out, None, False, HOPPER)
    assert not takes(dy, fc2, out, pre.T.contiguous().T, False, HOPPER)
    assert not takes(dy, fc2, out, torch.empty(pre.shape[0], pre.shape[1] + 1, dtype=pre.dtype)[:, 1:], False,
                     HOPPER)
    assert takes(dy, fc2, out, torch.empty(pre.shape[0], pre.shape[1] + 8, dtype=pre.dtype)[:, 8:], False, HOPPER)
    for d in (96, 128):  # K not in whole 64-column steps; fewer than the three steps the loads run ahead
        _, dy, fc2, out, pre, _, _ = _tensors(d=d)
        assert not takes(dy, fc2, out, pre, False, HOPPER)


def test_which_act_fwd_launches_it_takes():
    x = torch.randn(64, 128).to(torch.bfloat16)
    fc1 = torch.randn(4, 512, 128).to(torch.bfloat16)
    w1, w3 = torch.randn(4, 256, 128).to(torch.bfloat16), torch.randn(4, 256, 128).to(torch.bfloat16)
    out, pre = torch.empty(128, 256, dtype=torch.bfloat16), torch.empty(128, 512, dtype=torch.bfloat16)
    takes = lambda *a: ws_takes(*a[:4], EPI_ACT_FWD, *a[4:])  # noqa: E731
    assert takes(x, fc1, out, pre, True, HOPPER)
    assert takes(x, (w1, w3), out, pre, True, HOPPER)  # torchtitan's halves, read where they are
    assert takes(x, fc1, out, None, True, HOPPER)  # recompute="fc1": no pre-activations stored
    assert not takes(x, fc1, out, pre, False, HOPPER)  # the forward reads the weight transposed
    assert not takes(x, (w1, w3.transpose(1, 2).contiguous().transpose(1, 2)), out, pre, True, HOPPER)
    assert not takes(x, (w1, w3.float()), out, pre, True, HOPPER)
    assert not takes(x[:, :96], fc1[:, :, :96].contiguous(), out, pre, True, HOPPER)
    assert not ws_takes(x, fc1, out, pre, EPI_STORE, True, HOPPER)


def test_the_launch_names_the_tile_the_partials_are_sized_for():
    plan, dy, fc2, out, pre, probs, _ = _tensors(h=320)
    ds = torch.empty(pre.shape[0], 3)  # one partial per 128 columns, as on the GPU
    call = ws_call(dy, fc2, out, plan, epilogue=EPI_ACT_BWD, act_id=0, glu=True, pre=pre, probs_sorted=probs,
                   ds_partial=ds, n=320, sm_count=132)
    assert call.kernel is gather_gemm_ws_kernel
    # DS_COLS wide, half the Triton kernel's tile, which writes two partials: one layout either way.
    assert call.constexprs["BLOCK_N"] == DS_COLS == 128 and call.constexprs["STAGES"] == 4
    with pytest.raises(ValueError, match="ds_partial must have at least 3 columns"):
        ws_call(dy, fc2, out, plan, epilogue=EPI_ACT_BWD, act_id=0, glu=True, pre=pre, probs_sorted=probs,
                ds_partial=ds[:, :2], n=320, sm_count=132)
    # The saved pre-activations by TMA, one [128, 16] chunk of gate (or up) columns per box.
    pre_desc = call.args[3]
    assert pre_desc.base.data_ptr() == pre.data_ptr() and pre_desc.block_shape == [128, 16]
    assert tuple(pre_desc.shape) == tuple(pre.shape)
    # 12 warps at the register count that fills a multiprocessor; one program per tile at most.
    assert (call.constexprs["num_warps"] + call.constexprs["EPILOGUE_WARPS"]) * 32 * call.constexprs["maxnreg"] <= 65536
    tiles = (-(-plan.expert_token_indices.shape[0] // 128) + 4) * 3
    assert call.grid == (min(tiles, 132),)
    assert compile_workers.compile_requests(call) == []  # Gluon compiles in the process, not in the workers
    key = launch._arg_key(call.args[1])
    assert hash(key) is not None and "NVMMASharedLayout" in key[-1]


def test_the_swiglu_forward_tile_is_half_gate_half_up():
    plan, x, _, out, pre, _, _ = _tensors(h=320)
    fc1 = torch.randn(4, 640, 256).to(torch.bfloat16)
    stacked = ws_call(x, fc1, out, plan, epilogue=EPI_ACT_FWD, act_id=0, glu=True, pre=pre, n=320, sm_count=132)
    w1, w3 = fc1[:, :320].contiguous(), fc1[:, 320:].contiguous()
    halves = ws_call(x, (w1, w3), out, plan, epilogue=EPI_ACT_FWD, act_id=0, glu=True, pre=pre, n=320, sm_count=132)
    assert stacked.constexprs["BLOCK_N"] == WS_TILES[EPI_ACT_FWD]["BLOCK_N"] == 256
    # (a, b_desc, b2_desc, pre_desc, ..., n, K, E, rows of the weight per expert, the up rows' offset, ...)
    assert stacked.args[1] is stacked.args[2] and stacked.args[13:15] == (640, 320)
    assert halves.args[1].base.data_ptr() == w1.data_ptr() and halves.args[2].base.data_ptr() == w3.data_ptr()
    assert halves.args[13:15] == (320, 0)
    assert halves.args[1].block_shape == [128, 64]  # 128 gate and 128 up columns per 128 x 256 tile
    assert stacked.grid == halves.grid == (min((-(-plan.expert_token_indices.shape[0] // 128) + 4) * 3, 132),)


@pytest.mark.parametrize("epilogue", [EPI_ACT_FWD, EPI_ACT_BWD])
def test_without_a_hopper_gpu_the_triton_kernel_runs_the_fused_epilogues(epilogue):
    plan, dy, fc2, out, pre, probs, ds = _tensors()
    if epilogue == EPI_ACT_FWD:
        weight, args = torch.randn(4, 512, 256).to(torch.bfloat16), dict(transpose_weight=True, pre=pre)
    else:
        weight, args = fc2, dict(transpose_weight=False, pre=pre, probs_sorted=probs, ds_partial=ds)
    args.update(epilogue=epilogue, activation="swiglu", n=256)
    assert gather_gemm_call(dy, weight, out, plan, **args).kernel is gather_gemm_kernel
    assert gather_gemm_call(dy, weight, out, plan, warp_specialize=False, **args).kernel is gather_gemm_kernel
    with pytest.raises(ValueError, match="warp-specialized fused epilogues run on a GPU"):
        gather_gemm_call(dy, weight, out, plan, warp_specialize=True, **args)
