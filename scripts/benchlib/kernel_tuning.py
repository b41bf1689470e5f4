"""Every expert-GEMM launch of one MoE layer timed config by config, bypassing the autotuner
(scripts/tune_kernels.py): each launch's result checked against the autotuned launch, its ms and
TFLOP/s next to a dense torch.mm of the same size measured in the same run."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import triton

from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.kernels.configs import config_label, sm_count
from moeblaze_megatron.kernels.settings import SETTINGS
from moeblaze_megatron.kernels.launch import launch_call
from moeblaze_megatron.kernels.gather_gemm import EPI_ACT_BWD, EPI_ACT_FWD, EPI_STORE, gather_gemm, gather_gemm_kernel
from moeblaze_megatron.kernels.gather_gemm_ws import on_hopper, ws_call
from moeblaze_megatron.kernels.tuning import gather_gemm_with, weight_grad_with
from moeblaze_megatron.kernels.weight_grad import weight_grad, weight_grad_kernel

from .accuracy import rel_err
from .nvml import PowerWindow, optional_sampler
from .shapes import CONFIGS, config_name
from .timing import time_op

ROW_CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages[, other constexprs]
    (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 8, 5),
    (128, 128, 64, 4, 8, 4), (128, 128, 64, 16, 8, 4), (128, 128, 64, 8, 4, 4),
    (128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (256, 128, 64, 8, 8, 3),
    (128, 64, 64, 8, 4, 4), (128, 64, 64, 8, 8, 4), (64, 128, 64, 8, 4, 4),
    (128, 128, 128, 8, 8, 3), (128, 256, 32, 8, 8, 4), (128, 256, 64, 16, 8, 3),
    (128, 256, 64, 8, 8, 4, {"PERSISTENT": True}), (128, 256, 64, 8, 8, 3, {"PERSISTENT": True}),
    (128, 128, 64, 8, 8, 4, {"PERSISTENT": True}), (128, 128, 64, 8, 8, 3, {"PERSISTENT": True}),
    (128, 256, 32, 8, 8, 4, {"PERSISTENT": True}), (128, 128, 32, 8, 8, 4, {"PERSISTENT": True}),
    (128, 128, 64, 8, 4, 3),
    # One warpgroup on a 64 x 256 tile (m64n256 instructions): two programs fit a multiprocessor
    # at these stage counts, so one's epilogue can overlap the other's main loop.
    (64, 256, 64, 8, 4, 2), (64, 256, 32, 8, 4, 4), (64, 256, 64, 8, 4, 3),
    # Two 8-warp programs per multiprocessor: shared memory for two, registers capped at 128.
    (128, 128, 64, 8, 8, 2, {"maxnreg": 128}), (128, 128, 64, 8, 8, 3, {"maxnreg": 128}),
    (128, 128, 32, 8, 8, 4, {"maxnreg": 128}), (64, 128, 64, 8, 4, 3, {"maxnreg": 128}),
]
WGRAD_CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, extras: maxnreg]
    (128, 128, 64, 8, 4), (128, 128, 64, 8, 5), (128, 128, 64, 8, 6),
    (128, 256, 64, 8, 4), (128, 256, 64, 8, 5), (256, 128, 64, 8, 4), (256, 128, 64, 8, 5),
    (128, 128, 32, 8, 6), (64, 128, 64, 4, 5), (128, 64, 64, 4, 5), (128, 128, 128, 8, 4),
    (256, 128, 32, 8, 8), (128, 256, 32, 8, 8),
    # The row ids take pipeline stages of their own: num_stages s holds ceil(s / 2) buffers of A and B.
    (256, 128, 32, 8, 12), (256, 128, 32, 8, 14), (256, 128, 32, 8, 16), (128, 256, 64, 8, 7),
    (128, 256, 32, 8, 12), (128, 256, 32, 8, 16),
    # Two 8-warp programs per multiprocessor: shared memory for two, registers capped at 128.
    (128, 128, 64, 8, 3, {"maxnreg": 128}), (128, 128, 32, 8, 5, {"maxnreg": 128}),
]


def row_config(bm, bn, bk, gm, w, s, extra=None):
    """A row-GEMM ``triton.Config`` from a ROW_CONFIGS entry (``maxnreg`` among the extras caps the
    registers per thread)."""
    extra = dict(extra or {})
    maxnreg = extra.pop("maxnreg", None)
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, **extra},
                         num_warps=w, num_stages=s, maxnreg=maxnreg)


def wgrad_config(bm, bn, bk, w, s, extra=None):
    """A weight-gradient ``triton.Config`` from a WGRAD_CONFIGS entry (``maxnreg`` among the extras
    caps the registers per thread)."""
    extra = dict(extra or {})
    maxnreg = extra.pop("maxnreg", None)
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **extra}, num_warps=w, num_stages=s,
                         maxnreg=maxnreg)


def layer_ops(T, d, h, E, K, seed, dev="cuda", activation="swiglu"):
    """The plan, {op: the tensors its result is checked against, where not its own autotuned
    launch}, and the six launches of one layer (plus the diagnostic ones) as
    (name, flops, kind, launch(config), outputs(), reset())."""
    g = torch.Generator(device=dev).manual_seed(seed)
    bf = torch.bfloat16
    width = 2 * h if activation == "swiglu" else h  # fc1's output columns: gate | up, or h
    x = torch.randn(T, d, device=dev, dtype=bf, generator=g)
    fc1 = torch.randn(E, width, d, device=dev, dtype=bf, generator=g) * d**-0.5
    fc2 = torch.randn(E, d, h, device=dev, dtype=bf, generator=g) * h**-0.5
    dy = torch.randn(T, d, device=dev, dtype=bf, generator=g)
    ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    probs = torch.rand(T, K, device=dev, generator=g).to(bf)
    plan = build_routing_plan(ids, E)
    rows = T * K
    pre = x.new_empty(rows, width)
    hid = x.new_empty(rows, h)
    gather_gemm(x, fc1, hid, plan, transpose_weight=True, epilogue=EPI_ACT_FWD, activation=activation,
             gather_a=True, pre=pre, n=h, warp_specialize=False)
    pre_saved = pre.clone()
    expert_out = x.new_empty(rows, d)
    probs_sorted = plan.permute_probs(probs)
    h_scaled = x.new_empty(rows, h)
    # Wide enough for the narrowest candidate tile (the layer's is gather_gemm_ds_tiles(h)).
    ds = torch.zeros(rows, triton.cdiv(h, min(c[1] for c in ROW_CONFIGS)), dtype=torch.float32, device=dev)
    dpre = pre.clone()
    gather_gemm(dy, fc2, h_scaled, plan, transpose_weight=False, epilogue=EPI_ACT_BWD,
             activation=activation, gather_a=True, pre=dpre, probs_sorted=probs_sorted, ds_partial=ds, n=h,
             warp_specialize=False)
    fc1_ref, dh_ref = (hid.clone(), pre_saved), (h_scaled.clone(), dpre, ds.sum(1))
    x_rows = torch.randn(rows, d, device=dev, dtype=bf, generator=g)
    dw1 = torch.empty_like(fc1)
    dw1_contiguous = torch.empty_like(fc1)
    x_gathered = x.new_empty(rows, d)
    group_ends = plan.expert_token_offsets[1:].to(torch.int32)
    dw1_grouped, dw2_grouped, rows_grouped = [], [], {}

    def grouped_mm_dw1(config):
        # cuBLAS/CUTLASS grouped GEMM with the reduction split at the expert offsets, as
        # torchtitan's backward computes weight gradients, after gathering x into expert order.
        torch.index_select(x, 0, plan.expert_token_indices, out=x_gathered)
        dw1_grouped[:] = [torch._grouped_mm(dpre.t(), x_gathered, offs=group_ends)]

    def grouped_mm_dw2(config):
        # The same for dW2, gathering dY.
        torch.index_select(dy, 0, plan.expert_token_indices, out=x_gathered)
        dw2_grouped[:] = [torch._grouped_mm(x_gathered.t(), h_scaled, offs=group_ends)]

    def grouped_mm_rows(name, a, weight):
        # cuBLAS/CUTLASS grouped GEMM over the rows of each expert, for the gather GEMMs whose A is
        # already in expert order (fc2, dX): no gather is needed there.
        def launch(config):
            rows_grouped[name] = torch._grouped_mm(a, weight, offs=group_ends)
        return launch, lambda: (rows_grouped[name],) if name in rows_grouped else ()

    dw2 = torch.empty_like(fc2)
    pre_plain, dh_plain, h_scaled_ws = torch.empty_like(pre), torch.empty_like(h_scaled), torch.empty_like(h_scaled)
    hid_ws, pre_ws, dh_ws_plain, dh_ref_plain = (torch.empty_like(t) for t in (hid, pre, h_scaled, h_scaled))
    gather_gemm(dy, fc2, dh_ref_plain, plan, transpose_weight=False, gather_a=True, n=h)
    grad_rows = x.new_empty(rows, d)

    def restore_pre():
        pre.copy_(pre_saved)
        ds.zero_()

    dw1_kernel = torch.empty_like(fc1)
    weight_grad(dpre, x, dw1_kernel, plan, gather_a=False, gather_b=True)
    dw2_kernel = torch.empty_like(fc2)
    weight_grad(dy, h_scaled, dw2_kernel, plan, gather_a=True, gather_b=False)
    dw1_pointer, dw2_pointer = torch.empty_like(fc1), torch.empty_like(fc2)
    fc2_kernel, dx_kernel = x.new_empty(rows, d), x.new_empty(rows, d)
    hid_pointer, pre_pointer, grad_rows_pointer = torch.empty_like(hid), torch.empty_like(pre), x.new_empty(rows, d)
    h_scaled_pointer, fc2_rows_pointer = torch.empty_like(h_scaled), x.new_empty(rows, d)
    gather_gemm(hid, fc2, fc2_kernel, plan, transpose_weight=True, gather_a=False, n=d)
    gather_gemm(dpre, fc1, dx_kernel, plan, transpose_weight=False, gather_a=False, n=d)
    gemm = 2.0 * rows * d * h
    gemm1 = 2.0 * rows * d * width  # fc1, dW1 and dX
    references = {"dw1_grouped_mm": (dw1_kernel,), "dw2_grouped_mm": (dw2_kernel,), "dw1_pointer": (dw1_kernel,), "dw2_pointer": (dw2_kernel,),
                  "fc2_grouped_mm": (fc2_kernel,), "dx_grouped_mm": (dx_kernel,), "fc1_act_pointer": fc1_ref,
                  "dh_act_bwd_pointer": dh_ref, "dx_pointer": (dx_kernel,), "fc2_rows_pointer": (fc2_kernel,),
                  "dx_rows_pointer": (dx_kernel,),
                  "fc1_plain": (pre_saved,), "dh_ws": dh_ref, "fc1_ws": fc1_ref,
                  "dh_ws_plain": (dh_ref_plain,)}
    return plan, references, [
        ("fc1_act", gemm1, "row_glu" if activation == "swiglu" else "row",
         lambda c: gather_gemm_with(c, x, fc1, hid, plan, transpose_weight=True, epilogue=EPI_ACT_FWD,
                                 activation=activation, gather_a=True, pre=pre, n=h, warp_specialize=False),
         lambda: (hid, pre), nothing),
        # fc1 in the warp-specialized Gluon kernel (Hopper), checked against the Triton kernel's.
        ("fc1_ws", gemm1, "gluon",
         lambda c: gather_gemm(x, fc1, hid_ws, plan, transpose_weight=True, epilogue=EPI_ACT_FWD, activation=activation,
                            gather_a=True, pre=pre_ws, n=h, warp_specialize=True),
         lambda: (hid_ws, pre_ws), nothing),
        # Diagnostic: fc1 and dH without their fused epilogues (the same gathered main loops, a plain
        # store of the accumulator): the difference is what the epilogues cost, the most that
        # overlapping them with another tile's main loop can gain.
        ("fc1_plain", gemm1, "row",
         lambda c: gather_gemm_with(c, x, fc1, pre_plain, plan, transpose_weight=True, gather_a=True, n=width),
         lambda: (pre_plain,), nothing),
        # Diagnostic: dH's main loop in the warp-specialized kernel with a plain store for its epilogue.
        ("dh_ws_plain", gemm, "gluon",
         lambda c: launch_call(ws_call(dy, fc2, dh_ws_plain, plan, epilogue=EPI_STORE, act_id=0, glu=False, pre=None,
                                       n=h, sm_count=sm_count(dy.device))),
         lambda: (dh_ws_plain,), nothing),
        ("dh_plain", gemm, "row",
         lambda c: gather_gemm_with(c, dy, fc2, dh_plain, plan, transpose_weight=False, gather_a=True, n=h),
         lambda: (dh_plain,), nothing),
        ("fc2", gemm, "row",
         lambda c: gather_gemm_with(c, hid, fc2, expert_out, plan, transpose_weight=True, gather_a=False, n=d),
         lambda: (expert_out,), nothing),
        ("dh_act_bwd", gemm, "row_act_bwd",
         lambda c: gather_gemm_with(c, dy, fc2, h_scaled, plan, transpose_weight=False, epilogue=EPI_ACT_BWD,
                                 activation=activation, gather_a=True, pre=pre, probs_sorted=probs_sorted,
                                 ds_partial=ds, n=h, warp_specialize=False),
         lambda: (h_scaled, pre, ds.sum(1)), restore_pre),
        # dH in the warp-specialized Gluon kernel (Hopper), checked against the Triton kernel's.
        ("dh_ws", gemm, "gluon",
         lambda c: gather_gemm(dy, fc2, h_scaled_ws, plan, transpose_weight=False, epilogue=EPI_ACT_BWD,
                            activation=activation, gather_a=True, pre=pre, probs_sorted=probs_sorted,
                            ds_partial=ds, n=h, warp_specialize=True),
         lambda: (h_scaled_ws, pre, ds.sum(1)), restore_pre),
        ("dw2", gemm, "wgrad",
         lambda c: weight_grad_with(c, dy, h_scaled, dw2, plan, gather_a=True, gather_b=False),
         lambda: (dw2,), nothing),
        ("dw1", gemm1, "wgrad",
         lambda c: weight_grad_with(c, dpre, x, dw1, plan, gather_a=False, gather_b=True),
         lambda: (dw1,), nothing),
        # Diagnostic: dW1 with its x operand already in expert order (x_rows), no gather; the
        # difference to dw1 is what gathering the rows costs.
        ("dw1_contiguous", gemm1, "wgrad",
         lambda c: weight_grad_with(c, dpre, x_rows, dw1_contiguous, plan, gather_a=False, gather_b=False),
         lambda: (dw1_contiguous,), nothing),
        # Diagnostic: the same dW1 as a gather plus torch._grouped_mm, checked against the kernel's.
        ("dw1_grouped_mm", gemm1, "torch", grouped_mm_dw1, lambda: tuple(dw1_grouped), nothing),
        ("dw2_grouped_mm", gemm, "torch", grouped_mm_dw2, lambda: tuple(dw2_grouped), nothing),
        # Diagnostic: dW1 and dW2 with the expert-order operand through pointer loads (bitwise the
        # TMA form's result); the difference is what the descriptor buys.
        ("dw1_pointer", gemm1, "wgrad",
         lambda c: weight_grad_with(c, dpre, x, dw1_pointer, plan, gather_a=False, gather_b=True, tma=False),
         lambda: (dw1_pointer,), nothing),
        ("dw2_pointer", gemm, "wgrad",
         lambda c: weight_grad_with(c, dy, h_scaled, dw2_pointer, plan, gather_a=True, gather_b=False, tma=False),
         lambda: (dw2_pointer,), nothing),
        ("dx", gemm1, "row",
         lambda c: gather_gemm_with(c, dpre, fc1, grad_rows, plan, transpose_weight=False, gather_a=False, n=d),
         lambda: (grad_rows,), nothing),
        # Diagnostic: the gather GEMMs with the weight through pointer loads (bitwise the TMA form's
        # result); the difference is what the descriptor buys.
        ("fc1_act_pointer", gemm1, "row_glu" if activation == "swiglu" else "row",
         lambda c: gather_gemm_with(c, x, fc1, hid_pointer, plan, transpose_weight=True, epilogue=EPI_ACT_FWD,
                                 activation=activation, gather_a=True, pre=pre_pointer, n=h, tma_weight=False),
         lambda: (hid_pointer, pre_pointer), nothing),
        ("dh_act_bwd_pointer", gemm, "row_act_bwd",
         lambda c: gather_gemm_with(c, dy, fc2, h_scaled_pointer, plan, transpose_weight=False, epilogue=EPI_ACT_BWD,
                                 activation=activation, gather_a=True, pre=pre, probs_sorted=probs_sorted,
                                 ds_partial=ds, n=h, tma_weight=False),
         lambda: (h_scaled_pointer, pre, ds.sum(1)), restore_pre),
        ("dx_pointer", gemm1, "row",
         lambda c: gather_gemm_with(c, dpre, fc1, grad_rows_pointer, plan, transpose_weight=False, gather_a=False, n=d,
                                 tma_weight=False),
         lambda: (grad_rows_pointer,), nothing),
        # Diagnostic: fc2's and dX's rows in expert order (A and the output) through pointers
        # instead of ragged TMA descriptors (bitwise the same result).
        ("fc2_rows_pointer", gemm, "row",
         lambda c: gather_gemm_with(c, hid, fc2, fc2_rows_pointer, plan, transpose_weight=True, gather_a=False, n=d,
                                 tma_rows=False),
         lambda: (fc2_rows_pointer,), nothing),
        ("dx_rows_pointer", gemm1, "row",
         lambda c: gather_gemm_with(c, dpre, fc1, grad_rows_pointer, plan, transpose_weight=False, gather_a=False, n=d,
                                 tma_rows=False),
         lambda: (grad_rows_pointer,), nothing),
        # Diagnostic: fc2 and dX as torch._grouped_mm, checked against the kernel's.
        ("fc2_grouped_mm", gemm, "torch", *grouped_mm_rows("fc2", hid, fc2.transpose(1, 2)), nothing),
        ("dx_grouped_mm", gemm1, "torch", *grouped_mm_rows("dx", dpre, fc1), nothing),
    ], (x, fc1, rows)


def dense_rate(rows, d, n, reps, experts=None):
    """TFLOP/s of a dense bf16 [rows, d] @ [d, n] (n: fc1's output columns); with ``experts``, of
    dW1's problem in cuBLAS instead: rows split evenly over the experts, [n, rows/E] @ [rows/E, d]
    per expert, the left operand read transposed as the weight-gradient kernel reads it."""
    if experts is None:
        a = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(d, n, device="cuda", dtype=torch.bfloat16)
        return 2.0 * rows * d * n / time_op(lambda: torch.mm(a, b), lambda: None, reps) / 1e9
    r = rows // experts
    a = torch.randn(experts, r, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(experts, r, d, device="cuda", dtype=torch.bfloat16)
    return 2.0 * experts * r * d * n / time_op(lambda: torch.bmm(a.transpose(1, 2), b), lambda: None, reps) / 1e9


def energy_per_call(fn, reset, sampler, seconds):
    """The GPU's energy per call of ``fn`` (``nvml.PowerWindow``'s record, J in ``joules``) over a
    back-to-back loop of at least ``seconds``, ``reset()`` before each call: where ``reset`` is
    not ``nothing`` its own energy, from a loop of it alone, is taken out (``reset_joules``)."""

    def loop(body):
        torch.cuda.synchronize()
        with PowerWindow(sampler) as window:
            calls, t0 = 0, time.perf_counter()
            while calls < 3 or time.perf_counter() - t0 < seconds:
                body()
                calls += 1
                if calls % 8 == 0:  # a short queue: the loop's end is the GPU's
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            window.steps = calls
        return window.record()

    def both():
        reset()
        fn()

    rec = loop(both if reset is not nothing else fn)
    rec["joules"] = rec["joules_per_step"]
    if reset is not nothing:
        rec["reset_joules"] = loop(reset)["joules_per_step"]
        rec["joules"] -= rec["reset_joules"]
    return rec


def nothing():
    """The reset of an op that overwrites none of its inputs."""


def dense_energy(rows, d, n, sampler, seconds):
    """``energy_per_call`` of a dense bf16 [rows, d] @ [d, n] mm (fc1's FLOPs, cuBLAS), with its pJ/FLOP."""
    a = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(d, n, device="cuda", dtype=torch.bfloat16)
    rec = energy_per_call(lambda: torch.mm(a, b), nothing, sampler, seconds)
    rec["pj_per_flop"] = rec["joules"] / (2.0 * rows * d * n) * 1e12
    return rec


def _energy_text(e) -> str:
    """``12.31 mJ 1.21 pJ/FLOP at 690 W 1520 MHz`` of an energy record."""
    return (f"{1e3 * e['joules']:.2f} mJ {e['pj_per_flop']:.2f} pJ/FLOP at {e['mean_watts']:.0f} W "
            f"{e['mean_sm_mhz']:.0f} MHz")


def tune(shapes, ops_wanted, activation, reps, config_filters, time_limit, out=None, energy_seconds=0.0):
    """Every op of ``ops_wanted`` (names of layer_ops) at every shape of ``shapes`` (names or
    aliases) with the autotuner's pick and with each candidate config whose label contains one of
    ``config_filters``, printed as it goes; no new shape starts after ``time_limit`` seconds;
    ``out``: the folder of tune_kernels.json. Ends with the best config per op. With
    ``energy_seconds``, each op (as the layer launches it and at each candidate config) and a
    dense mm of fc1's size also get their energy per call through NVML (``energy_per_call`` over
    loops that long)."""
    t_start = time.time()
    records, best = [], {}
    wanted = set(ops_wanted)
    sampler = None
    if energy_seconds > 0:
        sampler, why_not = optional_sampler(torch.cuda.current_device())
        if sampler is None:
            sys.exit(f"--energy-seconds: {why_not}")
    for shape in shapes:
        if time.time() - t_start > time_limit:
            print(f"time limit reached; skipping {shape}", flush=True)
            continue
        T, d, h, E, K = CONFIGS[config_name(shape)]
        plan, references, ops, (_, fc1, rows) = layer_ops(T, d, h, E, K, seed=len(records) + 1,
                                                          activation=activation)
        peak = dense_rate(rows, d, fc1.shape[1], reps)
        wgrad_bmm = dense_rate(rows, d, fc1.shape[1], reps, experts=E)
        print(f"== {shape} {activation} T={T} d={d} h={h} E={E} K={K}: dense bf16 mm {peak:.0f} TFLOP/s; dW1 as a cuBLAS "
              f"batched mm (even split, transposed operand) {wgrad_bmm:.0f}", flush=True)
        if sampler is not None:
            rec = dict(shape=shape, activation=activation, op="dense_mm", config="torch", T=T, d=d, h=h, E=E, K=K,
                       energy=dense_energy(rows, d, fc1.shape[1], sampler, energy_seconds))
            records.append(rec)
            print(f"  {'dense_mm':14s} {'torch':24s} {_energy_text(rec['energy'])}", flush=True)
        hopper = on_hopper(torch.cuda.get_device_capability())
        for name, flops, kind, launch, outputs, reset in ops:
            if name not in wanted:
                continue
            if kind == "gluon" and not hopper:
                print(f"  {name:14s} skipped: the warp-specialized kernel runs on Hopper only", flush=True)
                continue
            reset()
            launch(None)  # the autotuned launch is the reference result, unless another op's is
            ref = list(references.get(name, ())) or [t.clone() for t in outputs()]
            if kind in ("torch", "gluon"):
                picked = kind
            else:
                # Once more through Triton's launch path: the autotuner's best_config then names this
                # launch's config (a direct launch leaves it at whichever ran through Triton last).
                reset()
                SETTINGS.direct_launch = False
                try:
                    launch(None)
                finally:
                    SETTINGS.direct_launch = True
                picked = config_label((weight_grad_kernel if kind == "wgrad" else gather_gemm_kernel).best_config)
            if kind in ("torch", "gluon"):
                candidates = []
            elif kind == "wgrad":
                candidates = [wgrad_config(*c) for c in WGRAD_CONFIGS]
            else:  # the SwiGLU forward runs at most 128 columns (256 of weight)
                candidates = [row_config(*c) for c in ROW_CONFIGS if kind != "row_glu" or c[1] <= 128]
            candidates = [c for c in candidates if any(f in config_label(c) for f in config_filters)]
            # The autotuned launch itself, timed like the candidates, for comparison.
            for cfg in [None] + candidates:
                label = picked if kind in ("torch", "gluon") else "autotuned" if cfg is None else config_label(cfg)
                rec = dict(shape=shape, activation=activation, op=name, config=label, T=T, d=d, h=h, E=E, K=K,
                           dense_tflops=peak, wgrad_bmm_tflops=wgrad_bmm)
                if cfg is None:
                    rec["picked"] = picked
                try:
                    # Poison what the launch must overwrite (dH's pre is its input: reset restores it).
                    for t in outputs()[:1] if name.startswith(("dh_act_bwd", "dh_ws")) else outputs():
                        t.fill_(float("nan"))
                    reset()
                    launch(cfg)
                    err = max(rel_err(o, r) for o, r in zip(outputs(), ref))
                    ms = time_op(lambda: launch(cfg), reset, reps)
                    rec.update(ms=ms, tflops=flops / ms / 1e9, err=err, ok=err < 2e-2)
                    if sampler is not None:
                        # Each config's too: on a power-capped GPU the step pays energy, not ms.
                        rec["energy"] = energy_per_call(lambda: launch(cfg), reset, sampler, energy_seconds)
                        rec["energy"]["pj_per_flop"] = rec["energy"]["joules"] / flops * 1e12
                except Exception as exc:  # out of shared memory or registers: recorded, not fatal
                    rec.update(ms=None, tflops=None, err=None, ok=False, error=f"{type(exc).__name__}: {str(exc)[:120]}")
                    reset()
                    launch(None)  # the poisoned outputs feed the next op

                records.append(rec)
                previous = best.get((shape, name))
                if (cfg is not None or kind in ("torch", "gluon")) and rec["ok"] and (previous is None or rec["ms"] < previous["ms"]):
                    best[(shape, name)] = rec
                status = f"{rec['ms']:.3f} ms {rec['tflops']:.0f} TF/s err {rec['err']:.1e}" if rec["ms"] else rec["error"]
                if rec.get("energy"):
                    status += "  " + _energy_text(rec["energy"])
                shown = label if cfg or kind in ("torch", "gluon") else "autotuned " + picked
                print(f"  {name:14s} {shown:24s} {status}", flush=True)
        del plan, ops, references, fc1
        torch.cuda.empty_cache()
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, command="python " + " ".join(sys.argv))
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "tune_kernels.json"), "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)
    print("\nbest per op (ms, TFLOP/s, % of dense mm), and the autotuner's pick:")
    tuned = {(r["shape"], r["op"]): r for r in records if r["config"] == "autotuned"}
    for (shape, name), r in best.items():
        t = tuned.get((shape, name), {})
        pick = f"{t['ms']:8.3f} {t['picked']}" if t.get("ms") else "-"
        print(f"{shape:6s} {name:10s} {r['config']:24s} {r['ms']:8.3f} {r['tflops']:5.0f} "
              f"{100 * r['tflops'] / r['dense_tflops']:4.0f}%  autotuned {pick}")
