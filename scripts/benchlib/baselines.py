"""Every implementation of one MoE layer that the benchmarks compare, routing given.

Each maps (x [T, d], top-k ids [T, K], top-k probs [T, K]) -> y [T, d] and owns its parameters,
built from the same fc1 [E, 2h|h, d] and fc2 [E, d, h] weights. Peers: grouped_mm
(torch._grouped_mm pipeline, as torchtitan does it; grouped_mm_views the same over transposed views
of the layer's weights, the faster layout on some shapes), megatron_sequential (Megatron-Core alltoall
dispatcher + SequentialMLP), te_grouped (Megatron-Core alltoall dispatcher with the fused
permutation + TEGroupedMLP, Transformer Engine's grouped GEMM: the stock MoE with TE, EP = 1),
megablocks (dMoE, grouped path), liger (Liger-Kernel's fused MoE), scattermoe. A peer's library is imported when the peer is built, so a missing one fails there.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from moeblaze_megatron import moe_mlp
from moeblaze_megatron.warmup import start_compile_workers

# Liger's fused MoE autotunes over many configs on every new shape, which would dominate a
# benchmark run; DESIGN.md measured it with autotuning off too.
os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")

IMPLS = ("moeblaze", "moeblaze_fc1", "grouped_mm", "grouped_mm_views", "megatron_sequential", "te_grouped", "megablocks", "liger",
         "scattermoe", "sonicmoe", "moeblaze_fp8", "te_grouped_fp8")
# The FP8 peers (E4M3, blockwise recipe): their check against float64 passes under FP8's error
# (tests/core/test_fp8.py measures ~7% norm-relative on the layer) instead of accuracy.CHECK_TOL.
FP8_CHECK_TOL = 0.12
# An illegal memory access kills the whole process, so a peer known to crash on a shape is skipped.
KNOWN_CRASHES = {("dsv3-like", "scattermoe"): "skipped: died with an illegal memory access on this "
                 "shape when measured for DESIGN.md (2026-11-29); an IMA would end this whole run"}


class Impl:
    name = ""
    check_tol = None  # None: accuracy.CHECK_TOL

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
        start_compile_workers()  # as the Megatron and torchtitan layers do when built
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


class MoEBlazeFp8(MoEBlaze):
    """moe_mlp(fp8="e4m3"): the six GEMMs under the blockwise recipe."""

    name = "moeblaze_fp8"
    check_tol = FP8_CHECK_TOL

    def __call__(self, x, ids, probs):
        return moe_mlp(x, ids, probs, self.fc1, self.fc2, self.activation, recompute=self.recompute, validate=False,
                       fp8="e4m3")


class GroupedMM(Impl):
    """Sort, gather, grouped_mm, activation, grouped_mm, weighted index_add (torchtitan's recipe),
    the weights stored [E, d, 2h] and [E, h, d] (contiguous copies)."""

    name = "grouped_mm"

    def __init__(self, fc1, fc2, activation, num_experts, topk):
        super().__init__(fc1, fc2, activation, num_experts, topk)
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError("torch._grouped_mm is not available in this torch")
        self.w1, self.w2 = (w.requires_grad_() for w in self.stored(fc1.detach(), fc2.detach()))

    def stored(self, fc1, fc2):
        """The parameters this form keeps: contiguous [E, d, 2h] and [E, h, d] copies."""
        return fc1.transpose(1, 2).contiguous(), fc2.transpose(1, 2).contiguous()

    def params(self):
        return [self.w1, self.w2]

    def weights(self):
        """fc1 and fc2 as grouped_mm's right operands, [E, d, 2h] and [E, h, d]."""
        return self.w1, self.w2

    def __call__(self, x, ids, probs):
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // self.K
        offs = torch.bincount(flat, minlength=self.E).cumsum(0).to(torch.int32)
        xs = x[tokens]
        w1, w2 = self.weights()
        a = torch._grouped_mm(xs, w1, offs=offs)
        if self.activation == "swiglu":
            gate, up = a.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = F.silu(a) if self.activation == "silu" else F.gelu(a)
        o = torch._grouped_mm(a, w2, offs=offs)
        o = o * probs.reshape(-1)[order, None].to(o.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, o)


class GroupedMMViews(GroupedMM):
    """The same pipeline with the weights stored as the layer holds them, [E, 2h, d] and [E, d, h],
    and passed as transposed views (grouped_mm then reads them column-major): measured faster than
    the contiguous copies on some shapes, so both forms are timed."""

    name = "grouped_mm_views"

    def stored(self, fc1, fc2):
        return fc1.clone(), fc2.clone()  # [E, 2h, d], [E, d, h]

    def weights(self):
        return self.w1.transpose(1, 2), self.w2.transpose(1, 2)


class MegatronSequential(Impl):
    """Megatron-Core's MoELayer stages (alltoall dispatcher + SequentialMLP), routing given."""

    name = "megatron_sequential"

    def __init__(self, fc1, fc2, activation, num_experts, topk):
        super().__init__(fc1, fc2, activation, num_experts, topk)
        from megatron.core import parallel_state
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
            # Megatron refuses top-1 without it; the router never runs here (routing given).
            moe_router_pre_softmax=topk == 1,
            perform_initialization=False, **self.config_fields(fc1),
        )
        spec = self.layer_spec(E)
        # megatron-core 0.19 writes submodule specs as functools.partial, older ones as ModuleSpec.
        layer = build_module(spec, config=config) if isinstance(spec, ModuleSpec) else spec(config=config)
        self.layer = layer.to(fc1.device)
        with torch.no_grad():
            for e, (w1, w2) in enumerate(self.expert_weights()):
                w1.copy_(fc1[e])
                w2.copy_(fc2[e])

    def config_fields(self, fc1) -> dict:
        return dict(use_cpu_initialization=True)

    def layer_spec(self, num_experts):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False).submodules.mlp

    def expert_weights(self):
        """(fc1 [2h|h, d], fc2 [d, h]) parameters of each expert, in expert order."""
        return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in self.layer.experts.local_experts]

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


class MegatronTEGrouped(MegatronSequential):
    """The stock MoE with Transformer Engine at EP = 1: Megatron-Core's alltoall dispatcher with
    the fused permutation (TE's kernels) and TEGroupedMLP (TE's GroupedLinear, the grouped GEMM of
    --moe-grouped-gemm), the layer of Megatron's TE spec; the same stages as megatron_sequential."""

    name = "te_grouped"

    def __init__(self, fc1, fc2, activation, num_experts, topk):
        try:
            import transformer_engine.pytorch  # noqa: F401
        except ImportError as error:
            raise RuntimeError(f"te_grouped needs Transformer Engine ({error})") from None
        if not fc1.is_cuda:
            raise RuntimeError("te_grouped runs on CUDA (Transformer Engine)")
        super().__init__(fc1, fc2, activation, num_experts, topk)

    def config_fields(self, fc1) -> dict:
        # TE builds its parameters on the GPU; grouped GEMM and the fused permutation are the
        # options Megatron users set with TE (TEGroupedMLP's own SwiGLU kernel is the default
        # bias_activation_fusion path).
        return dict(use_cpu_initialization=False, moe_grouped_gemm=True, moe_permute_fusion=True,
                    bias_activation_fusion=self.activation == "swiglu")

    def layer_spec(self, num_experts):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=True).submodules.mlp

    def expert_weights(self):
        experts = self.layer.experts
        return [(getattr(experts.linear_fc1, f"weight{e}"), getattr(experts.linear_fc2, f"weight{e}"))
                for e in range(experts.num_local_experts)]


class MegatronTEGroupedFp8(MegatronTEGrouped):
    """te_grouped under Megatron's blockwise FP8 recipe (--fp8-format e4m3 --fp8-recipe
    blockwise): TE's grouped GEMM with Float8BlockScaling, inside Megatron's own FP8 context."""

    name = "te_grouped_fp8"
    check_tol = FP8_CHECK_TOL

    def config_fields(self, fc1) -> dict:
        return dict(super().config_fields(fc1), fp8="e4m3", fp8_recipe="blockwise")

    def __call__(self, x, ids, probs):
        from megatron.core.fp8_utils import get_fp8_context

        with get_fp8_context(self.layer.config):
            return super().__call__(x, ids, probs)


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


class SonicMoE(Impl):
    """SonicMoE (Dao-AILab, arXiv 2512.14080; CuTe-DSL kernels: the gather fused into the
    up-projection, a SwiGLU epilogue, X and the pre-activations cached) through its entry for a
    routing given from outside, ``moe_general_routing_inputs``, with our routing as its sparse
    graph (token ids ascending, each slot's expert and score). Its weights are ours, viewed as it
    takes them: w1 (2h, d, E) and w2 (d, h, E) with the experts outermost (``permute(1, 2, 0)`` of
    [E, 2h, d] and [E, d, h], no copy), ``concat_layout=True`` for our [gate | up] rows.
    ``../shared/tools/sonic-peer.sh`` packs it for the GPU machine."""

    name = "sonicmoe"

    def __init__(self, fc1, fc2, activation, num_experts, topk):
        super().__init__(fc1, fc2, activation, num_experts, topk)
        if activation != "swiglu":
            raise RuntimeError("sonicmoe: measured here with SwiGLU only (ActivationType.SWIGLU)")
        if not fc1.is_cuda:
            raise RuntimeError("sonicmoe runs on CUDA (CuTe-DSL kernels)")
        from sonicmoe import moe_general_routing_inputs
        from sonicmoe.enums import ActivationType

        self.fn, self.act = moe_general_routing_inputs, ActivationType.SWIGLU
        self.fc1 = fc1.detach().clone().requires_grad_()
        self.fc2 = fc2.detach().clone().requires_grad_()

    def params(self):
        return [self.fc1, self.fc2]

    def __call__(self, x, ids, probs):
        T, K = ids.shape
        token_ids = torch.arange(T, device=x.device, dtype=torch.int32).repeat_interleave(K)
        expert_ids, scores = ids.reshape(-1).to(torch.int32), probs.reshape(-1).float()
        # The benchmark's routings fill every slot; its check's may not: unused slots leave the
        # graph (a host synchronization, outside any timed step).
        if not torch.compiler.is_compiling() and bool((expert_ids < 0).any()):
            keep = expert_ids >= 0
            token_ids, expert_ids, scores = token_ids[keep], expert_ids[keep], scores[keep]
        out = self.fn(x, scores, token_ids, expert_ids, self.fc1.permute(1, 2, 0), None, self.fc2.permute(1, 2, 0),
                      None, self.E, torch.cuda.current_stream().cuda_stream, self.act, False, concat_layout=True)
        return out[0] if isinstance(out, tuple) else out


IMPL_CLASSES = {c.name: c for c in (MoEBlaze, MoEBlazeFc1, MoEBlazeFp8, MegatronTEGroupedFp8, GroupedMM, GroupedMMViews, MegatronSequential, MegatronTEGrouped,
                                    MegaBlocks, Liger, ScatterMoE, SonicMoE)}


def map_grads(impl, grads):
    """An implementation's parameter gradients, mapped back to [E, 2h|h, d] / [E, d, h]."""
    p = grads
    if isinstance(impl, (MoEBlaze, Liger, GroupedMMViews, SonicMoE)):  # the layer's own layout
        return p[0], p[1]
    if isinstance(impl, GroupedMM):
        return p[0].transpose(1, 2), p[1].transpose(1, 2)
    if isinstance(impl, MegatronSequential):  # and MegatronTEGrouped
        weights = impl.expert_weights()
        return torch.stack([w1.grad for w1, _ in weights]), torch.stack([w2.grad for _, w2 in weights])
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
