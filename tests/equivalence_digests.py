"""SHA-256 digests of the outputs and gradients of a fixed set of MoE cases, to check that a
restructuring changes no bit: run it at two commits and compare the files.

    TRITON_INTERPRET=1 python tests/equivalence_digests.py --out old.json     # at the old commit
    TRITON_INTERPRET=1 python tests/equivalence_digests.py --out new.json --compare old.json

The cases go through the public entries only (``moe_mlp``, ``alltoall_moe``, ``ring_moe``,
Megatron's ``MoELayer`` with the moeblaze dispatcher, the torchtitan override eager and compiled):
dense routing, top-1, top-k = E, an expert with no tokens, dropped slots, both recompute modes,
the reference backend in float64 and float32 and the Triton kernels (interpreted) in float32, at
expert parallelism 1, 2 and 3 (gloo), alltoall and both rings. Not a pytest module: the digests
are compared between two checkouts, never against stored values.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "torchtitan"), os.path.join(HERE, "megatron")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

D, H = 12, 10


def digest(t) -> str:
    if t is None:
        return "none"
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() + str((t.dtype, tuple(t.shape))).encode()).hexdigest()[:24]


def problem(case, E, K, T, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    scores = torch.rand(T, E, generator=g, dtype=torch.float64)
    if case == "empty_expert":
        scores[:, 1] = -1
    ids = scores.topk(K, dim=1).indices
    probs = torch.rand(T, K, generator=g, dtype=torch.float64)
    if case == "dropped_slots":
        drop = torch.rand(T, K, generator=g) < 0.4
        ids = torch.where(drop, -1, ids)
        probs = torch.where(drop, 0.0, probs)
    fc1 = torch.randn(E, 2 * H, D, generator=g, dtype=torch.float64) * D**-0.5
    fc2 = torch.randn(E, D, H, generator=g, dtype=torch.float64) * H**-0.5
    grad_y = torch.randn(T, D, generator=g, dtype=torch.float64)
    return x.to(dtype), ids, probs.to(dtype), fc1.to(dtype), fc2.to(dtype), grad_y.to(dtype)


LOCAL_CASES = {"dense": (6, 2, 23), "top1": (5, 1, 19), "topk_all": (4, 4, 17), "empty_expert": (6, 3, 21),
               "dropped_slots": (6, 3, 22)}
VARIANTS = [("reference", torch.float64, "activation"), ("reference", torch.float32, "activation"),
            ("reference", torch.float32, "fc1"), ("triton", torch.float32, "activation"),
            ("triton", torch.float32, "fc1")]


def local_digests() -> dict:
    from moeblaze_megatron import moe_mlp

    out = {}
    for case, (E, K, T) in LOCAL_CASES.items():
        for backend, dtype, recompute in VARIANTS:
            x, ids, probs, fc1, fc2, grad_y = problem(case, E, K, T, dtype, seed=len(out))
            leaves = [t.clone().requires_grad_() for t in (x, probs, fc1, fc2)]
            y = moe_mlp(leaves[0], ids, leaves[1], leaves[2], leaves[3], "swiglu", recompute=recompute,
                        backend=backend)
            y.backward(grad_y)
            tag = f"local/{case}/{backend}/{str(dtype)[6:]}/{recompute}"
            out[tag] = [digest(y)] + [digest(t.grad) for t in leaves]
    return out


EP_MODES = ("alltoall", "expert", "token")


def _ep_worker(rank, world_size, port):
    try:
        from moeblaze_megatron.parallel.moe import alltoall_moe, ring_moe
    except ImportError:  # before the expert-parallel front
        from moeblaze_megatron.parallel.alltoall import alltoall_moe
        from moeblaze_megatron.parallel.ring import ring_moe

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    out = {}
    try:
        per_rank = 2
        E = per_rank * world_size
        for case, K in (("dense", 2), ("top1", 1), ("topk_all", E), ("dropped_slots", 3), ("empty_expert", 2)):
            for backend, dtype in (("reference", torch.float32), ("triton", torch.float32)):
                if backend == "triton" and case not in ("dense", "dropped_slots"):
                    continue
                T = 9 + 2 * rank
                x, ids, probs, fc1, fc2, grad_y = problem(case, E, K, T, dtype, seed=100 * world_size + rank)
                # Every rank must hold the same global weights.
                _, _, _, fc1, fc2, _ = problem(case, E, K, 1, dtype, seed=7 + world_size)
                shard = slice(rank * per_rank, (rank + 1) * per_rank)
                for mode in EP_MODES:
                    leaves = [t.clone().requires_grad_() for t in (x, probs, fc1[shard], fc2[shard])]
                    if mode == "alltoall":
                        y = alltoall_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], dist.group.WORLD,
                                         backend=backend)
                    else:
                        y = ring_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], dist.group.WORLD, mode=mode,
                                     backend=backend)
                    y.backward(grad_y)
                    out[f"ep{world_size}/rank{rank}/{case}/{backend}/{mode}"] = [digest(y)] + [digest(t.grad)
                                                                                               for t in leaves]
    finally:
        dist.destroy_process_group()
    return out


def ep_digests() -> dict:
    from moe_testing import run_distributed

    out = {}
    for world_size in (2, 3):
        for part in run_distributed(_ep_worker, world_size, timeout=900):
            out.update(part)
    return out


def _megatron_worker(rank, world_size, port):
    from megatron_testing import build_moe_layer, megatron_on_cpu, moe_config, seed_everything

    from moeblaze_megatron.config import MoEBlazeConfig, set_moeblaze_config

    out = {}
    with megatron_on_cpu(rank, world_size, port, expert_model_parallel_size=world_size):
        for mode, ring in (("alltoall", "auto"), ("ring", "expert"), ("ring", "token")):
            if world_size == 1 and mode == "ring":
                continue
            for backend in ("reference", "triton"):
                config = moe_config("moeblaze", expert_model_parallel_size=world_size)
                set_moeblaze_config(config, MoEBlazeConfig(backend=backend, ep_mode=mode, ring_mode=ring,
                                                           recompute="fc1" if mode == "ring" else "activation"))
                seed_everything(5)
                layer = build_moe_layer(config)
                g = torch.Generator().manual_seed(11 + rank)
                x = torch.randn(7 + rank, 2, config.hidden_size, generator=g).requires_grad_()
                grad_y = torch.randn(x.shape, generator=g)
                y, _ = layer(x)
                y.backward(grad_y)
                tag = f"megatron/ep{world_size}/rank{rank}/{mode}-{ring}/{backend}"
                out[tag] = [digest(y), digest(x.grad)] + [digest(p.grad) for _, p in sorted(layer.named_parameters())]
    return out


def megatron_digests() -> dict:
    from moe_testing import run_distributed

    out = {}
    for world_size in (1, 2):
        for part in run_distributed(_megatron_worker, world_size, timeout=900):
            out.update(part)
    return out


def _titan_worker(rank, world_size, port):
    from titan_testing import (expert_parallel_dims, global_state, layer_inputs, make_moe_config, run_moe,
                               titan_world, with_override)

    out = {}
    with titan_world(rank, world_size, port):
        dims = expert_parallel_dims(world_size, "spmd_types") if world_size > 1 else (None, None)
        parallel_dims, context = dims
        variants = [("bf16", dict(backend="reference")), ("fp32", dict(backend="reference", expert_dtype="input")),
                    ("fc1", dict(backend="reference", expert_dtype="input", recompute="fc1")),
                    ("triton", dict(backend="triton", expert_dtype="input"))]
        if world_size > 1:
            variants += [(f"ring_{r}", dict(backend="reference", expert_dtype="input", ep_mode="ring", ring_mode=r,
                                            recompute="fc1")) for r in ("expert", "token")]
        for case in ("softmax_top2", "topk_all", "skewed"):
            state = global_state(case, seed=3)
            x, grad_y = layer_inputs(rank, 3)
            cfg = make_moe_config(case, expert_parallel=world_size > 1)
            for label, options in variants:
                for compile_backend in (None, "aot_eager"):
                    kwargs = {} if context is None else dict(parallel_dims=parallel_dims, context=context)
                    run = run_moe(with_override(cfg, **options), state, x, grad_y, compile_backend=compile_backend,
                                  **kwargs)
                    tag = f"titan/ep{world_size}/rank{rank}/{case}/{label}/{compile_backend or 'eager'}"
                    out[tag] = [digest(run["y"]), digest(run["dx"])] + [
                        digest(run[name]) for name, _ in sorted(run["module"].named_parameters())]
    return out


def titan_digests() -> dict:
    from moe_testing import run_distributed

    out = {}
    for world_size in (1, 2):
        for part in run_distributed(_titan_worker, world_size, timeout=1500):
            out.update(part)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the digests (JSON)")
    parser.add_argument("--compare", help="a digest file to compare with: exit 1 on any difference")
    parser.add_argument("--only", default="local,ep,megatron,titan", help="comma list of case groups")
    args = parser.parse_args()
    groups = {"local": local_digests, "ep": ep_digests, "megatron": megatron_digests, "titan": titan_digests}
    digests = {}
    for name in args.only.split(","):
        print(f"digesting {name} ...", flush=True)
        digests.update(groups[name]())
    with open(args.out, "w") as f:
        json.dump(digests, f, indent=1, sort_keys=True)
    print(f"{len(digests)} cases -> {args.out}")
    if args.compare:
        with open(args.compare) as f:
            old = json.load(f)
        differ = sorted(k for k in digests if k in old and old[k] != digests[k])
        missing = sorted(set(old) - set(digests))
        for k in differ:
            print(f"DIFFERS {k}: {old[k]} -> {digests[k]}")
        for k in missing:
            print(f"MISSING {k}")
        print(f"{len(digests)} cases, {len(differ)} differ, {len(missing)} missing")
        return 1 if differ or missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
