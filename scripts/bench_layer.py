"""One MoE layer, forward and forward+backward, routing given: moeblaze against its peers.

Runs on one GPU. For each configuration and activation it first checks every implementation's
output and gradients against a float64 reference (at a reduced token count, same d/h/E/K), then
times the full shape with CUDA events (median, under sustained load: see cuda_time), and records
the bytes saved for backward (parameters excluded) and the peak memory above inputs, weights and
their gradients.

    python scripts/bench_layer.py --out benchmarks/results            # every config, every peer
    python scripts/bench_layer.py --configs conf4,qwen3 --acts swiglu --impls moeblaze,grouped_mm

Peers (each skipped with a note when not importable): grouped_mm (torch._grouped_mm pipeline, as
torchtitan does it), megatron_sequential (Megatron-Core alltoall dispatcher + SequentialMLP),
megablocks (dMoE, grouped path), liger (Liger-Kernel's fused MoE), scattermoe.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# Liger's fused MoE autotunes over many configs on every new shape, which would dominate this
# run; DESIGN.md measured it with autotuning off too.
os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moeblaze_megatron import build_routing_plan, moe_mlp  # noqa: E402
from moeblaze_megatron.audit import saved_bytes_for_backward  # noqa: E402
from moeblaze_megatron.kernels.expert_gemm import autotune_picks  # noqa: E402
from moeblaze_megatron.reference import ReferenceMoEMLP  # noqa: E402

# (T, d, h, E, K). conf3 and conf4 are the MoEBlaze paper's published configs (T = batch * seq as
# DESIGN.md measured them); the paper does not publish conf1's T nor conf2/5/6/7 at all: those are
# filled from its stated ranges (d in {512,1024,2048}, E in {4,8,16}, k in {1,2,4}, B in {16,32},
# L in {512,1024,2048}, h = 4d) and labelled "filled".
CONFIGS = {
    "conf1": (16 * 512, 512, 2048, 4, 1),
    "conf2(filled)": (16 * 1024, 512, 2048, 8, 2),
    "conf3": (16 * 1024, 1024, 4096, 16, 4),
    "conf4": (32 * 1024, 2048, 8192, 16, 4),
    "conf5(filled)": (32 * 1024, 1024, 4096, 8, 2),
    "conf6(filled)": (16 * 2048, 2048, 8192, 8, 2),
    "conf7(filled)": (32 * 2048, 512, 2048, 16, 4),
    "qwen3-30b-like": (32768, 2048, 768, 128, 8),
    "7b-fine-grained": (24576, 1536, 256, 128, 8),
    "dsv3-like": (8192, 7168, 2048, 256, 8),
}
ALIASES = {"conf2": "conf2(filled)", "conf5": "conf5(filled)", "conf6": "conf6(filled)",
           "conf7": "conf7(filled)", "qwen3": "qwen3-30b-like", "7b": "7b-fine-grained", "dsv3": "dsv3-like"}
# Environment variables that change what moeblaze runs; recorded with the results.
ENV_KNOBS = ("MOEBLAZE_AUTOTUNE", "MOEBLAZE_DIRECT_LAUNCH", "TRITON_CACHE_AUTOTUNING")
IMPLS = ("moeblaze", "moeblaze_fc1", "grouped_mm", "megatron_sequential", "megablocks", "liger", "scattermoe")
CHECK_TOKENS = 2048
SPIN_CYCLES = 40_000_000  # torch.cuda._sleep cycles before a queued step: ~20 ms at the H200's 1.98 GHz
# An illegal memory access kills the whole process, so a peer known to crash on a shape is skipped.
KNOWN_CRASHES = {("dsv3-like", "scattermoe"): "skipped: died with an illegal memory access on this "
                 "shape when measured for DESIGN.md (2026-11-29); an IMA would end this whole run"}


def flops_fwdbwd(T, d, h, K, activation):
    # fc1 is 2h wide for SwiGLU: 6 GEMM passes of T*K*d*h*2 FLOPs (fwd 2, bwd 4) per projection.
    return (18 if activation == "swiglu" else 12) * T * K * d * h


# ----------------------------------------------------------------------------------------------
# Implementations: each maps (x, topk_ids, topk_probs) -> y and owns its parameters.


class Impl:
    name = ""

    def __init__(self, fc1, fc2, activation, num_experts, topk):
        self.activation = activation
        self.E, self.K = num_experts, topk

    def params(self):
        raise NotImplementedError

    def __call__(self, x, ids, probs):
        raise NotImplementedError


class MoEBlaze(Impl):
    name = "moeblaze"
    recompute = "activation"

    def __init__(self, fc1, fc2, activation, num_experts, topk):
        super().__init__(fc1, fc2, activation, num_experts, topk)
        self.fc1 = fc1.detach().clone().requires_grad_()
        self.fc2 = fc2.detach().clone().requires_grad_()

    def params(self):
        return [self.fc1, self.fc2]

    def __call__(self, x, ids, probs):
        # The ids come from a top-k, as in Megatron, whose dispatcher skips the id check (and its
        # host synchronization) the same way; no peer checks them either.
        return moe_mlp(x, ids, probs, self.fc1, self.fc2, self.activation, recompute=self.recompute, validate=False)


class MoEBlazeFc1(MoEBlaze):
    name = "moeblaze_fc1"
    recompute = "fc1"


class GroupedMM(Impl):
    """Sort, gather, grouped_mm, activation, grouped_mm, weighted index_add (torchtitan's recipe)."""

    name = "grouped_mm"

    def __init__(self, fc1, fc2, activation, num_experts, topk):
        super().__init__(fc1, fc2, activation, num_experts, topk)
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError("torch._grouped_mm is not available in this torch")
        self.w1 = fc1.detach().transpose(1, 2).contiguous().requires_grad_()  # [E, d, 2h]
        self.w2 = fc2.detach().transpose(1, 2).contiguous().requires_grad_()  # [E, h, d]

    def params(self):
        return [self.w1, self.w2]

    def __call__(self, x, ids, probs):
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // self.K
        offs = torch.bincount(flat, minlength=self.E).cumsum(0).to(torch.int32)
        xs = x[tokens]
        a = torch._grouped_mm(xs, self.w1, offs=offs)
        if self.activation == "swiglu":
            gate, up = a.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = F.silu(a) if self.activation == "silu" else F.gelu(a)
        o = torch._grouped_mm(a, self.w2, offs=offs)
        o = o * probs.reshape(-1)[order, None].to(o.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, o)


class MegatronSequential(Impl):
    """Megatron-Core's MoELayer stages (alltoall dispatcher + SequentialMLP), routing given."""

    name = "megatron_sequential"

    def __init__(self, fc1, fc2, activation, num_experts, topk):
        super().__init__(fc1, fc2, activation, num_experts, topk)
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import ModuleSpec, build_module
        from megatron.core.transformer.transformer_config import TransformerConfig

        if not torch.distributed.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            torch.distributed.init_process_group("nccl" if fc1.is_cuda else "gloo", rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel()
        E, h2, d = fc1.shape
        h = fc2.shape[2]
        config = TransformerConfig(
            num_layers=1, hidden_size=d, ffn_hidden_size=h, moe_ffn_hidden_size=h,
            num_attention_heads=8, num_moe_experts=E, moe_router_topk=topk,
            moe_token_dispatcher_type="alltoall", gated_linear_unit=activation == "swiglu",
            activation_func=F.gelu if activation == "gelu" else F.silu, add_bias_linear=False,
            bf16=fc1.dtype == torch.bfloat16, params_dtype=fc1.dtype, moe_aux_loss_coeff=0.0,
            use_cpu_initialization=True, perform_initialization=False,
        )
        spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False).submodules.mlp
        # megatron-core 0.19 writes submodule specs as functools.partial, older ones as ModuleSpec.
        layer = build_module(spec, config=config) if isinstance(spec, ModuleSpec) else spec(config=config)
        self.layer = layer.to(fc1.device)
        with torch.no_grad():
            for e, expert in enumerate(self.layer.experts.local_experts):
                expert.linear_fc1.weight.copy_(fc1[e])
                expert.linear_fc2.weight.copy_(fc2[e])

    def params(self):
        return [p for p in self.layer.experts.parameters()]

    def __call__(self, x, ids, probs):
        T = x.shape[0]
        routing_map = torch.zeros(T, self.E, dtype=torch.bool, device=x.device)
        routing_map.scatter_(1, ids, True)
        dense_probs = torch.zeros(T, self.E, dtype=probs.dtype, device=x.device).scatter(1, ids, probs)
        layer = self.layer
        hidden, p = layer.preprocess(x.view(T, 1, -1), dense_probs, routing_map)
        hidden, p = layer.dispatch(hidden, p)
        out, _ = layer.routed_experts_compute(hidden, p)
        out = layer.combine(out)
        return layer.postprocess(out, None).view(T, -1)


class MegaBlocks(Impl):
    name = "megablocks"

    def __init__(self, fc1, fc2, activation, num_experts, topk):
        super().__init__(fc1, fc2, activation, num_experts, topk)
        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import ParallelDroplessMLP

        E, h2, d = fc1.shape
        h = fc2.shape[2]
        glu = activation == "swiglu"
        args = Arguments(
            hidden_size=d, ffn_hidden_size=h, moe_num_experts=E, moe_top_k=topk, bias=False,
            return_bias=False, mlp_impl="grouped", mlp_type="glu" if glu else "mlp",
            activation_fn=F.gelu if activation == "gelu" else F.silu, bf16=fc1.dtype == torch.bfloat16,
            moe_loss_weight=0.0, device=fc1.device,
        )
        # Its grouped GEMM wants bf16 weights; the layer is built in float32 whatever args.bf16 says.
        self.mlp = ParallelDroplessMLP(args).to(device=fc1.device, dtype=fc1.dtype)
        with torch.no_grad():
            m = self.mlp.mlp
            m.w1.copy_(fc1[:, :h].reshape(E * h, d))
            if glu:
                m.v1.copy_(fc1[:, h:].reshape(E * h, d))
            m.w2.copy_(fc2.transpose(1, 2).reshape(E * h, d))

    def params(self):
        return [p for p in self.mlp.parameters()]

    def __call__(self, x, ids, probs):
        T = x.shape[0]
        scores = torch.zeros(T, self.E, dtype=probs.dtype, device=x.device)  # only used by its aux loss
        out = self.mlp(x.view(T, 1, -1), scores, probs.to(x.dtype), ids)
        return (out[0] if isinstance(out, tuple) else out).view(T, -1)


class Liger(Impl):
    name = "liger"

    def __init__(self, fc1, fc2, activation, num_experts, topk):
        super().__init__(fc1, fc2, activation, num_experts, topk)
        if activation != "swiglu":
            raise RuntimeError("Liger-Kernel's fused MoE is SwiGLU only")
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        self.fn = LigerFusedMoEFunction
        self.fc1 = fc1.detach().clone().requires_grad_()
        self.fc2 = fc2.detach().clone().requires_grad_()

    def params(self):
        return [self.fc1, self.fc2]

    def __call__(self, x, ids, probs):
        return self.fn.apply(x, self.fc1, self.fc2, ids.to(torch.int32), probs.to(x.dtype))


class ScatterMoE(Impl):
    name = "scattermoe"

    def __init__(self, fc1, fc2, activation, num_experts, topk):
        super().__init__(fc1, fc2, activation, num_experts, topk)
        import scattermoe.mlp as smlp

        E, h2, d = fc1.shape
        h = fc2.shape[2]
        act = torch.nn.GELU() if activation == "gelu" else torch.nn.SiLU()
        if activation == "swiglu":
            self.mlp = smlp.GLUMLP(d, h, E, topk, activation=act)
            # ScatterMoE's GLU is [up | gate].
            first = torch.cat([fc1[:, h:], fc1[:, :h]], dim=1)
        else:
            self.mlp = smlp.MLP(d, h, E, topk, activation=act)
            first = fc1
        self.mlp = self.mlp.to(device=fc1.device, dtype=fc1.dtype)
        with torch.no_grad():
            self.mlp.experts.weight.copy_(first)
            self.mlp.output_experts.weight.copy_(fc2)

    def params(self):
        return [p for p in self.mlp.parameters()]

    def __call__(self, x, ids, probs):
        return self.mlp(x, probs.to(x.dtype), ids)


IMPL_CLASSES = {c.name: c for c in (MoEBlaze, MoEBlazeFc1, GroupedMM, MegatronSequential, MegaBlocks, Liger, ScatterMoE)}


# ----------------------------------------------------------------------------------------------
# Inputs, checks and measurements


def make_inputs(T, d, h, E, K, activation, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, d, device=device, dtype=dtype, generator=g)
    logits = torch.randn(T, E, device=device, generator=g)
    top, ids = logits.topk(K, dim=1)
    probs = torch.softmax(top, dim=1)
    rows = 2 * h if activation == "swiglu" else h
    fc1 = (torch.randn(E, rows, d, device=device, generator=g) / math.sqrt(d)).to(dtype)
    fc2 = (torch.randn(E, d, h, device=device, generator=g) / math.sqrt(h)).to(dtype)
    return x, ids, probs, fc1, fc2


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def map_grads(impl, grads):
    """An implementation's parameter gradients, mapped back to [E, 2h|h, d] / [E, d, h]."""
    p = grads
    if isinstance(impl, (MoEBlaze, Liger)):
        return p[0], p[1]
    if isinstance(impl, GroupedMM):
        return p[0].transpose(1, 2), p[1].transpose(1, 2)
    if isinstance(impl, MegatronSequential):
        experts = impl.layer.experts.local_experts
        return (torch.stack([e.linear_fc1.weight.grad for e in experts]),
                torch.stack([e.linear_fc2.weight.grad for e in experts]))
    if isinstance(impl, MegaBlocks):
        m = impl.mlp.mlp
        E = impl.E
        w1 = m.w1.grad.view(E, -1, m.w1.shape[1])
        fc1 = torch.cat([w1, m.v1.grad.view(E, -1, m.w1.shape[1])], dim=1) if impl.activation == "swiglu" else w1
        return fc1, m.w2.grad.view(E, -1, m.w2.shape[1]).transpose(1, 2)
    if isinstance(impl, ScatterMoE):
        g1 = impl.mlp.experts.weight.grad
        if impl.activation == "swiglu":
            h = g1.shape[1] // 2
            g1 = torch.cat([g1[:, h:], g1[:, :h]], dim=1)
        return g1, impl.mlp.output_experts.weight.grad
    raise TypeError(type(impl))


def check_impl(cls, T, d, h, E, K, activation, dtype, device, seed):
    """Relative errors of y, dx, dprobs, dfc1, dfc2 against a float64 reference."""
    x, ids, probs, fc1, fc2 = make_inputs(T, d, h, E, K, activation, dtype, device, seed)
    gy = torch.randn(T, d, device=device, dtype=dtype)
    ref_in = [t.double().requires_grad_() for t in (x, probs, fc1, fc2)]
    plan = build_routing_plan(ids, E, method="torch")
    y_ref = ReferenceMoEMLP.apply(ref_in[0], ref_in[1], ref_in[2], ref_in[3], plan, activation, "activation")
    y_ref.backward(gy.double())
    impl = cls(fc1, fc2, activation, E, K)
    xi = x.clone().requires_grad_()
    pi = probs.clone().requires_grad_()
    y = impl(xi, ids, pi)
    y.backward(gy)
    g1, g2 = map_grads(impl, [p.grad for p in impl.params()])
    errs = {
        "y": rel_err(y, y_ref), "dx": rel_err(xi.grad, ref_in[0].grad),
        "dprobs": rel_err(pi.grad, ref_in[1].grad) if pi.grad is not None else float("nan"),
        "dfc1": rel_err(g1, ref_in[2].grad), "dfc2": rel_err(g2, ref_in[3].grad),
    }
    return errs


def cuda_time(fn, warmup, reps, queued=False, warmup_s=0.0, min_s=0.0):
    """Median ms between CUDA events around ``fn``, and the median host ms ``fn`` took to return
    (its launches; past the GPU time the host, not the GPU, sets the pace). Warm-up: ``warmup``
    calls and at least ``warmup_s`` seconds; then ``reps`` timed calls, more until ``min_s``
    seconds have passed. A long enough loop times the GPU in the clock and power state it holds
    under sustained load (a power-capped H200 runs the large shapes at a lower clock than it
    starts them at) rather than in whatever state the previous measurement left. ``queued``: the
    GPU first spins for ~20 ms, so ``fn``'s launches queue up behind it and the time excludes
    every wait on the host (as inside a model, where earlier layers keep the GPU busy); the spin
    also lets the GPU rest before every call, so compare queued times only with each other."""
    t0 = time.perf_counter()
    done = 0
    while done < warmup or time.perf_counter() - t0 < warmup_s:
        fn()
        torch.cuda.synchronize()
        done += 1
    times, host = [], []
    t0 = time.perf_counter()
    while len(times) < reps or time.perf_counter() - t0 < min_s:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        t1 = time.perf_counter()
        fn()
        host.append(1e3 * (time.perf_counter() - t1))
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), statistics.median(host)


def matmul_rates(device, warmup_s, min_s, n=8192, reps=20, batch=32):
    """Dense bf16 n^3 matmul TFLOP/s, twice: a burst (5 warm-up and ``reps`` timed products, the
    rate a cool GPU starts at) and sustained (``batch`` products per timed call, ~50 ms like a
    large layer step, timed as the layer steps are: ``warmup_s`` then at least ``min_s``)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    burst = cuda_time(lambda: a @ b, 5, reps)[0]

    def products():
        for _ in range(batch):
            torch.mm(a, b)

    sustained = cuda_time(products, 1, reps, warmup_s=warmup_s, min_s=min_s)[0] / batch
    return 2 * n**3 / burst / 1e9, 2 * n**3 / sustained / 1e9


def measure(cls, T, d, h, E, K, activation, dtype, device, seed, reps, warmup_s=0.0, min_s=0.0):
    x, ids, probs, fc1, fc2 = make_inputs(T, d, h, E, K, activation, dtype, device, seed)
    impl = cls(fc1, fc2, activation, E, K)
    del fc1, fc2
    params = impl.params()
    xi = x.clone().requires_grad_()
    pi = probs.clone().requires_grad_()
    gy = torch.randn_like(x)
    t0 = time.perf_counter()
    impl(xi, ids, pi).backward(gy)  # first call: compilation and autotuning
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0

    def fwd():
        with torch.no_grad():
            impl(x, ids, probs)

    leaves = params + [xi, pi]

    def fwdbwd():
        # As optimizer.zero_grad(set_to_none=True) does: no gradient accumulation is timed.
        for t in leaves:
            t.grad = None
        impl(xi, ids, pi).backward(gy)

    ms_fwd = cuda_time(fwd, 2, reps, warmup_s=warmup_s / 2, min_s=min_s / 2)[0]
    ms_fwdbwd, host_ms_fwdbwd = cuda_time(fwdbwd, 2, reps, warmup_s=warmup_s, min_s=min_s)
    ms_fwdbwd_queued = cuda_time(fwdbwd, 1, reps, queued=True, min_s=min_s / 2)[0]
    # Peak above inputs, weights and their gradients: the gradients' own bytes are taken out.
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y, nbytes = saved_bytes_for_backward(lambda: impl(xi, ids, pi), params)
    y.backward(gy)
    torch.cuda.synchronize()
    grad_bytes = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
    peak = torch.cuda.max_memory_allocated() - base - grad_bytes
    return dict(ms_fwd=ms_fwd, ms_fwdbwd=ms_fwdbwd, host_ms_fwdbwd=host_ms_fwdbwd, ms_fwdbwd_queued=ms_fwdbwd_queued,
                saved_bytes=nbytes, peak_bytes=peak,
                first_call_s=first_call_s)


def layer_steps(cls, T, d, h, E, K, activation, dtype, device):
    """``steps(n)``: n forward+backward passes of a fresh layer (gradients set to None first, as
    in the timed loop), then a synchronization."""
    x, ids, probs, fc1, fc2 = make_inputs(T, d, h, E, K, activation, dtype, device, 3)
    impl = cls(fc1, fc2, activation, E, K)
    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    gy = torch.randn_like(x)
    leaves = impl.params() + [xi, pi]

    def steps(n):
        for _ in range(n):
            for t in leaves:
                t.grad = None
            impl(xi, ids, pi).backward(gy)
        torch.cuda.synchronize()

    return steps


def profile_kernels(cls, T, d, h, E, K, activation, dtype, device, iters=3, queued=False, steps=None):
    """CUDA ms per kernel name per forward+backward (after warm-up, gradients set to None as in
    the timed loop), and the timeline of the last one: its span from the first kernel's start to
    the last one's end, the time no kernel ran, and the longest idle gaps with their neighbours
    (host launch overhead and synchronizations show there). ``queued``: each step behind the
    spin of cuda_time's queued mode (the spin itself not counted); ``steps``: a layer_steps of
    these arguments to reuse."""
    steps = steps or layer_steps(cls, T, d, h, E, K, activation, dtype, device)
    steps(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        # Each from an idle GPU, as in the timed loop, or behind a spin.
        for _ in range(iters):
            if queued:
                torch.cuda._sleep(SPIN_CYCLES)
            steps(1)
    kernels = sorted(
        ((ev.time_range.start, ev.time_range.end, ev.name[:40]) for ev in prof.events()
         if ev.device_type == torch.autograd.DeviceType.CUDA and not ev.name.startswith("spin_kernel")),
    )
    totals = {}
    for start, end, name in kernels:
        totals[name] = totals.get(name, 0.0) + (end - start) / 1e3 / iters
    # The last iteration (every iteration launches the same kernels).
    per_iter = len(kernels) // iters
    last = kernels[-per_iter:] if per_iter else []
    gaps = []
    busy_end = last[0][1] if last else 0
    for prev, cur in zip(last, last[1:]):
        busy_end = max(busy_end, prev[1])
        if cur[0] > busy_end:
            gaps.append((cur[0] - busy_end, prev[2], cur[2]))
    idle = sum(g[0] for g in gaps) / 1e3
    span = (max(k[1] for k in last) - last[0][0]) / 1e3 if last else 0.0
    return dict(
        kernels=dict(sorted(totals.items(), key=lambda kv: -kv[1])[:12]),
        span_ms=span, idle_ms=idle, launches=per_iter,
        gaps=[f"{g / 1e3:.3f} ms: {a} -> {b}" for g, a, b in sorted(gaps, reverse=True)[:6]],
    )


def host_profile(cls, T, d, h, E, K, activation, dtype, device, iters=20, top=14):
    """Where the host's time goes in forward+backward (cProfile over ``iters`` steps): the
    functions with the most own time, as "ms per step  calls per step  name"."""
    import cProfile
    import pstats

    steps = layer_steps(cls, T, d, h, E, K, activation, dtype, device)
    steps(2)
    profiler = cProfile.Profile()
    profiler.enable()
    steps(iters)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(((tt, nc, f"{os.path.basename(fn)}:{line}({name})") for (fn, line, name), (_, nc, tt, _, _) in stats.items()),
                  reverse=True)[:top]
    return [f"{1e3 * tt / iters:.3f} ms  {nc / iters:.0f}x  {name}" for tt, nc, name in rows]


def tensor_core_report():
    """Which matrix instructions each compiled moeblaze kernel uses (wgmma is Hopper's fast path;
    mma.sync alone means the kernel runs on the older, slower path). The configs the autotuner
    picked are in each moeblaze record (``autotune_picks``)."""
    from moeblaze_megatron.kernels import expert_gemm

    report = {}
    for name in ("_row_gemm_kernel", "_weight_grad_kernel"):
        fn = getattr(expert_gemm, name).fn
        for cache in getattr(fn, "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for kernel in kernels.values():
                ptx = kernel.asm.get("ptx", "")
                kind = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "none")
                key = f"{name}:{kind}"
                report[key] = report.get(key, 0) + 1
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma list (aliases: conf2, qwen3, 7b, dsv3, ...)")
    parser.add_argument("--acts", default="swiglu,silu", help="comma list of swiglu, silu, gelu")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement at least (median)")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="fwd+bwd: timed for at least this long (fwd and queued: half), after --warmup-seconds")
    parser.add_argument("--warmup-seconds", type=float, default=1.0,
                        help="fwd+bwd: run this long before timing, so the GPU's clock settles under the load (fwd: half)")
    parser.add_argument("--check-tokens", type=int, default=CHECK_TOKENS)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--tag", default="bench_layer")
    parser.add_argument("--profile", action="store_true", help="profile moeblaze: CUDA time per kernel, idle gaps between kernels")
    parser.add_argument("--report-only", metavar="JSON", help="rewrite the markdown table and the charts of a saved run")
    args = parser.parse_args(argv)
    if args.report_only:
        with open(args.report_only) as f:
            saved = json.load(f)
        write_report(saved["meta"], saved["notes"], saved["records"], os.path.dirname(args.report_only) or ".",
                     os.path.splitext(os.path.basename(args.report_only))[0])
        return
    if args.seconds < 0 or args.warmup_seconds < 0:
        sys.exit(f"--seconds and --warmup-seconds must be >= 0, got {args.seconds} and {args.warmup_seconds}")
    if args.reps < 1:
        sys.exit(f"--reps must be at least 1 (timed steps per measurement), got {args.reps}")
    if not torch.cuda.is_available():
        sys.exit("bench_layer.py needs a CUDA GPU")
    device = torch.device("cuda")
    dtype = torch.bfloat16
    configs = [ALIASES.get(c, c) for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown --configs {unknown}; known: {list(CONFIGS)}")
    impls = args.impls.split(",")
    acts = args.acts.split(",")
    os.makedirs(args.out, exist_ok=True)
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python " + " ".join(sys.argv),
                env={k: os.environ[k] for k in ENV_KNOBS if k in os.environ},
                timing=dict(min_reps=args.reps, seconds=args.seconds, warmup_seconds=args.warmup_seconds))
    started = time.perf_counter()
    peak, sustained = matmul_rates(device, args.warmup_seconds, args.seconds)
    meta["matmul_peak_tflops"], meta["matmul_sustained_tflops"] = peak, sustained
    print(f"{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  dense bf16 matmul {peak:.0f} TFLOP/s "
          f"(burst), {sustained:.0f} sustained", flush=True)
    records, notes = [], []
    available = {}
    for name in impls:
        try:
            E0 = 4
            IMPL_CLASSES[name](*make_inputs(8, 64, 64, E0, 2, "swiglu", dtype, device, 0)[3:], "swiglu", E0, 2)
            available[name] = IMPL_CLASSES[name]
        except Exception as exc:  # a peer that is not importable is reported, not fatal
            notes.append(f"{name}: not run ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
            print(notes[-1], flush=True)
    for cfg in configs:
        T, d, h, E, K = CONFIGS[cfg]
        for act in acts:
            for name, cls in available.items():
                rec = dict(meta, config=cfg, T=T, d=d, h=h, E=E, K=K, activation=act, impl=name)
                try:
                    if (cfg, name) in KNOWN_CRASHES:
                        raise RuntimeError(KNOWN_CRASHES[cfg, name])
                    if not args.no_check:
                        # float64 reference at reduced T and E (same d, h, K): dsv3-like's full
                        # float64 weights alone would take 90 GB.
                        e_chk = min(E, 32)
                        errs = check_impl(cls, min(T, args.check_tokens), d, h, e_chk, min(K, e_chk), act, dtype, device, 1)
                        rec["check"] = errs
                        worst = max(v for v in errs.values() if not math.isnan(v))
                        rec["check_ok"] = worst < 3e-2
                    tuned_before = set(autotune_picks()) if name.startswith("moeblaze") else set()
                    rec.update(measure(cls, T, d, h, E, K, act, dtype, device, 2, args.reps, args.warmup_seconds,
                                       args.seconds))
                    if name.startswith("moeblaze"):
                        rec["autotune_picks"] = {k: v for k, v in autotune_picks().items() if k not in tuned_before}
                    rec["tflops"] = flops_fwdbwd(T, d, h, K, act) / rec["ms_fwdbwd"] / 1e9
                    rec["pct_of_matmul"] = 100 * rec["tflops"] / peak
                    rec["pct_of_sustained_matmul"] = 100 * rec["tflops"] / sustained
                    rec["floor_bytes"] = 2 * T * d + (4 if act == "swiglu" else 2) * T * K * h
                except Exception as exc:
                    msg = str(exc).splitlines()[0][:200] if str(exc) else ""
                    rec["error"] = f"{type(exc).__name__}: {msg}"
                    if "out of memory" in msg.lower():
                        rec["error"] = "OOM"
                records.append(rec)
                # Written after every record: a run cut short by its time limit keeps what it measured.
                with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
                    json.dump(dict(meta=meta, notes=notes, records=records), f, indent=1)
                torch.cuda.empty_cache()
                if args.profile and name.startswith("moeblaze") and "error" not in rec:
                    rec["profile"] = profile_kernels(cls, T, d, h, E, K, act, dtype, device)
                    prof = rec["profile"]
                    print("   " + "  ".join(f"{k}={v:.2f}" for k, v in prof["kernels"].items()), flush=True)
                    print(f"   timeline: {prof['launches']} kernels, span {prof['span_ms']:.2f} ms, idle "
                          f"{prof['idle_ms']:.2f} ms; longest gaps: {prof['gaps']}", flush=True)
                    prof["host"] = host_profile(cls, T, d, h, E, K, act, dtype, device)
                    print("   host, own time per step:\n     " + "\n     ".join(prof["host"]), flush=True)
                status = rec.get("error") or (
                    f"fwd {rec['ms_fwd']:.2f} ms  fwd+bwd {rec['ms_fwdbwd']:.2f} ms (host {rec['host_ms_fwdbwd']:.2f}, "
                    f"queued {rec['ms_fwdbwd_queued']:.2f})  "
                    f"{rec['tflops']:.0f} TF/s "
                    f"saved {rec['saved_bytes'] / 2**20:.0f} MiB peak {rec['peak_bytes'] / 2**20:.0f} MiB "
                    f"first {rec['first_call_s']:.1f}s check {'ok' if rec.get('check_ok', True) else 'FAIL ' + str(rec['check'])}")
                print(f"[{time.perf_counter() - started:5.0f}s] {cfg:16s} {act:6s} {name:20s} {status}", flush=True)
                if rec.get("autotune_picks"):
                    print("   autotuner picks: " + "  ".join(rec["autotune_picks"].values()), flush=True)
    if args.profile:
        try:
            meta["tensor_core_report"] = tensor_core_report()
        except Exception as exc:  # introspection of Triton internals is best effort
            meta["tensor_core_report"] = f"unavailable: {exc}"
        print("compiled moeblaze kernels by matrix instruction:", meta["tensor_core_report"], flush=True)
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump(dict(meta=meta, notes=notes, records=records), f, indent=1)
    write_report(meta, notes, records, args.out, args.tag)


def write_report(meta, notes, records, out, tag):
    table = markdown_table(meta, notes, records)
    with open(os.path.join(out, f"{tag}.md"), "w") as f:
        f.write(table)
    try:
        plot(records, os.path.join(out, f"{tag}.png"))
    except ImportError:
        print("matplotlib is not installed: no chart", flush=True)
    print(table)


def plot(records, path):
    """Speedup over the best peer and bytes saved for backward, per config, as the paper's figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "error" not in r]
    acts = sorted({r["activation"] for r in ok})
    fig, axes = plt.subplots(2, len(acts), figsize=(7 * len(acts), 8), squeeze=False)
    for col, act in enumerate(acts):
        recs = [r for r in ok if r["activation"] == act]
        configs = list(dict.fromkeys(r["config"] for r in recs))
        impls = list(dict.fromkeys(r["impl"] for r in recs))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            speed, mem = [], []
            for cfg in configs:
                group = [r for r in recs if r["config"] == cfg]
                mine = next((r for r in group if r["impl"] == impl), None)
                base = next((r for r in group if r["impl"] == "grouped_mm"), None)
                speed.append(base["ms_fwdbwd"] / mine["ms_fwdbwd"] if mine and base else 0)
                mem.append(mine["saved_bytes"] / 2**30 if mine else 0)
            xs = [c + (i - len(impls) / 2 + 0.5) * width for c in range(len(configs))]
            axes[0, col].bar(xs, speed, width, label=impl)
            axes[1, col].bar(xs, mem, width, label=impl)
        for row, ylabel in enumerate(("speedup over grouped_mm (fwd+bwd)", "saved for backward (GiB)")):
            ax = axes[row, col]
            ax.set_xticks(range(len(configs)))
            ax.set_xticklabels(configs, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{act}")
        axes[0, col].axhline(1.0, color="gray", lw=0.8)
        axes[0, col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def timing_lines(timing):
    """How the times were taken (runs before the sustained timing have no ``timing``)."""
    if not timing:
        return []
    return [f"Each fwd+bwd time is the median of at least {timing['min_reps']} steps timed over at least "
            f"{timing['seconds']:g} s, after {timing['warmup_seconds']:g} s of warm-up steps (fwd: half of each; queued: "
            f"half the time, no warm-up), so every implementation is timed in the clock and power state it holds "
            f"under sustained load. % matmul: of the burst rate; % sustained: of the dense matmul timed the same "
            f"way as the layer.", ""]


def markdown_table(meta, notes, records):
    lines = [
        "# bench_layer: one MoE layer, forward+backward, routing given",
        "",
        f"{meta['date']} on {meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}; "
        f"dense bf16 matmul in the same run: {meta['matmul_peak_tflops']:.0f} TFLOP/s in a burst"
        + (f", {meta['matmul_sustained_tflops']:.0f} sustained." if "matmul_sustained_tflops" in meta else "."),
        f"Command: `{meta['command']}`" + "".join(f" with {k}={v}" for k, v in meta.get("env", {}).items()),
        "",
        *timing_lines(meta.get("timing")),
        "host ms: how long the forward+backward call took to return on the host (its launches and any "
        "synchronization); where it nears fwd+bwd ms the GPU waits on the host. queued ms: fwd+bwd with its "
        "launches queued behind ~20 ms of GPU work, so no wait on the host is timed (as inside a model; an "
        "implementation that synchronizes with the host still waits there). The GPU also enters the step from "
        "another clock and power state then (on the large shapes every implementation ran ~10% faster queued): "
        "compare implementations within one column.",
        "",
        "| config | act | impl | fwd ms | fwd+bwd ms | host ms | queued ms | TFLOP/s | % matmul | % sustained | "
        "vs best peer | saved MiB | floor MiB | peak MiB | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups = {}
    for r in records:
        groups.setdefault((r["config"], r["activation"]), []).append(r)
    for (cfg, act), recs in groups.items():
        ok = [r for r in recs if "error" not in r]
        peers = [r["ms_fwdbwd"] for r in ok if not r["impl"].startswith("moeblaze")]
        best_peer = min(peers) if peers else None
        for r in recs:
            if "error" in r:
                lines.append(f"| {cfg} | {act} | {r['impl']} |" + " - |" * 11 + f" {r['error']} |")
                continue
            speed = f"{best_peer / r['ms_fwdbwd']:.2f}x" if best_peer else "-"
            check = "ok" if r.get("check_ok", True) else "FAIL"
            # Older runs lack some columns.
            host, queued = (f"{r[k]:.2f}" if k in r else "-" for k in ("host_ms_fwdbwd", "ms_fwdbwd_queued"))
            sustained = f"{r['pct_of_sustained_matmul']:.0f}%" if "pct_of_sustained_matmul" in r else "-"
            lines.append(
                f"| {cfg} | {act} | {r['impl']} | {r['ms_fwd']:.2f} | {r['ms_fwdbwd']:.2f} | {host} | {queued} | {r['tflops']:.0f} | "
                f"{r['pct_of_matmul']:.0f}% | {sustained} | {speed} | {r['saved_bytes'] / 2**20:.0f} | {r['floor_bytes'] / 2**20:.0f} | "
                f"{r['peak_bytes'] / 2**20:.0f} | {check} |")
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
