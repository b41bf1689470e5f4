"""Shared helpers for the torchtitan adapter's tests: MoE layer configs built with torchtitan's own
config helpers, a float64 oracle of torchtitan's MoE layer, the run of one layer forward and
backward, and a gloo world with torchtitan's ParallelDims on the CPU.

Imported as ``from titan_testing import ...`` (pytest puts this folder on sys.path), never
through conftest.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_testing import REL_TOL, rel_error

__all__ = ["BATCH", "CASES", "DIM", "HIDDEN", "NUM_EXPERTS", "REL_TOL", "SEQ", "bf16_bar", "cpu_device_meshes",
           "expert_parallel_dims", "global_state", "layer_inputs", "make_moe_config", "moe_oracle64", "oracle_for_rank",
           "rel_error",
           "run_moe", "titan_world", "with_override"]

# Shapes off every tile: 2 x 37 tokens per rank, widths that torch._grouped_mm takes in bf16
# (16-byte strides).
BATCH, SEQ, DIM, HIDDEN, NUM_EXPERTS = 2, 37, 16, 24, 8

# name -> router and layer options. "skewed": the expert bias (used for the choice only, as
# torchtitan's aux-loss-free balancing does) sends every token to experts 0 and 1: every other
# expert, and at EP > 1 every other rank, gets no tokens.
CASES = {
    "softmax_top2": dict(top_k=2, score_func="softmax", route_norm=True),
    "sigmoid_groups_shared": dict(top_k=3, score_func="sigmoid", route_scale=2.5, num_expert_groups=4,
                                  num_limited_groups=2, shared=True),
    "top1": dict(top_k=1, score_func="softmax"),
    "topk_all": dict(top_k=NUM_EXPERTS, score_func="softmax", route_norm=True),
    "skewed": dict(top_k=2, score_func="sigmoid", bias=[9.0, 8.0] + [0.0] * (NUM_EXPERTS - 2)),
}

def bf16_bar(stock_error: float) -> float:
    """The bar for a bfloat16 path against the oracle: the dtype's bar, or twice what torchtitan's
    stock layer (bfloat16 grouped GEMMs) misses by where cancellation (the router's softmax
    Jacobian in the gate gradient) amplifies its rounding."""
    return max(REL_TOL[torch.bfloat16], 2 * stock_error)


def _init(std):
    return functools.partial(torch.nn.init.normal_, std=std)


def make_moe_config(case: str, *, expert_parallel: bool = False):
    """torchtitan's MoE.Config for ``case`` (config_utils' builders, the 'standard' dispatcher),
    with the sharding configs torchtitan's Qwen3 model sets."""
    from torchtitan.models.common.config_utils import (
        make_ffn_config,
        make_moe_config as titan_moe_config,
        make_router_config,
        make_routed_experts_config,
    )
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    options = dict(CASES[case])
    shared = options.pop("shared", False)
    options.pop("bias", None)
    experts_init = {"w1_EFD": _init(DIM**-0.5), "w3_EFD": _init(DIM**-0.5), "w2_EDF": _init(HIDDEN**-0.5)}
    cfg = titan_moe_config(
        num_experts=NUM_EXPERTS,
        router=make_router_config(dim=DIM, num_experts=NUM_EXPERTS, gate_param_init={"weight": _init(0.5)},
                                  **options),
        routed_experts=make_routed_experts_config(dim=DIM, hidden_dim=HIDDEN, num_experts=NUM_EXPERTS,
                                                  top_k=options["top_k"], param_init=experts_init,
                                                  comm_backend="standard"),
        shared_experts=make_ffn_config(dim=DIM, hidden_dim=HIDDEN, w1_param_init={"weight": _init(DIM**-0.5)},
                                       w2w3_param_init={"weight": _init(DIM**-0.5)}) if shared else None,
    )
    set_moe_sharding_config(cfg, enable_ep=expert_parallel, enable_sp=False,
                            expert_param_layout={"w1_EFD": _shard(1), "w2_EDF": _shard(2), "w3_EFD": _shard(1)})
    return cfg


def _shard(dim):
    import spmd_types

    return spmd_types.S(dim)


def with_override(cfg, **options):
    """A copy of the MoE config with its routed experts replaced by the override's."""
    from moeblaze_megatron.torchtitan import moeblaze_experts

    cfg = copy.deepcopy(cfg)
    cfg.routed_experts = moeblaze_experts(cfg.routed_experts, **options)
    return cfg


def global_state(case: str, seed: int) -> dict:
    """The layer's global weights and buffers (every expert), drawn by torchtitan's initializers."""
    torch.manual_seed(seed)
    moe = make_moe_config(case).build()
    moe.init_states()
    bias = CASES[case].get("bias")
    if bias is not None:
        moe.expert_bias_E.copy_(torch.tensor(bias))
    return {k: v.detach().clone() for k, v in moe.state_dict().items()}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def run_moe(cfg, state, x, grad_y, parallel_dims=None, context=contextlib.nullcontext, compile_backend=None):
    """Build ``cfg``, load the global ``state``, parallelize over ``parallel_dims`` (if given),
    compile the layer whole (fullgraph, as torchtitan compiles a block; ``compile_backend`` if
    given), run forward and backward: {"y", "dx", "ids" (None compiled), parameter name ->
    gradient (this rank's shard)}."""
    moe = cfg.build()
    moe.load_state_dict(state)
    if parallel_dims is not None:
        moe.parallelize(parallel_dims)
    routing = {"ids": None}

    def keep_ids(module, args, out):
        routing["ids"] = _local(out[1]).clone()

    if compile_backend is None:
        moe.router.register_forward_hook(keep_ids)
    else:
        torch._dynamo.reset()
        moe.compile(backend=compile_backend, fullgraph=True)
    x = x.clone().requires_grad_()
    with context():
        y = _local(moe(x))
        y.backward(grad_y)
    out = {"y": y.detach(), "dx": x.grad, "ids": routing["ids"], "module": moe}
    for name, p in moe.named_parameters():
        out[name] = _local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))
    return out


def moe_oracle64(state: dict, case: str, x: torch.Tensor, ids: torch.Tensor, grad_y: torch.Tensor) -> dict:
    """torchtitan's MoE layer in float64 by its definition, for the expert choice ``ids`` the layer
    made (discrete: near-ties must not make the oracle choose differently): router scores of the
    chosen experts (softmax or sigmoid, route_norm, route_scale), every expert on every token
    masked by its score, plus the shared experts. {"y", "dx", parameter name -> gradient}."""
    opts = CASES[case]
    leaves = {k: v.double().requires_grad_() for k, v in state.items() if v.dtype.is_floating_point
              and k != "expert_bias_E"}
    x = x.double().requires_grad_()
    logits = x @ leaves["router.gate.weight"].t()
    scores = logits.softmax(-1) if opts["score_func"] == "softmax" else logits.sigmoid()
    chosen = scores.gather(-1, ids.long())
    if opts.get("route_norm"):
        chosen = chosen / (chosen.sum(-1, keepdim=True) + 1e-20)
    chosen = chosen * opts.get("route_scale", 1.0)
    prefix = "routed_experts.inner_experts."
    w1, w2, w3 = (leaves[prefix + n] for n in ("w1_EFD", "w2_EDF", "w3_EFD"))
    y = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        weight = (chosen * (ids == e)).sum(-1, keepdim=True)
        y = y + weight * ((F.silu(x @ w1[e].t()) * (x @ w3[e].t())) @ w2[e].t())
    if "shared_experts.w1.weight" in leaves:
        s1, s2, s3 = (leaves[f"shared_experts.{n}.weight"] for n in ("w1", "w2", "w3"))
        y = y + (F.silu(x @ s1.t()) * (x @ s3.t())) @ s2.t()
    y.backward(grad_y.double())
    return {"y": y.detach(), "dx": x.grad, **{k: v.grad for k, v in leaves.items()}}


_EXPERT_PARAMS = tuple(f"routed_experts.inner_experts.{n}" for n in ("w1_EFD", "w2_EDF", "w3_EFD"))


def oracle_for_rank(state, case, x, ids, grad_y, rank, world_size):
    """``moe_oracle64`` on this rank's tokens at expert parallelism ``world_size``: the expert
    gradients summed over every rank's tokens, this rank's shard of them."""
    oracle = moe_oracle64(state, case, x, ids, grad_y)
    per_rank = NUM_EXPERTS // world_size
    for name in _EXPERT_PARAMS:
        dist.all_reduce(oracle[name])
        oracle[name] = oracle[name][rank * per_rank:(rank + 1) * per_rank]
    return oracle


def cpu_device_meshes() -> None:
    """torchtitan builds its device meshes on ``tools.utils.device_type``, "cuda" where no
    accelerator is found: the CPU tests build them on the CPU."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"


@contextlib.contextmanager
def titan_world(rank: int, world_size: int, port: int):
    """A gloo process group for torchtitan on the CPU."""
    cpu_device_meshes()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def expert_parallel_dims(world_size: int, backend: str):
    """torchtitan's ParallelDims with every rank's experts on the EP mesh (dp_shard = EP = world),
    its meshes built, and the SPMD backend selected; returns (parallel_dims, the forward context
    torchtitan's trainer runs the model in)."""
    # torchtitan's meshes put size-1 axes on torch's "fake" backend, registered by this module
    # (which its model packages import through torch.distributed.fsdp).
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims

    dist_utils.set_spmd_backend(backend)
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=world_size,
                                 world_size=world_size, spmd_backend=backend)
    parallel_dims.build_mesh()
    return parallel_dims, dist_utils.get_spmd_context(parallel_dims=parallel_dims)


def layer_inputs(rank: int, seed: int):
    """This rank's layer input [B, L, D] and output gradient, fresh per (rank, seed)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)
