"""kernels/configs.py: the GPU tile-config lists of the expert GEMMs and their pruning (checked
without a GPU: the lists are plain data; the interpreter runs its own single config), the config
labels and the autotuner's picks (kernels/tuning.py), and the MOEBLAZE_AUTOTUNE knob."""

from __future__ import annotations

import pytest
import torch

from moeblaze_megatron.kernels import configs as cf
from moeblaze_megatron.kernels import gather_gemm, tuning, weight_grad
from moeblaze_megatron.kernels.settings import SETTINGS, read_settings


@pytest.fixture
def gpu_lists(monkeypatch):
    # The lists a GPU builds with MOEBLAZE_AUTOTUNE unset (autotuning on).
    monkeypatch.setattr(SETTINGS, "interpret", False)
    monkeypatch.setattr(SETTINGS, "autotune", True)


def _prune(configs, epilogue, activation):
    return cf.prune_gather_gemm(configs, {}, EPILOGUE=epilogue, ACT=cf.ACTIVATION_IDS[activation])


@pytest.mark.parametrize("activation", ["swiglu", "silu", "gelu"])
@pytest.mark.parametrize("autotune", ["1", "0"])
def test_activation_backward_runs_one_config(gpu_lists, monkeypatch, activation, autotune):
    # The router gradient's partial sums follow the column tiles: one config, so one tile width,
    # keeps it bitwise the same run to run, whatever the autotuner's timings.
    monkeypatch.setattr(SETTINGS, "autotune", autotune == "1")
    configs = cf.gather_gemm_configs()
    (kept,) = _prune(configs, cf.EPI_ACT_BWD, activation)
    assert kept.kwargs["BLOCK_N"] == cf.ACT_BWD_BLOCK_N == 256
    if autotune == "1":
        assert cf.config_label(kept) == "128x256x64/g8/w8/s4"  # the measured best (ACT_BWD_BLOCK_N)


def test_swiglu_forward_stays_within_128_columns(gpu_lists):
    configs = cf.gather_gemm_configs()
    kept = _prune(configs, cf.EPI_ACT_FWD, "swiglu")
    assert kept and all(c.kwargs["BLOCK_N"] <= 128 for c in kept)
    assert len(_prune(configs, cf.EPI_ACT_FWD, "silu")) == len(configs)
    assert max(c.kwargs["BLOCK_N"] for c in configs) > 128


def test_plain_gemms_time_neither_128x128_tile(gpu_lists):
    configs = cf.gather_gemm_configs()
    for activation in ("swiglu", "gelu"):
        kept = _prune(configs, cf.EPI_STORE, activation)
        assert {cf.config_label(c) for c in kept} == {
            "128x256x64/g8/w8/s4", "128x256x64/g8/w8/s4/p", "128x256x64/g8/w8/s3/p",  # the wide tiles stay
            "128x64x64/g8/w8/s4", "64x128x64/g8/w4/s4",  # and the narrow ones, for experts with few rows
        }


@pytest.mark.parametrize("rows_per_expert", [2048, 48])
def test_narrow_tiles_are_timed_only_for_experts_with_few_rows(gpu_lists, rows_per_expert):
    # Each config timed costs a new shape's first call compiling and timing; the narrow tiles and
    # the square weight-gradient tile never won where the experts have many rows.
    E = 128
    shape = dict(rows_bucket=gather_gemm.next_pow2(rows_per_expert * E), E=E)
    few = rows_per_expert < cf.NARROW_TILE_ROWS_PER_EXPERT / 2  # the bucket rounds up to a power of two
    assert cf.few_rows_per_expert(shape) == few
    configs = cf.gather_gemm_configs()
    for epilogue, tma_rows in ((cf.EPI_ACT_FWD, False), (cf.EPI_STORE, False), (cf.EPI_STORE, True)):
        kept = cf.prune_gather_gemm(configs, shape, EPILOGUE=epilogue, ACT=cf.ACT_SWIGLU, TMA_ROWS=tma_rows)
        unasked = cf.prune_gather_gemm(configs, {}, EPILOGUE=epilogue, ACT=cf.ACT_SWIGLU, TMA_ROWS=tma_rows)
        narrow = [c for c in unasked if min(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) < 128]
        assert narrow
        if few:
            assert kept == unasked
        elif epilogue == cf.EPI_STORE and tma_rows:
            # Through TMA rows the measured winner runs alone, untimed.
            assert [cf.config_label(c) for c in kept] == ["128x256x64/g8/w8/s3/p"]
        else:
            assert kept == [c for c in unasked if c not in narrow] and len(kept) >= 2
    # SiLU and GELU forwards keep every tile (their winners are not measured at these shapes).
    assert cf.prune_gather_gemm(configs, shape, EPILOGUE=cf.EPI_ACT_FWD, ACT=cf.ACT_SILU) == configs
    wgrad = cf.weight_grad_configs()
    for gather_a in (True, False):
        kept = cf.prune_weight_grad(wgrad, shape, GATHER_A=gather_a, GATHER_B=not gather_a)
        square = [c for c in cf.prune_weight_grad(wgrad, {}, GATHER_A=gather_a, GATHER_B=not gather_a)
                  if c.kwargs["BLOCK_M"] == c.kwargs["BLOCK_N"]]
        assert square and (all(c in kept for c in square) if few else not any(c in kept for c in square))
        assert len(kept) >= 2
        # With the ordered operand through TMA, each orientation's measured winner is timed at its
        # depths only: one tile, so whichever depth wins, the same bits.
        through_tma = cf.prune_weight_grad(wgrad, shape, GATHER_A=gather_a, GATHER_B=not gather_a, TMA=True)
        if few:
            assert through_tma == kept
        else:
            winner = "128x256x64/g-/w8" if gather_a else "256x128x32/g-/w8"
            labels = [cf.config_label(c) for c in through_tma]
            assert len(labels) >= 2 and all(label.startswith(winner + "/s") for label in labels)
            assert labels[0] == winner + ("/s5" if gather_a else "/s8")
    # A list of square tiles only (MOEBLAZE_AUTOTUNE=0's) keeps its one config.
    lone = [c for c in wgrad if c.kwargs["BLOCK_M"] == c.kwargs["BLOCK_N"]]
    assert cf.prune_weight_grad(lone, shape, GATHER_A=True, GATHER_B=False) == lone


def test_rows_through_descriptors_drop_persistent_four_stage_tiles(gpu_lists):
    # C's TMA store buffer does not fit beside a persistent program's four stages.
    configs = cf.gather_gemm_configs()
    pointers = cf.prune_gather_gemm(configs, {}, EPILOGUE=cf.EPI_STORE, ACT=cf.ACT_SWIGLU, TMA_ROWS=False)
    kept = cf.prune_gather_gemm(configs, {}, EPILOGUE=cf.EPI_STORE, ACT=cf.ACT_SWIGLU, TMA_ROWS=True)
    dropped = [c for c in pointers if c not in kept]
    assert dropped and all(c.kwargs["PERSISTENT"] and c.num_stages >= 4 for c in dropped)
    assert any(c.kwargs["PERSISTENT"] for c in kept)  # the three-stage persistent tiles stay


def test_no_autotune_gives_one_config_per_epilogue(gpu_lists, monkeypatch):
    monkeypatch.setattr(SETTINGS, "autotune", False)
    configs = cf.gather_gemm_configs()
    (wgrad,) = cf.weight_grad_configs()
    picked = {}
    for epilogue in (cf.EPI_STORE, cf.EPI_ACT_FWD, cf.EPI_ACT_BWD):
        for activation in ("swiglu", "silu"):
            (picked[epilogue, activation],) = _prune(configs, epilogue, activation)
    # 256 columns but for the SwiGLU forward (both halves of a 128-wide tile).
    assert picked[cf.EPI_ACT_FWD, "swiglu"].kwargs["BLOCK_N"] == 128
    assert {c.kwargs["BLOCK_N"] for k, c in picked.items() if k != (cf.EPI_ACT_FWD, "swiglu")} == {256}
    assert all(c.kwargs["BLOCK_K"] == 32 for c in picked.values())  # fits shared memory in float32
    assert wgrad.kwargs["BLOCK_K"] == 32


@pytest.mark.parametrize("gather_a,gather_b", [(True, False), (False, True), (False, False)])
def test_weight_gradients_time_only_tiles_long_on_the_expert_order_operand(gpu_lists, gather_a, gather_b):
    configs = cf.weight_grad_configs()
    kept = cf.prune_weight_grad(configs, {}, GATHER_A=gather_a, GATHER_B=gather_b)
    if gather_a == gather_b:
        assert kept == configs
        return
    ordered, other = ("BLOCK_N", "BLOCK_M") if gather_a else ("BLOCK_M", "BLOCK_N")
    assert all(c.kwargs[ordered] >= c.kwargs[other] for c in kept)
    assert any(c.kwargs[ordered] > c.kwargs[other] for c in kept) and len(kept) < len(configs)
    assert len(kept) >= 2  # still something to tune (depth, stages)
    # A list with no config of that orientation keeps them all rather than none.
    square_free = [c for c in configs if c.kwargs[ordered] < c.kwargs[other]]
    assert cf.prune_weight_grad(square_free, {}, GATHER_A=gather_a, GATHER_B=gather_b) == square_free


def test_autotune_switch_refuses_other_values():
    with pytest.raises(ValueError, match="MOEBLAZE_AUTOTUNE must be 0 or 1, got 'false'"):
        read_settings({"MOEBLAZE_AUTOTUNE": "false"})


def test_config_labels_and_the_autotuners_picks(monkeypatch):
    import triton

    row = triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4)
    wgrad = triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=8, num_stages=5)
    assert cf.config_label(row) == "128x256x64/g8/w8/s4"
    assert cf.config_label(wgrad) == "256x128x32/g-/w8/s5"
    monkeypatch.setattr(gather_gemm.gather_gemm_kernel, "cache", {(768, 2048): row})
    monkeypatch.setattr(weight_grad.weight_grad_kernel, "cache", {(2048, 1536): wgrad})
    assert tuning.autotune_picks() == {
        "gather_gemm_kernel(768, 2048)": "128x256x64/g8/w8/s4",
        "weight_grad_kernel(2048, 1536)": "256x128x32/g-/w8/s5",
    }


def test_ds_width_follows_the_activation_backward_tiles(gpu_lists, monkeypatch):
    # The router-gradient partials are one column per DS_COLS columns (two per 256-wide Triton
    # tile, one per 128-wide warp-specialized tile: one layout for both kernels), not per tile of
    # the narrowest config in the list (64): no zero columns to fill and sum.
    configs = cf.gather_gemm_configs()
    assert min(c.kwargs["BLOCK_N"] for c in configs) < cf.DS_COLS < cf.ACT_BWD_BLOCK_N
    monkeypatch.setattr(gather_gemm.gather_gemm_kernel, "configs", configs)
    assert gather_gemm.gather_gemm_ds_tiles(768) == 768 // cf.DS_COLS == 6
    assert gather_gemm.gather_gemm_ds_tiles(200) == 2


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_the_in_place_epilogue_is_never_timed(gpu_lists, monkeypatch, activation):
    # The activation backward overwrites pre with its gradient, and the autotuner keeps no copy to
    # restore it (a copy the size of the pre-activations, at the step's peak): it must launch its
    # one config without the autotuner, while the forward's epilogue is still timed.
    import torch

    from moeblaze_megatron import build_routing_plan
    from moeblaze_megatron.kernels import calls

    monkeypatch.setattr(gather_gemm.gather_gemm_kernel, "configs", cf.gather_gemm_configs())
    T, d, h, E = 12, 16, 8, 3
    width = 2 * h if activation == "swiglu" else h
    plan = build_routing_plan(torch.rand(T, E).topk(2, dim=1).indices, E)
    rows = plan.expert_token_indices.shape[0]
    x, pre, out = torch.randn(T, d), torch.randn(rows, width), torch.empty(rows, h)
    backward = gather_gemm.gather_gemm_call(x, torch.randn(E, d, h), out, plan, transpose_weight=False,
                                      epilogue=cf.EPI_ACT_BWD, activation=activation, pre=pre,
                                      probs_sorted=torch.rand(rows),
                                      ds_partial=torch.empty(rows, gather_gemm.gather_gemm_ds_tiles(h)), n=h)
    forward = gather_gemm.gather_gemm_call(x, torch.randn(E, width, d), out, plan, transpose_weight=True,
                                     epilogue=cf.EPI_ACT_FWD, activation=activation, pre=pre, n=h)
    kernel, constexprs = calls.one_config(backward.kernel, backward.args, backward.constexprs)
    assert isinstance(kernel, calls.OneConfig) and kernel.config.kwargs["BLOCK_N"] == cf.ACT_BWD_BLOCK_N
    assert constexprs["BLOCK_N"] == cf.ACT_BWD_BLOCK_N and constexprs["num_warps"] == kernel.config.num_warps
    assert calls.one_config(forward.kernel, forward.args, forward.constexprs)[0] is gather_gemm.gather_gemm_kernel
    assert not gather_gemm.gather_gemm_kernel.restore_value and not gather_gemm.gather_gemm_kernel.reset_to_zero


def test_tma_descriptor_is_triton_s_with_its_checks_run_once_per_layout(monkeypatch):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from moeblaze_megatron.kernels import configs

    checked = []
    real = TensorDescriptor.from_tensor
    monkeypatch.setattr(configs, "_checked_layouts", set())
    monkeypatch.setattr(TensorDescriptor, "from_tensor", staticmethod(lambda *a: (checked.append(1), real(*a))[1]))
    weight = torch.randn(4, 64, 32, dtype=torch.bfloat16)
    for _ in range(3):
        desc = configs.tma_descriptor(weight, (1, 16, 32))
        want = real(weight, [1, 16, 32])
        assert (desc.base is weight and tuple(desc.shape) == tuple(want.shape) and desc.strides == want.strides
                and desc.block_shape == [1, 16, 32] and desc.padding == want.padding)
    assert len(checked) == 1
    configs.tma_descriptor(torch.randn(4, 64, 32, dtype=torch.bfloat16), (1, 16, 32))  # the same layout
    assert len(checked) == 1
    # What Triton refuses is refused every time, never remembered as checked.
    odd = torch.randn(4, 64, 33, dtype=torch.bfloat16)[..., :32]  # rows of 66 bytes: not 16-byte aligned
    for _ in range(2):
        with pytest.raises(AssertionError, match="strides must be 16-byte aligned"):
            configs.tma_descriptor(odd, (1, 16, 32))
    assert len(checked) == 3
