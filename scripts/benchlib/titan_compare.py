"""torchtitan: train stock torchtitan and the MoEBlaze override from the same weights and data,
and a control run (stock from weights moved by one bfloat16 ulp); compare step time, tokens/s,
peak memory, the bytes the MoE layers save for backward, the largest micro-batch that fits a
memory budget, and the loss curves against the measured rounding noise
(scripts/compare_torchtitan.py says how).

torch and torchtitan are imported by the functions, after ``install_fsdp_stand_in``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

from .comparison import (REPO, ArgumentError, Progress, argument_errors, comparison_ratios, loss_check, mib, plot,
                         record_step, summarize)
from .memory_search import fits_in_memory, gc_free, largest_fitting, largest_text, probe_line
from .wording import faster, larger, less

DEFAULT_OUT = REPO / "runs" / "compare_torchtitan"  # git-ignored (/runs/)
DEFAULTS = {
    "cpu": dict(family="tiny", seq_len=64, local_batch_size=4, steps=20, warmup=2, lr=3e-3, backend="reference",
                search="none", cuda_graphs="off", time_budget=0.0),
    "cuda": dict(family="qwen3_moe", seq_len=4096, local_batch_size=2, steps=30, warmup=5, lr=3e-4, backend="auto",
                 search="micro-batch", cuda_graphs="on", time_budget=300.0),
}


def install_fsdp_stand_in() -> bool:
    """torchtitan 0.3.0's model packages import ``torch.distributed.fsdp.DataParallelMeshDims``
    (torch >= 2.12) for the type hints of its FSDP helpers; torch 2.11 lacks it. Where it is
    missing, put a clearly named stand-in in its place that raises if anything constructs it:
    on one GPU torchtitan never does (``resolve_fsdp_mesh`` passes None for a mesh of one,
    ``resolve_sparse_fsdp_mesh`` returns None without EP), so a run that finishes used none.
    Returns whether the stand-in was installed. Benchmark path only."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        return False

    class DataParallelMeshDims:  # noqa: D401 - a stand-in, not torch's class
        """STAND-IN (moeblaze benchmark) for torch >= 2.12's DataParallelMeshDims."""

        def __init__(self, *args, **kwargs):
            raise RuntimeError("the benchmark's stand-in for torch.distributed.fsdp.DataParallelMeshDims was "
                               "constructed: this torch lacks the real one and this configuration needs it")

    fsdp.DataParallelMeshDims = DataParallelMeshDims
    return True


def resolve(args):
    """Check the arguments and fill the per-device defaults, before anything is built or trained;
    returns the device. An argument that cannot run raises ArgumentError naming the flag."""
    import torch

    from moeblaze_megatron.training.families import cpu_refusal, fits_cpu
    from moeblaze_megatron.training.titan_models import TITAN_FAMILIES

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ArgumentError("--device cuda: no CUDA device is available")
    device = torch.device("cuda", torch.cuda.current_device()) if (
        args.device != "cpu" and torch.cuda.is_available()) else torch.device("cpu")
    for name, value in DEFAULTS[device.type].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.family not in TITAN_FAMILIES:
        raise ArgumentError(f"--family must be one of {', '.join(TITAN_FAMILIES)}, got {args.family!r}")
    if device.type == "cpu":
        refusal = cpu_refusal("--family", args.family, TITAN_FAMILIES[args.family].parameters(),
                              [name for name, f in TITAN_FAMILIES.items() if fits_cpu(f.parameters())])
        if refusal:
            raise ArgumentError(refusal)
        if args.cuda_graphs == "on":
            raise ArgumentError("--cuda-graphs on needs a GPU (CUDA graphs capture CUDA work); use --cuda-graphs off")
    if device.type == "cpu" and args.search != "none":
        raise ArgumentError("--search needs a GPU (it measures the CUDA allocator's peak); use --search none")
    if not 0 <= args.warmup < args.steps:
        raise ArgumentError(f"--warmup ({args.warmup}) must be at least 0 and smaller than --steps ({args.steps})")
    if getattr(args, "loss", "auto") == "auto":
        from moeblaze_megatron.training.titan_loop import default_loss

        args.loss = default_loss()
    return device


class SavedForBackward:
    """Bytes autograd saves for backward during one forward pass, parameters excluded (each
    storage counted once, whole): in the whole model, and inside the routed experts of its MoE
    layers. Parameters are recognized when a module above them starts its forward (FSDP's
    unsharded copies exist only then)."""

    def __init__(self, model, routed_experts):
        self.model, self.routed_experts = model, routed_experts
        self.total = self.moe = 0

    @contextlib.contextmanager
    def counting(self):
        import torch

        params, everything, moe = set(), {}, {}
        inside = [0]
        handles = []
        for module in self.model.modules():
            # Every parameter below the module: a module may read a child's parameters without
            # calling the child (the override reads GroupedExperts' weights).
            handles.append(module.register_forward_pre_hook(lambda m, a: params.update(_storages(m.parameters()))))
        for module in self.routed_experts:
            handles.append(module.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, inside[0] + 1)))
            handles.append(module.register_forward_hook(lambda m, a, o: inside.__setitem__(0, inside[0] - 1)))

        def pack(tensor):
            storage = tensor.untyped_storage()
            try:
                key = storage.data_ptr()
            except RuntimeError:
                # No memory behind it now (a parameter FSDP resharded, saved again as backward
                # unshards it): nothing kept.
                return tensor
            if key not in params:
                everything[key] = storage.nbytes()
                if inside[0]:
                    moe[key] = storage.nbytes()
            return tensor

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                yield
        finally:
            for handle in handles:
                handle.remove()
        # A storage first seen as an activation and later as a parameter is a parameter.
        self.total = sum(v for k, v in everything.items() if k not in params)
        self.moe = sum(v for k, v in moe.items() if k not in params)


def _storages(tensors) -> set[int]:
    """Data pointers of the tensors' storages, leaving out storages FSDP has freed (resharded)."""
    out = set()
    for tensor in tensors:
        try:
            out.add(tensor.untyped_storage().data_ptr())
        except RuntimeError:  # "invalid python storage": no memory behind it now
            pass
    return out


def train(trainer, label, steps, progress, measure_saved=True, allocated_before=0) -> dict:
    import torch

    record = {"dispatcher": trainer.run.label, "losses": [], "step_seconds": [], "tokens_per_step": None,
              "phase_seconds": {}}
    if not measure_saved:
        record["saved_activation_bytes"] = record["saved_moe_bytes"] = None
    for i in range(steps):
        if i == 0 and measure_saved:
            saved = SavedForBackward(trainer.model, trainer.routed_experts())
            result = trainer.train_step(forward_context=saved.counting)
            record["saved_activation_bytes"] = saved.total
            record["saved_moe_bytes"] = saved.moe
        else:
            result = trainer.train_step()
        record_step(record, result, label, i, steps, progress, trainer.step)
        for phase, seconds in result.phases.items():
            record["phase_seconds"].setdefault(phase, []).append(seconds)
    if trainer.device.type == "cuda":
        record["peak_memory_bytes"] = torch.cuda.max_memory_allocated(trainer.device) - allocated_before
    return record


def search_micro_batch(trainer, budget_bytes, time_limit, progress, allocated_before=0) -> dict:
    """Largest micro-batch whose training steps stay within ``budget_bytes``: doubling then
    bisection, two eager steps per probe on random tokens under an allocator cap at the budget."""
    import torch

    device = trainer.device
    # The captured step's memory pool would stay reserved during the probes (the larger, stock's,
    # the less room left): free it first.
    trainer.release_cuda_graph()
    generator = torch.Generator().manual_seed(0)
    total = torch.cuda.get_device_properties(device).total_memory
    probes = []

    def fits(batch: int) -> bool:
        began = time.perf_counter()

        def two_steps():
            for _ in range(2):
                trainer.train_step(trainer.random_batch(batch, trainer.run.seq_len, generator), eager=True)

        record = fits_in_memory(device, two_steps, budget_bytes, allocated_before, trainer.forget_failed_step)
        trainer.optimizers.zero_grad(set_to_none=not trainer.run.cuda_graphs)
        probes.append({"value": batch, "tokens": batch * trainer.run.seq_len, **record,
                       "seconds": time.perf_counter() - began})
        progress(probe_line(f"micro-batch {batch:4d}", record))
        return record["fits"]

    torch.cuda.set_per_process_memory_fraction(min(1.0, (budget_bytes + allocated_before) / total), device)
    try:
        found = largest_fitting(fits, trainer.run.local_batch_size, 1, 64 * trainer.run.local_batch_size,
                                time.perf_counter() + time_limit, recheck=True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        gc_free()
    return {"dimension": "micro-batch", "budget_bytes": budget_bytes, **found, "probes": probes}


def routed_experts_seconds(trainer, repeats: int = 10, warmup: int = 3, profile_to=None) -> tuple[float, float]:
    """Seconds of one MoE layer's routed experts alone, forward and backward (gradients of the
    input, the scores and the weights), at the run's tokens per step on balanced random routing:
    the experts' share of a step, measured the same way for stock and the override. Two medians:
    per call (each call timed alone and waited for, so the host's time to its first kernel is in
    it) and queued (``repeats`` calls back to back, one wait: the GPU's time per call, as in a
    step that runs ahead of the host or in a CUDA graph).
    The layer's FSDP unit is unsharded around it as in the step (bf16 weights); gradients are
    returned, not accumulated. Under ``--compile`` the layer is compiled as the step's blocks are
    (fullgraph, the run's backend), so stock's permutation and combine are fused as in its step.
    CUDA events on a GPU, the host clock on the CPU. ``profile_to``: a file for torch.profiler's
    table of one more queued timing (ops and kernels by total time)."""
    import torch

    from moeblaze_megatron.training.titan_models import TITAN_FAMILIES

    device = trainer.device
    block = next(iter(trainer.model.layers.values()))
    routed = block.moe.routed_experts
    if trainer.run.compile != "off":
        routed = torch.compile(routed, backend=trainer.run.compile, fullgraph=True)
    block.unshard()
    try:
        params = [p for p in routed.parameters() if p.requires_grad]
        num_experts, dim = params[0].shape[0], params[0].shape[-1]
        B, L, K = trainer.run.local_batch_size, trainer.run.seq_len, TITAN_FAMILIES[trainer.run.family].top_k
        generator = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(B, L, dim, device=device, generator=generator).to(params[0].dtype).requires_grad_()
        # K distinct experts per token, uniformly: the balanced routing of a fresh router.
        ids = torch.rand(B * L, num_experts, device=device, generator=generator).argsort(-1)[:, :K]
        ids = ids.reshape(B, L, K).contiguous()
        scores = torch.rand(B, L, K, device=device, generator=generator).softmax(-1).requires_grad_()
        counts = torch.bincount(ids.flatten(), minlength=num_experts)
        grad_y = torch.randn_like(x)

        def call():
            with trainer.context():
                y = routed(x, scores, ids, counts)
            torch.autograd.grad(y, [x, scores, *params], grad_y)

        per_call = [_timed(call, device, 1) for _ in range(warmup + repeats)][warmup:]
        queued = [_timed(call, device, repeats) for _ in range(3)]
        if profile_to is not None:
            _profile(call, device, repeats, profile_to)
    finally:
        block.reshard()
    return statistics.median(per_call), statistics.median(queued)


def _profile(fn, device, calls: int, path) -> None:
    """torch.profiler's table of ``calls`` queued calls of ``fn``, sorted by device time on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        _timed(fn, device, calls)
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=40,
                                      max_name_column_width=70)
    path.write_text(f"{calls} calls, queued\n{table}\n")


def _timed(fn, device, calls: int) -> float:
    """Seconds per call of ``calls`` calls of ``fn`` back to back, waited for once."""
    import torch

    if device.type != "cuda":
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - began) / calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def environment(device, stand_in: bool) -> dict:
    import torch
    import torchtitan

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "torchtitan": getattr(torchtitan, "__version__", "?"), "device": str(device),
            "fsdp_DataParallelMeshDims_stand_in": stand_in}
    if device.type == "cuda":
        import triton

        info["gpu"] = torch.cuda.get_device_name(device)
        info["triton"] = triton.__version__
    else:
        info["cpu_threads"] = torch.get_num_threads()
    return info


def _runs(args, device, cuda_graphs: bool):
    from moeblaze_megatron.training.titan_loop import TitanRun

    common = dict(family=args.family, attention=args.attention, local_batch_size=args.local_batch_size,
                  seq_len=args.seq_len, steps=args.steps, lr=args.lr, warmup_steps=max(1, args.steps // 10),
                  seed=args.seed, activation_checkpoint=args.activation_checkpoint, cuda_graphs=cuda_graphs,
                  loss=args.loss, compile=args.compile)
    options = {"backend": args.backend, "recompute": args.recompute}
    # The control before the candidate: the candidate's search, last, gets what the time budget
    # leaves.
    return (("baseline", TitanRun(**common), 0.0), ("control", TitanRun(**common), 1.0),
            ("candidate", TitanRun(override=options, **common), 0.0))


def compare(args, device, progress, cuda_graphs: bool, partial: Path | None = None,
            profile_dir: Path | None = None) -> dict:
    """The three runs, the searches and the loss check; ``partial``: where the record so far is
    written after each run (a run stopped by a time limit still leaves what it measured);
    ``profile_dir``: where each run's routed-experts profile goes (None: not profiled)."""
    import torch

    from moeblaze_megatron.training.titan_loop import TitanTrainer

    result = {"config": {**vars(args), "cuda_graphs_used": cuda_graphs}, "runs": {}}
    initial_state = None
    for name, run, ulps in _runs(args, device, cuda_graphs):
        label = run.label + (" control (weights +-1 bf16 ulp)" if ulps else "")
        progress(f"{name}: building {args.family} with {run.label} experts ...")
        allocated_before = 0
        if device.type == "cuda":
            gc_free()
            allocated_before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        trainer = TitanTrainer(run, device, initial_state=initial_state, perturb_ulps=ulps)
        if initial_state is None:
            initial_state = trainer.full_state()
        record = train(trainer, label, args.steps, progress, measure_saved=name != "control" and args.count_saved == "on",
                       allocated_before=allocated_before)
        summarize(record, args.warmup)
        record["median_phase_seconds"] = {phase: statistics.median(times[args.warmup:])
                                          for phase, times in record["phase_seconds"].items()}
        result["runs"][name] = record
        if name != "control":
            profile_to = profile_dir / f"layer_profile_{run.label}.txt" if profile_dir is not None else None
            (record["routed_experts_seconds_per_layer"],
             record["routed_experts_queued_seconds_per_layer"]) = routed_experts_seconds(trainer, profile_to=profile_to)
            record["moe_layers"] = len(trainer.routed_experts())
        if name != "control":
            progress(f"  {run.label}: median {record['median_step_seconds'] * 1e3:.1f} ms/step, "
                     f"{record['tokens_per_second']:,.0f} tokens/s, MoE saved {mib(record['saved_moe_bytes'])} MiB"
                     + (f", peak {mib(record['peak_memory_bytes'])} MiB" if "peak_memory_bytes" in record else ""))
        if args.search != "none" and name != "control":
            limit = args.search_time_limit
            if args.time_budget:
                # What the budget leaves, less a little for the runs and the report after it.
                left = args.time_budget - (time.perf_counter() - progress.start)
                limit = min(limit, left - (20 if name == "baseline" else 5))
            if limit < 10:
                progress(f"  no time left for the {run.label} search (--time-budget {args.time_budget:g}s)")
                result.setdefault("search", {"dimension": args.search})[name] = {"largest_fitting": None,
                                                                                 "skipped": "time budget"}
            else:
                progress(f"  searching the largest micro-batch within {args.memory_budget_gib:g} GiB "
                         f"(at most {limit:.0f}s) ...")
                result.setdefault("search", {"dimension": args.search})[name] = search_micro_batch(
                    trainer, int(args.memory_budget_gib * 2**30), limit, progress, allocated_before)
        trainer.close()
        del trainer
        if partial is not None:
            partial.write_text(json.dumps(result, indent=1, default=str) + "\n")
    base, cand = result["runs"]["baseline"], result["runs"]["candidate"]
    # The model computes in bfloat16 (FSDP's mixed precision, GroupedExperts' casts).
    check = loss_check(base["losses"], cand["losses"], result["runs"]["control"]["losses"],
                       torch.finfo(torch.bfloat16).eps / 2, base["tokens_per_step"])
    result["loss_check"] = check
    result["ratios"] = comparison_ratios(base, cand, result.get("search"),
                                         byte_keys=("saved_moe_bytes", "saved_activation_bytes"))
    result["ratios"]["step_time_speedup_bound"] = speedup_bound(base)
    return result


def speedup_bound(base: dict) -> float | None:
    """The step-time speedup over stock if routed experts took no time: stock's step over that step
    less its layers' queued routed-expert time; the rest of the step (attention, router, clip,
    optimizer) is common to both runs. None where the timings leave no rest (tiny CPU models)."""
    rest = base["median_step_seconds"] - base["moe_layers"] * base["routed_experts_queued_seconds_per_layer"]
    return base["median_step_seconds"] / rest if rest > 0 else None


def table(result: dict) -> str:
    """The short table printed last."""
    runs, ratios, check = result["runs"], result["ratios"], result["loss_check"]
    search = result.get("search")
    lines = [f"torchtitan {result['environment']['torchtitan']} {result['config']['family']} on "
             f"{result['environment'].get('gpu', result['environment']['device'])}, "
             f"{result['config']['local_batch_size']} x {result['config']['seq_len']} tokens, "
             f"cuda graphs {'on' if result['config']['cuda_graphs_used'] else 'off'}, "
             f"attention {result['config']['attention']}, AC {result['config']['activation_checkpoint']}, "
             f"{result['config']['loss']} loss, compile {result['config']['compile']}",
             "| run | median step ms | tokens/s | peak MiB | MoE saved MiB | model saved MiB | largest micro-batch |",
             "|---|---|---|---|---|---|---|"]
    for name in ("baseline", "candidate"):
        r = runs[name]
        largest = largest_text(search[name]) if search else "-"
        lines.append(f"| {r['dispatcher']} | {r['median_step_seconds'] * 1e3:.1f} | {r['tokens_per_second']:,.0f} | "
                     f"{mib(r.get('peak_memory_bytes'))} | {mib(r['saved_moe_bytes'])} | "
                     f"{mib(r['saved_activation_bytes'])} | {largest} |")
    bound = ratios.get("step_time_speedup_bound")
    said = [f"step time {faster(ratios['step_time_speedup'])} than stock"
            + (f" ({faster(bound)} if its routed experts took no time)" if bound else "")]
    if ratios.get("saved_moe_fraction"):
        said.append(f"MoE saved for backward {less(ratios['saved_moe_fraction'])}")
    if ratios.get("peak_memory_fraction"):
        said.append(f"peak memory {less(ratios['peak_memory_fraction'])}")
    if ratios.get("largest_fitting_ratio"):
        said.append(f"largest micro-batch {larger(ratios['largest_fitting_ratio'])}")
    lines.append(f"{runs['candidate']['dispatcher']}: " + "; ".join(said))
    phases = [f"{runs[name]['dispatcher']} " + ", ".join(
        f"{phase.replace('_', '+')} {seconds * 1e3:.1f}" for phase, seconds in runs[name]["median_phase_seconds"].items())
        for name in ("baseline", "candidate")]
    lines.append("median ms per phase of a step: " + "; ".join(phases))
    experts = [(runs[name]["dispatcher"], runs[name]["routed_experts_seconds_per_layer"],
                runs[name]["routed_experts_queued_seconds_per_layer"], runs[name]["moe_layers"],
                runs[name]["median_step_seconds"]) for name in ("baseline", "candidate")]
    lines.append("routed experts alone, fwd+bwd per layer (balanced routing), per call / queued: " + "; ".join(
        f"{label} {seconds * 1e3:.2f} / {queued * 1e3:.2f} ms (x {layers} layers = "
        f"{100 * queued * layers / step:.0f}% of its step)"
        for label, seconds, queued, layers, step in experts))
    lines.append(f"losses {'agree' if check['passed'] else 'DIVERGE'}: worst |moeblaze - stock| / tolerance = "
                 f"{check['worst_diff_over_tolerance']:.2f} over {len(check['steps'])} steps")
    return "\n".join(lines)


def run(args, command: str) -> int:
    """The comparison of parsed arguments (compare_torchtitan.py's); JSON under --out (default
    $OUT, else runs/compare_torchtitan/<family>-<cpu|gpu>); the exit status."""
    progress = Progress()
    progress("importing torch and torchtitan ...")
    stand_in = install_fsdp_stand_in()
    if stand_in:
        progress("torch lacks torch.distributed.fsdp.DataParallelMeshDims: a stand-in that raises if used is "
                 "in its place (benchmark path only)")
    import torch

    from moeblaze_megatron.training.titan_loop import single_process

    device, status = argument_errors("compare_torchtitan.py", resolve, args)
    if status:
        return status
    out = Path(args.out or os.environ.get("OUT") or DEFAULT_OUT / f"{args.family}-{'gpu' if device.type == 'cuda' else 'cpu'}")
    progress(f"outputs go to {out}/")
    progress(f"every run trains with the {args.loss} loss" + (
        " (torch < 2.12: stock torchtitan's chunked loss cannot train there)" if args.loss == "plain" else ""))
    with single_process(device):
        graphs = args.cuda_graphs == "on" and device.type == "cuda"
        out.mkdir(parents=True, exist_ok=True)
        partial = out / "compare_torchtitan.partial.json"
        profile_dir = out if args.profile_layer == "on" else None
        try:
            result = compare(args, device, progress, graphs, partial, profile_dir)
        except Exception as error:  # noqa: BLE001 - reported, then the eager comparison
            if not graphs:
                raise
            progress(f"with CUDA graphs the comparison failed ({type(error).__name__}: {error}); "
                     "again with eager steps for every run")
            torch.cuda.empty_cache()
            result = compare(args, device, progress, False, partial, profile_dir)
            result["cuda_graphs_error"] = f"{type(error).__name__}: {error}"
    result["environment"] = environment(device, stand_in)
    result["command"] = command.strip()
    partial.unlink(missing_ok=True)
    (out / "compare_torchtitan.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    plotted = plot(out / "losses.png", result)
    progress(f"wrote {out / 'compare_torchtitan.json'}" + (" and losses.png (the loss overlay)" if plotted else ""))
    print()
    print(table(result), flush=True)
    if not result["loss_check"]["passed"]:
        print("FAILED: losses diverge beyond rounding noise", flush=True)
        return 1
    return 0
