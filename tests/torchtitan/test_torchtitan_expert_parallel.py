"""Expert parallelism through the override on torchtitan's EP mesh, on the CPU with gloo at
EP = 2 and 4: every rank holds the global weights' shard (torchtitan's ``Shard(0)`` over the EP
mesh, set up by its own ``parallelize``), routes its own tokens, and is compared with a float64
oracle of the layer (its output, input and router gradients on its tokens; its experts'
gradients summed over every rank's tokens). Both of torchtitan's SPMD backends
("partial_dtensor": DTensor weights; "spmd_types", the default: annotated local shards); stock
torchtitan's all-to-all dispatcher beside it where it runs on gloo ("partial_dtensor": its
spmd_types path uses gloo's even-only list all_to_all). The ring (``ep_mode="ring"``) is checked
the same way; the exchange receives exactly one row per unique (token, rank) pair; a second run
is bitwise the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_testing import run_distributed
from titan_testing import (
    CASES,
    NUM_EXPERTS,
    REL_TOL,
    bf16_bar,
    expert_parallel_dims,
    global_state,
    layer_inputs,
    make_moe_config,
    oracle_for_rank,
    rel_error,
    run_moe,
    titan_world,
    with_override,
)

def _unique_token_rank_pairs(ids, rank, world_size):
    """Rows rank ``rank`` must receive: (token, rank) pairs over every rank's tokens."""
    dest = ids.reshape(-1, ids.shape[-1]).long() // (NUM_EXPERTS // world_size)
    pairs = (dest[:, :, None] == torch.arange(world_size)).any(dim=1).sum(dim=0)
    dist.all_reduce(pairs)
    return int(pairs[rank])


# EP = 4 runs the cases with every rank busy (top-k = E) and with three of four ranks idle.
_CASES_AT = {2: list(CASES), 4: ["softmax_top2", "topk_all", "skewed"]}
# Per backend, the runs compared with the oracle: stock and the override in bfloat16 where stock
# runs; the override's float32 exchange and ring, and a second bf16 run for determinism, on the
# default backend.
_VARIANTS = {
    "partial_dtensor": {"bf16": dict(backend="reference"), "fp32": dict(backend="reference", expert_dtype="input")},
    "spmd_types": {"bf16": dict(backend="reference"), "fp32": dict(backend="reference", expert_dtype="input"),
                   "ring_expert_fp32": dict(backend="reference", expert_dtype="input", ep_mode="ring",
                                            ring_mode="expert", recompute="fc1"),
                   "ring_token_fp32": dict(backend="reference", expert_dtype="input", ep_mode="ring",
                                           ring_mode="token", recompute="fc1"),
                   "auto_fp32": dict(backend="reference", expert_dtype="input", ep_mode="auto", recompute="fc1")},
}


def _ep_worker(rank, world_size, port):
    failures = []
    with titan_world(rank, world_size, port):
        for backend, variants in _VARIANTS.items():
            parallel_dims, context = expert_parallel_dims(world_size, backend)
            for index, case in enumerate(_CASES_AT[world_size]):
                state = global_state(case, seed=index)
                x, grad_y = layer_inputs(rank, index)
                cfg = make_moe_config(case, expert_parallel=True)
                runs = {label: run_moe(with_override(cfg, **options), state, x, grad_y, parallel_dims, context)
                        for label, options in variants.items()}
                if backend == "partial_dtensor":
                    runs["stock"] = run_moe(cfg, state, x, grad_y, parallel_dims, context)
                ids = runs["bf16"]["ids"]
                oracle = oracle_for_rank(state, case, x, ids, grad_y, rank, world_size)
                stock_err = {n: rel_error(runs["stock"][n], w) for n, w in oracle.items()} if "stock" in runs else {}
                tag = f"{backend}/{case}"
                for label, got in runs.items():
                    if not torch.equal(got["ids"], ids):
                        failures.append(f"{tag}/{label}: the router chose other experts")
                    for name, want in oracle.items():
                        err = rel_error(got[name], want)
                        bar = REL_TOL[torch.float32] if "fp32" in label else bf16_bar(stock_err.get(name, 0.0))
                        if not err <= bar:
                            failures.append(f"{tag}/{label}/{name}: relative error {err:.3e} > {bar:.3e}")
                received = runs["bf16"]["module"].routed_experts.num_received_tokens
                expected = _unique_token_rank_pairs(ids, rank, world_size)
                if received != expected:
                    failures.append(f"{tag}: received {received} rows, expected {expected} (token, rank) pairs")
                if backend == "spmd_types":
                    again = run_moe(with_override(cfg, **variants["bf16"]), state, x, grad_y, parallel_dims, context)
                    failures += [f"{tag}/bf16/{n}: a second run differs" for n in oracle
                                 if not torch.equal(again[n], runs["bf16"][n])]
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_matches_the_oracle(world_size):
    reports = run_distributed(_ep_worker, world_size, timeout=400)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(reports) for f in fs]
    assert not failures, "\n".join(failures)
