"""Expert parallelism at EP = world size under torchrun: MoEBlaze against Megatron's stock
dispatcher, one MoE layer's equivalence and step time, a small GPTModel's training step, and the
longest sequence that fits a memory budget (scripts/bench_expert_parallel.py says what each part
measures)."""

from __future__ import annotations

import datetime
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moeblaze_megatron.training.named_grads import sequential_named_grads as named_grads

from .accuracy import rel_err
from .megatron_checks import BF16_TOL, grouped_errors, measure_layer
from .megatron_models import build_layer, megatron_world, seed, transformer_config
from .memory_search import gc_free, largest_fitting

# NVLink multicast (NVLS) can put a shared host's GPUs out of service: keep it off in NCCL,
# PyTorch's symmetric memory and NVSHMEM unless the caller decided otherwise. NCCL reads these at
# communicator creation, so they must be set before init_process_group.
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

FP32_TOL = 1e-5  # fp32: the EP paths and the reference differ only in summation order
# name: (hidden d, expert ffn h, experts E, top-k K), the model family trained in part 3
SHAPES = {"qwen3": ((2048, 768, 128, 8), "qwen3_moe"), "tiny": ((64, 32, 16, 4), "tiny")}
# Per device: tokens per rank of the equivalence check and of the layer timing, timed repetitions
# (layer) and steps (model), the model's sequence and micro-batch, the search's time per dispatcher.
DEFAULTS = {
    "cuda": dict(shape="qwen3", check_tokens=4096, time_tokens=16384, reps=10, model_steps=6, seq_length=4096,
                 micro_batch_size=1, search_seconds=60.0),
    "cpu": dict(shape="tiny", check_tokens=48, time_tokens=64, reps=2, model_steps=2, seq_length=32,
                micro_batch_size=2, search_seconds=0.0),
}
# The stock dispatcher compared with: alltoall + SequentialMLP, what Megatron runs fastest without
# Transformer Engine. On the CPU its EP all-to-all fails (Megatron hands torch's
# all_to_all_single its split sizes as a CPU tensor where torch wants a list), so the CPU runs
# allgather, the stock dispatcher that runs there.
STOCK = {"cuda": "alltoall", "cpu": "allgather"}
REFERENCE = "alltoall"  # the fp32 EP = 1 layer: no all-to-all at EP = 1, so it runs on the CPU too
SEARCH_GRANULE = 256  # sequence lengths searched in steps of this
# A probe whose peak, extrapolated from the probes before it, exceeds this many budgets is not run
# (counted as not fitting): a real out-of-memory error on some ranks only would leave the others
# waiting in a collective, so the search stays below the device's memory (100 of an H200's 140 GiB
# at the default budget) instead of catching OOM as the one-GPU search does.
SEARCH_SKIP_FACTOR = 1.25


# ----------------------------------------------------------------------------------------------
# The distributed world


class Rank:
    """This process's place in the torchrun world (a single process without torchrun)."""

    def __init__(self):
        # Megatron's argument parser reads the world from these too (part 3).
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                            ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29581")):
            os.environ.setdefault(name, value)
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.started = time.perf_counter()

    def say(self, message: str) -> None:
        if self.rank == 0:
            print(f"[{time.perf_counter() - self.started:7.1f}s] {message}", flush=True)


def ep1_process_groups():
    """Megatron's default process groups with every expert group replaced by this rank alone:
    a layer built with them holds all experts (EP = 1) inside the EP = world-size world."""
    import copy

    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    alone, _ = dist.new_subgroups(group_size=1)
    groups = copy.copy(get_default_pg_collection())
    groups.ep = groups.tp_ep = groups.expt_dp = alone
    return groups


def reduce_max(values: list[float], device) -> list[float]:
    """Element-wise maximum over ranks."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def gather_ints(values: list[int], device) -> list[list[int]]:
    """``values`` of every rank, by rank."""
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return [t.tolist() for t in out]


# ----------------------------------------------------------------------------------------------
# One MoE layer


# MoEBlaze's expert-parallel modes (--ep-modes): the variant's name and its plugin flags.
MOEBLAZE_VARIANTS = {"alltoall": ("moeblaze", []), "ring": ("moeblaze_ring", ["--moeblaze-ep-mode", "ring", "--moeblaze-recompute", "fc1"])}


def dispatchers(args) -> list[tuple[str, str]]:
    """(variant, implementation label) of the stock run and of each MoEBlaze mode."""
    ours = [(MOEBLAZE_VARIANTS[mode][0], "moeblaze" if mode == "alltoall" else f"moeblaze {mode}")
            for mode in args.ep_modes]
    return [(args.stock, f"stock {args.stock}+SequentialMLP"), *ours]


def is_moeblaze(variant: str) -> bool:
    return variant.startswith("moeblaze")


def variant_flags(variant: str) -> list[str]:
    """The plugin flags of a MoEBlaze variant (none for stock)."""
    return next((flags for name, flags in MOEBLAZE_VARIANTS.values() if name == variant), [])


def variant_config(variant: str, dtype, device, **fields):
    """The TransformerConfig of a variant: its dispatcher, and a MoEBlaze mode's options."""
    from moeblaze_megatron.megatron_plugin import add_moeblaze_args, moeblaze_config_from_args
    from moeblaze_megatron.config import set_moeblaze_config

    config = transformer_config("moeblaze" if is_moeblaze(variant) else variant, dtype, device, **fields)
    if is_moeblaze(variant):
        import argparse

        options = moeblaze_config_from_args(add_moeblaze_args(argparse.ArgumentParser()).parse_args(
            variant_flags(variant)))
        set_moeblaze_config(config, options)
    return config


def layer_fields(shape, ep: int) -> dict:
    d, h, num_experts, topk = shape
    return dict(hidden_size=d, moe_ffn_hidden_size=h, num_moe_experts=num_experts, moe_router_topk=topk,
                expert_model_parallel_size=ep)


def local_expert_state(state: dict, rank: int, per_rank: int) -> dict:
    """An EP = 1 layer's state dict cut to the experts of ``rank`` (renumbered from 0)."""
    local = {k: v for k, v in state.items() if ".local_experts." not in k}
    for i in range(per_rank):
        for fc in ("linear_fc1", "linear_fc2"):
            local[f"experts.local_experts.{i}.{fc}.weight"] = state[f"experts.local_experts.{rank * per_rank + i}.{fc}.weight"]
    return local


class RoutingCounts:
    """What the layer's all-to-all moved in its last forward pass, from the router's routing map
    (a forward hook) and the dispatchers' own counts."""

    def __init__(self, layer):
        self.layer = layer
        self.routing_map = None
        self.hook = layer.router.register_forward_hook(self._keep)

    def _keep(self, module, inputs, output):
        self.routing_map = output[1].detach()

    def collect(self, rank: Rank, per_rank: int) -> dict:
        """Rows received by each rank, and the (token, rank) and (token, expert) pairs sent to it
        by every rank (one list entry per rank). Collective."""
        dispatcher = self.layer.token_dispatcher
        kind = self.layer.config.moe_token_dispatcher_type
        if kind == "moeblaze":
            received = dispatcher.num_received_tokens
        elif kind == "alltoall":  # the rows received from every source rank
            received = None if dispatcher.output_splits is None else int(sum(dispatcher.output_splits))
        else:  # allgather: every token of every rank
            received = dispatcher.hidden_shape_before_permute[0]
        per_dest = self.routing_map.view(self.routing_map.shape[0], rank.world, per_rank)
        to_rank = torch.stack([per_dest.any(dim=2).sum(dim=0), per_dest.sum(dim=(0, 2))])  # [2, world]
        dist.all_reduce(to_rank)
        # At EP = 1 nothing travels: the rank "receives" its own tokens, one row per token.
        rows = gather_ints([self.routing_map.shape[0] if received is None else received], self.routing_map.device)
        return {"recv_rows": [r[0] for r in rows], "unique_token_rank_pairs": to_rank[0].tolist(),
                "token_expert_pairs": to_rank[1].tolist()}


def check_layer(args, rank: Rank, device, dtype) -> list[dict]:
    """Part 1: moeblaze and the stock dispatcher at EP = world size against the fp32 EP = 1
    reference."""
    shape = SHAPES[args.shape][0]
    d, _, num_experts, _ = shape
    per_rank = num_experts // rank.world
    seed(1)
    reference = build_layer(transformer_config(REFERENCE, torch.float32, device.type, **layer_fields(shape, 1)),
                            device, ep1_process_groups())
    with torch.no_grad():
        for tensor in reference.state_dict().values():
            if torch.is_tensor(tensor) and tensor.is_floating_point():
                # Every rank the same global weights, holding values of the compute dtype.
                tensor.copy_(tensor.to(dtype))
                dist.broadcast(tensor, src=0)
    local = local_expert_state(reference.state_dict(), rank.rank, per_rank)
    layers = {"reference": reference}
    for dispatcher, _ in dispatchers(args):
        layers[dispatcher] = build_layer(
            variant_config(dispatcher, dtype, device.type, **layer_fields(shape, rank.world)), device)
        layers[dispatcher].load_state_dict(local)
    counts = {dispatcher: RoutingCounts(layers[dispatcher]) for dispatcher, _ in dispatchers(args)}

    generator = torch.Generator(device=device).manual_seed(100 + rank.rank)
    x = torch.randn(args.check_tokens, 1, d, device=device, generator=generator).to(dtype)
    upstream = torch.randn(args.check_tokens, 1, d, device=device, generator=generator).to(dtype)
    results = {}
    for label, layer in layers.items():
        xx = x.to(layer.config.params_dtype).clone().requires_grad_()
        out, _ = layer(xx)
        (out.float() * upstream.float()).sum().backward()
        results[label] = {"output": out.detach(), "input grad": xx.grad, "grads": named_grads(layer)}
        del out, xx

    # The EP layers' expert gradients hold every rank's tokens: sum the reference's over ranks.
    ref_grads = results["reference"]["grads"]
    want = {k: g for k, g in ref_grads.items() if ".local_experts." not in k}
    for fc in ("linear_fc1", "linear_fc2"):
        every = torch.stack([ref_grads[f"experts.local_experts.{e}.{fc}.weight"] for e in range(num_experts)])
        dist.all_reduce(every)
        for i in range(per_rank):
            want[f"experts.local_experts.{i}.{fc}.weight"] = every[rank.rank * per_rank + i]
        del every

    def errors(got: dict, ref: dict, grads_ref: dict) -> dict:
        return {"output": rel_err(got["output"], ref["output"]), "input grad": rel_err(got["input grad"], ref["input grad"]),
                **grouped_errors(got["grads"], grads_ref)}

    stock = results[args.stock]
    ours = [variant for variant, _ in dispatchers(args) if is_moeblaze(variant)]
    per_rank_errors = {"stock": errors(stock, results["reference"], want)}
    for variant in ours:
        per_rank_errors[variant] = errors(results[variant], results["reference"], want)
        per_rank_errors[f"{variant} vs stock"] = errors(results[variant], stock, stock["grads"])
    # The worst rank's error of every quantity.
    keys = [(label, q) for label, errs in per_rank_errors.items() for q in errs]
    worst = reduce_max([per_rank_errors[label][q] for label, q in keys], device)
    errs = {label: {} for label in per_rank_errors}
    for (label, q), value in zip(keys, worst):
        errs[label][q] = value
    tol = BF16_TOL if dtype == torch.bfloat16 else FP32_TOL
    rows = []
    for dispatcher, _ in dispatchers(args):
        moved = counts[dispatcher].collect(rank, per_rank)
        counts[dispatcher].hook.remove()
        if is_moeblaze(dispatcher):
            failed = sorted(q for q, e in errs[dispatcher].items() if e > max(tol, 2 * errs["stock"][q]))
            verdict = dict(errors={"vs reference": errs[dispatcher], "vs stock": errs[f"{dispatcher} vs stock"]},
                           passed=not failed, failed=failed)
        else:  # reported, not judged: the bar is MoEBlaze's
            verdict = dict(errors={"vs reference": errs["stock"]})
        rows.append(record(rank, "equivalence", dispatcher, args, tokens=args.check_tokens, tolerance=tol, **moved,
                           **verdict))
    return rows


def layer_step_time(layer, x, device, reps: int):
    """(median ms, peak MiB above the step's start or None on CPU) of forward+backward of
    ``layer`` on ``x``, two warm-up steps."""
    return measure_layer(layer, x, device.type, warmup=2, reps=reps)


def time_layer(args, rank: Rank, device, dtype) -> list[dict]:
    """Part 2: step time, peak memory and all-to-all rows of one layer per dispatcher."""
    shape = SHAPES[args.shape][0]
    per_rank = shape[2] // rank.world
    generator = torch.Generator(device=device).manual_seed(200 + rank.rank)
    x = torch.randn(args.time_tokens, 1, shape[0], device=device, generator=generator, dtype=dtype)
    rows = []
    for dispatcher, label in dispatchers(args):
        seed(6)
        layer = build_layer(variant_config(dispatcher, dtype, device.type, **layer_fields(shape, rank.world)), device)
        counts = RoutingCounts(layer)
        ms, peak_mib = layer_step_time(layer, x, device, args.reps)
        ms, peak = reduce_max([ms, -1.0 if peak_mib is None else peak_mib * 2**20], device)
        moved = counts.collect(rank, per_rank)
        counts.hook.remove()
        rows.append(record(rank, "layer step", dispatcher, args, tokens=args.time_tokens, ms=ms,
                           peak_bytes=None if peak < 0 else int(peak), **moved))
        rank.say(f"  layer step, {label}: {ms:.2f} ms" + ("" if peak < 0 else f", peak {peak / 2**20:.0f} MiB"))
        del layer, counts
        gc_free()
    return rows


# ----------------------------------------------------------------------------------------------
# A GPTModel of MoE layers


def one_micro_batch_per_rank(trainer) -> None:
    """Trainer runs global_batch_size // micro_batch_size micro-batches per step, the count at
    data-parallel size 1. At EP = N the N ranks are data-parallel too, and Megatron's schedule gives
    each rank global / (micro x N) of them (validate_args wants the global batch a multiple of
    micro x N, so the RunSpec asks for N micro-batches): one per rank, as pretrain would run."""
    trainer.args.global_batch_size = trainer.args.micro_batch_size


def time_model(args, rank: Rank, device) -> list[dict]:
    """Parts 3 and 4: training steps of the model per dispatcher (same weights and tokens), and
    on GPU the longest sequence that fits the memory budget."""
    from moeblaze_megatron.training.train_loop import RunSpec, Trainer

    family = SHAPES[args.shape][1]
    warmup = 2
    rows, initial_state = [], None
    for dispatcher, label in dispatchers(args):
        allocated_before = 0
        if device.type == "cuda":
            gc_free()
            allocated_before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        run = RunSpec(family=family, dispatcher="moeblaze" if is_moeblaze(dispatcher) else dispatcher,
                      seq_length=args.seq_length,
                      micro_batch_size=args.micro_batch_size, num_microbatches=rank.world,
                      train_iters=warmup + args.model_steps, warmup_iters=1, bf16=device.type == "cuda",
                      # Megatron's gradient clipping asserts CUDA tensors: unclipped on the CPU.
                      clip_grad=1.0 if device.type == "cuda" else 0.0,
                      extra_args=["--expert-model-parallel-size", str(rank.world), *variant_flags(dispatcher)])
        rank.say(f"  model: building {family} with {label} ...")
        trainer = Trainer(run, device, initial_state=initial_state)
        one_micro_batch_per_rank(trainer)
        if initial_state is None:
            initial_state = trainer.unwrapped_state_dict()
        generator = torch.Generator().manual_seed(300 + rank.rank)  # each rank its own tokens
        results = [trainer.train_step(trainer.random_batches(args.micro_batch_size, args.seq_length, generator))
                   for _ in range(warmup + args.model_steps)]
        ms = statistics.median(r.seconds for r in results[warmup:]) * 1e3
        peak = torch.cuda.max_memory_allocated(device) - allocated_before if device.type == "cuda" else -1
        ms, peak = reduce_max([ms, peak], device)
        first_loss = torch.tensor(results[0].loss, dtype=torch.float64, device=device)
        dist.all_reduce(first_loss)
        row = record(rank, "model step", dispatcher, args, tokens=results[0].tokens, ms=ms,
                     peak_bytes=None if peak < 0 else int(peak), family=family, seq_length=args.seq_length,
                     micro_batch_size=args.micro_batch_size, first_step_loss=first_loss.item() / rank.world)
        rank.say(f"  model step, {label}: {ms:.1f} ms, first loss {row['first_step_loss']:.5f}"
                 + ("" if peak < 0 else f", peak {peak / 2**30:.2f} GiB"))
        rows.append(row)
        if args.search_seconds > 0:
            rank.say(f"  searching the longest sequence within {args.memory_budget_gib:g} GiB "
                     f"(at most {args.search_seconds:g}s) ...")
            found = search_sequence(trainer, rank, int(args.memory_budget_gib * 2**30), args.search_seconds,
                                    allocated_before, (args.seq_length, peak))
            rows.append(record(rank, "longest sequence", dispatcher, args, family=family,
                               micro_batch_size=args.micro_batch_size, memory_budget_bytes=found.pop("budget_bytes"),
                               **found))
        trainer.close()
        del trainer
    return rows


class _SearchTimeUp(Exception):
    """Every rank agreed that the search's time is up."""


def search_sequence(trainer, rank: Rank, budget_bytes: int, time_limit: float, allocated_before: int,
                    first_point: tuple[int, int]) -> dict:
    """The longest sequence (a multiple of SEARCH_GRANULE) whose training step peaks within
    ``budget_bytes`` on every rank, by memory_search.largest_fitting. Unlike the one-GPU
    search every decision is collective: the peak is the maximum over ranks, the time limit is
    judged once for all ranks, and probes predicted far over the budget are not run (see
    SEARCH_SKIP_FACTOR). ``first_point``: (sequence length, peak) of the timed steps."""
    device = trainer.device
    mbs = trainer.args.micro_batch_size
    start = max(SEARCH_GRANULE, first_point[0] // SEARCH_GRANULE * SEARCH_GRANULE)
    generator = torch.Generator().manual_seed(400 + rank.rank)
    points = [first_point]  # (sequence length, peak bytes) measured so far
    probes = []
    deadline = time.perf_counter() + time_limit

    def predicted_peak(seq: int) -> float:
        """Linear in the sequence length through the two measured points nearest ``seq``."""
        near = sorted(points, key=lambda point: abs(point[0] - seq))[:2]
        if len(near) == 1 or near[0][0] == near[1][0]:
            return near[0][1] * seq / near[0][0]
        (s0, p0), (s1, p1) = near
        return p0 + (p1 - p0) * (seq - s0) / (s1 - s0)

    def fits(seq: int) -> bool:
        (out_of_time,) = reduce_max([float(time.perf_counter() >= deadline)], device)
        if out_of_time:
            raise _SearchTimeUp
        estimate = predicted_peak(seq)
        if estimate > SEARCH_SKIP_FACTOR * budget_bytes:
            probes.append({"seq_length": seq, "fits": False, "peak_bytes": None, "predicted_peak_bytes": int(estimate)})
            rank.say(f"    seq {seq:7d}: predicted peak {estimate / 2**30:6.1f} GiB, not run")
            return False
        gc_free()
        torch.cuda.reset_peak_memory_stats(device)
        began = time.perf_counter()
        # One step: the optimizer state exists since the timed steps.
        trainer.train_step(trainer.random_batches(mbs, seq, generator))
        (peak,) = reduce_max([torch.cuda.max_memory_allocated(device) - allocated_before], device)
        points.append((seq, peak))
        ok = peak <= budget_bytes
        probes.append({"seq_length": seq, "fits": ok, "peak_bytes": int(peak), "seconds": time.perf_counter() - began})
        rank.say(f"    seq {seq:7d}: {'fits' if ok else 'does not fit'}, peak {peak / 2**30:6.1f} GiB")
        return ok

    try:
        # The time limit is judged in fits (collectively), not by largest_fitting's own clock.
        found = largest_fitting(fits, start, SEARCH_GRANULE, 64 * start, deadline=math.inf)
    except _SearchTimeUp:
        fitting = [p["seq_length"] for p in probes if p["fits"]]
        good = max(fitting, default=None)
        failing = [p["seq_length"] for p in probes if not p["fits"] and (good is None or p["seq_length"] > good)]
        found = {"largest_fitting": good, "smallest_failing": min(failing, default=None), "time_limited": True,
                 "capped": False}
    finally:
        gc_free()
    return {"budget_bytes": budget_bytes, **found, "probes": probes}


# ----------------------------------------------------------------------------------------------
# Records and report

FIELDS = ("ep", "kind", "dispatcher", "impl", "shape", "tokens_per_rank", "ms", "peak_bytes", "recv_rows",
          "unique_token_rank_pairs", "token_expert_pairs", "errors", "passed")


def record(rank: Rank, kind: str, dispatcher: str, args, tokens=None, **fields) -> dict:
    """One JSON record: the common fields (None where they do not apply), then ``fields``."""
    d, h, num_experts, topk = SHAPES[args.shape][0]
    row = dict.fromkeys(FIELDS)
    row.update(ep=rank.world, kind=kind, dispatcher=dispatcher, impl=dict(dispatchers(args))[dispatcher],
               shape={"name": args.shape, "hidden": d, "ffn": h, "experts": num_experts, "topk": topk},
               tokens_per_rank=tokens)
    row.update(fields)
    return row


def environment(device) -> dict:
    import megatron.core

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.argv[0], *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "gpus_visible": torch.cuda.device_count() if device.type == "cuda" else 0,
        "backend": "gloo" if device.type == "cpu" else "nccl",
        "dtype": "bf16" if device.type == "cuda" else "fp32",
        "torch": torch.__version__,
        "triton": triton_version,
        "megatron_core": megatron.core.__version__,
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
    }


def _cell(value, scale=1.0, fmt="{:.2f}") -> str:
    return "-" if value is None else fmt.format(value / scale)


def format_table(records: list[dict]) -> str:
    lines = [("| EP | part | implementation | ms | peak MiB | recv rows (all ranks) | unique (token, rank) | "
              "(token, expert) | result |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["kind"] == "equivalence":
            result = f"max rel. err {max(r['errors']['vs reference'].values()):.1e}"
            if r["passed"] is not None:
                result = f"{'PASS' if r['passed'] else 'FAIL ' + ', '.join(r['failed'])} ({result})"
        elif r["kind"] == "model step":
            result = f"first loss {r['first_step_loss']:.5f}"
        elif r["kind"] == "longest sequence":
            result = f"seq {r['largest_fitting']} in {r['memory_budget_bytes'] / 2**30:g} GiB"
        else:
            result = ""
        moved = [None if r[k] is None else sum(r[k]) for k in ("recv_rows", "unique_token_rank_pairs", "token_expert_pairs")]
        lines.append(f"| {r['ep']} | {r['kind']} | {r['impl']} | {_cell(r['ms'])} | {_cell(r['peak_bytes'], 2**20, '{:.0f}')} | "
                     f"{_cell(moved[0], fmt='{:.0f}')} | {_cell(moved[1], fmt='{:.0f}')} | {_cell(moved[2], fmt='{:.0f}')} | {result} |")
    return "\n".join(lines)


def problems(records: list[dict]) -> list[str]:
    """What makes the run fail: an equivalence failure, or MoEBlaze receiving more rows than the
    unique (token, rank) pairs sent to a rank."""
    found = []
    for r in records:
        if r["kind"] == "equivalence" and r["passed"] is False:
            found.append(f"equivalence failed: {', '.join(r['failed'])}")
        if r["dispatcher"] == "moeblaze" and r["recv_rows"] is not None and r["ep"] > 1:  # the alltoall mode
            over = [i for i, (got, pairs) in enumerate(zip(r["recv_rows"], r["unique_token_rank_pairs"])) if got > pairs]
            if over:
                found.append(f"{r['kind']}: moeblaze received more rows than unique (token, rank) pairs on ranks {over}")
    return found


def run(args) -> int:
    """Parts 1 to 4 for parsed arguments (bench_expert_parallel.py's) on this torchrun rank; rank 0
    prints progress, writes ep{N}.json under ``args.out`` and prints the table last. The exit
    status: 1 if the equivalence fails or MoEBlaze received more rows than unique (token, rank)
    pairs."""
    rank = Rank()
    device = torch.device("cuda", rank.local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda" and rank.local_rank >= torch.cuda.device_count():
        raise SystemExit(f"local rank {rank.local_rank} has no GPU ({torch.cuda.device_count()} visible): "
                         f"--nproc-per-node must not exceed the GPU count")
    num_experts = SHAPES[args.shape][0][2]
    if num_experts % rank.world:
        raise SystemExit(f"--shape {args.shape} has {num_experts} experts, not divisible by the world size "
                         f"{rank.world} (EP = world size)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference must be float32
        torch.backends.cudnn.allow_tf32 = False
    path = Path(args.out) / f"ep{rank.world}.json"
    env = environment(device)
    records = []

    def keep(new: list[dict]) -> None:
        """Add records; rank 0 rewrites the file, so that a run stopped by a time limit keeps the
        parts it finished."""
        records.extend(new)
        if rank.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"environment": env, "records": records}, indent=1) + "\n")

    with megatron_world(device, rank.rank, rank.world, expert_model_parallel_size=rank.world):
        rank.say(f"EP = {rank.world} on {rank.world} x {device.type}, shape {args.shape}, "
                 f"{'bf16' if dtype == torch.bfloat16 else 'fp32'}")
        rank.say(f"1. equivalence, {args.check_tokens} tokens per rank ...")
        keep(check_layer(args, rank, device, dtype))
        for r in records:
            rank.say(f"   {r['impl']}: worst relative error {max(r['errors']['vs reference'].values()):.2e} against "
                     f"the reference" + ("" if r["passed"] is None else f": {'PASS' if r['passed'] else 'FAIL'} "
                                         f"(bar {r['tolerance']:.1e} or twice stock's)"))
        rank.say(f"2. layer step, {args.time_tokens} tokens per rank ...")
        keep(time_layer(args, rank, device, dtype))
        if args.skip_model:
            rank.say("3./4. model step and sequence search skipped (--skip-model)")
        else:
            rank.say(f"3. model step, {args.micro_batch_size} x {args.seq_length} tokens per rank"
                     + (" (4. longest sequence: skipped on the CPU, it needs the CUDA allocator's peak)"
                        if device.type == "cpu" else "") + " ...")
            keep(time_model(args, rank, device))
    failures = problems(records)
    if rank.rank == 0:
        rank.say(f"wrote {path}")
        print(format_table(records), flush=True)
        for failure in failures:
            print(f"FAILED: {failure}", flush=True)
    return 1 if failures else 0
