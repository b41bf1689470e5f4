"""Train one model with the stock dispatcher, with MoEBlaze and with a control run (the stock
run, or the MoEBlaze run, from weights moved by one ulp), and compare: step time, memory, the loss
curves against the measured rounding noise, and a checkpoint resumed under either dispatcher
(scripts/compare_dispatchers.py says how the noise bound is drawn).

The stock side is a Megatron dispatcher with SequentialMLP (``--baseline alltoall``, what runs
without Transformer Engine) or ``alltoall_te``: the alltoall dispatcher with TEGroupedMLP and the
speed options of one of ``training.families.TE_STOCK_VARIANTS``; given several, each is timed for
a few steps from the same weights on the same batches and the fastest is the baseline.

torch and Megatron are imported by the functions, so that a caller can print progress first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shlex
import shutil
import tempfile
import warnings
from pathlib import Path

from .comparison import (REPO, ArgumentError, Progress, argument_errors, comparison_ratios, loss_check, mib, plot,
                         record_step, summarize)
from .dispatcher_report import markdown, variants_markdown
from .memory_search import gc_free, search_memory

DEFAULT_DATA_PREFIX = REPO / "data" / "pystdlib_text_document"
DEFAULT_OUT = REPO / "runs" / "compare"  # git-ignored (/runs/)

# Per-device defaults: the CPU runs the tiny model in fp32 against the allgather dispatcher (the
# stock one that runs there); the GPU runs a Qwen3-MoE-like model in bf16 against alltoall +
# SequentialMLP, what Megatron runs without Transformer Engine.
DEFAULTS = {
    "cpu": dict(family="tiny", baseline="allgather", seq_length=64, micro_batch_size=4, steps=60,
                warmup=2, lr=3e-3, search="none"),
    "cuda": dict(family="qwen3_moe", baseline="alltoall", seq_length=4096, micro_batch_size=2, steps=40,
                 warmup=5, lr=3e-4, search="micro-batch"),
}
RESUME_STEPS = 12  # of the tiny model; the checkpoint is written half way
# The resume check's runs: the tiny model whatever the family.
RESUME_RUN = dict(family="tiny", seq_length=64, micro_batch_size=4, train_iters=RESUME_STEPS, lr=3e-3, min_lr=3e-4,
                  warmup_iters=2)
# The stock MoE Megatron users run with Transformer Engine: alltoall + TEGroupedMLP + a variant's
# speed options (training.families.TE_STOCK_VARIANTS).
TE_BASELINE = "alltoall_te"
VARIANT_WARMUP = 3  # first steps of a variant's trial left out of its median (compilation, TE setup)


def resolve(args):
    """Check every argument and fill the per-device defaults, before anything is built or trained;
    returns the device. An argument that cannot run raises ArgumentError naming the flag."""
    import torch

    from moeblaze_megatron.training.families import (
        MODEL_FAMILIES,
        cpu_refusal,
        family_parameters,
        megatron_cpu_families,
    )
    from moeblaze_megatron.megatron_plugin import MOEBLAZE
    from moeblaze_megatron.training.train_loop import megatron_dispatchers

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ArgumentError("--device cuda: no CUDA device is available")
    if args.device == "cpu" or not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    for name, value in DEFAULTS[device.type].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.family not in MODEL_FAMILIES:
        raise ArgumentError(f"--family must be one of {', '.join(MODEL_FAMILIES)}, got {args.family!r}")
    if device.type == "cpu":
        refusal = cpu_refusal("--family", args.family, family_parameters(args.family), megatron_cpu_families())
        if refusal:
            raise ArgumentError(refusal)
    dispatchers = megatron_dispatchers()
    stock = [d for d in dispatchers if d != MOEBLAZE]
    if args.baseline not in (*stock, TE_BASELINE):
        raise ArgumentError(f"--baseline must be one of {', '.join((*stock, TE_BASELINE))}, got {args.baseline!r}")
    if args.candidate not in dispatchers:
        raise ArgumentError(f"--candidate must be one of {', '.join(dispatchers)}, got {args.candidate!r}")
    if device.type == "cpu" and args.search != "none":
        raise ArgumentError("--search needs a GPU (it measures the CUDA allocator's peak); use --search none")
    if not 0 <= args.warmup < args.steps:
        raise ArgumentError(f"--warmup ({args.warmup}) must be at least 0 and smaller than --steps ({args.steps})")
    if args.data not in ("builtin", "mock"):
        if not all(Path(f"{args.data}{ext}").is_file() for ext in (".bin", ".idx")):
            raise ArgumentError(f"--data: no Megatron indexed dataset at {args.data} ({args.data}.bin and .idx); "
                                "expected builtin, mock or a dataset prefix")
    resolve_stock_form(args, device)
    check_megatron_args(args, device)
    return device


def check_megatron_args(args, device) -> None:
    """Every run's Megatron command line through Megatron's parser, its validation and the
    plugin's own check, the candidate's first (so that what MoEBlaze refuses is said as MoEBlaze
    says it), then the baseline's in each stock variant, then the resume check's; the first
    problem raises ArgumentError, naming --megatron-args where it comes from there."""
    from moeblaze_megatron.training.train_loop import megatron_argv_problem

    data_path = None if args.data in ("builtin", "mock") else args.data
    chosen = args.stock_variant
    runs = [dict()] + ([RESUME_RUN] if args.resume_check else [])
    try:
        for overrides in runs:
            for args.stock_variant in (args.stock_variants or [None]):
                for which in ("candidate", "baseline"):
                    dispatcher, extra, _ = form(args, which)

                    def problem(user_args):
                        spec = run_spec(args, device, dispatcher, data_path, extra, megatron_args=user_args,
                                        **overrides)
                        return megatron_argv_problem(spec.megatron_argv(device))

                    found = problem(args.megatron_args)
                    if found is None:
                        continue
                    if args.megatron_args and problem([]) is None:
                        raise ArgumentError(f"--megatron-args {shlex.join(args.megatron_args)}: {found}")
                    family = overrides.get("family", args.family)
                    raise ArgumentError(f"the {label(args, which)} run of --family {family}: Megatron refuses its "
                                        f"arguments: {found}")
    finally:
        args.stock_variant = chosen


def resolve_stock_form(args, device) -> None:
    """Check --baseline alltoall_te, --stock-variants, --attention and --control, and fill their
    defaults: the variants as a list of names, the attention core (Transformer Engine's with the
    TE baseline, SDPA otherwise), the stock variant in use (the first until a selection ran)."""
    from moeblaze_megatron.training.families import te_stock_variant

    defaults = {"stock_variants": None, "attention": None, "control": "baseline", "select_only": False,
                "variant_steps": 8}
    for name, value in defaults.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    te = args.baseline == TE_BASELINE
    if isinstance(args.stock_variants, str):
        args.stock_variants = [v for v in args.stock_variants.split(",") if v]
    if args.stock_variants and not te:
        raise ArgumentError(f"--stock-variants applies to --baseline {TE_BASELINE}, not --baseline {args.baseline}")
    if args.select_only and not te:
        raise ArgumentError(f"--select-only selects among the stock variants of --baseline {TE_BASELINE}")
    if te:
        if device.type != "cuda":
            raise ArgumentError(f"--baseline {TE_BASELINE} needs a GPU (Transformer Engine runs on CUDA)")
        from moeblaze_megatron.training.pretraining import have_transformer_engine

        if not have_transformer_engine():
            raise ArgumentError(f"--baseline {TE_BASELINE} needs Transformer Engine (import transformer_engine "
                             "failed); install it, or compare against --baseline alltoall (SequentialMLP)")
        args.stock_variants = args.stock_variants or ["te"]
        for name in args.stock_variants:
            try:
                te_stock_variant(name)
            except ValueError as error:
                raise ArgumentError(f"--stock-variants: {error}") from None
        if len(set(args.stock_variants)) != len(args.stock_variants):
            raise ArgumentError(f"--stock-variants names a variant twice: {args.stock_variants}")
        if args.variant_steps <= VARIANT_WARMUP:
            raise ArgumentError(f"--variant-steps must exceed the {VARIANT_WARMUP} warm-up steps, got {args.variant_steps}")
    args.stock_variant = args.stock_variants[0] if te else None
    if args.attention is None:
        args.attention = "auto" if te else "sdpa"
    if args.control not in ("baseline", "candidate"):
        raise ArgumentError(f"--control must be baseline or candidate, got {args.control!r}")


def form(args, which: str):
    """(Megatron dispatcher, extra Megatron flags, environment) of the run ``which`` ("baseline"
    or "candidate"): the TE baseline is alltoall with its variant's flags; the candidate shares
    the variant's model and recipe flags (the fused router, CUDA graphs, ...), not its dispatch
    and expert flags, and takes its own after them."""
    from moeblaze_megatron.training.families import te_stock_variant

    variant = te_stock_variant(args.stock_variant) if args.stock_variant else None
    if which == "candidate":
        return args.candidate, ((*variant.shared_args, *variant.candidate_args) if variant else ()), {}
    if variant is not None:
        return "alltoall", (*variant.stock_args, *variant.shared_args), dict(variant.env)
    return args.baseline, (), {}


def label(args, which: str) -> str:
    """How a run is named in the report: the dispatcher, and the TE baseline's variant."""
    if which == "baseline" and args.stock_variant:
        return f"{TE_BASELINE} [{args.stock_variant}]"
    return args.candidate if which == "candidate" else args.baseline


@contextlib.contextmanager
def environment_set(env: dict):
    """``env`` in os.environ for the block (a variant's TE switches), the old values restored."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ensure_dataset(args, progress) -> str | None:
    """The --data-path prefix for the run (building the built-in corpus if needed), or None for mock data."""
    if args.data == "mock":
        return None
    if args.data != "builtin":
        return args.data
    from moeblaze_megatron.training.corpus import build_byte_dataset, dataset_exists, stdlib_source_files

    if not dataset_exists(DEFAULT_DATA_PREFIX):
        progress(f"building the built-in corpus at {DEFAULT_DATA_PREFIX.relative_to(REPO)} ...")
        stats = build_byte_dataset(DEFAULT_DATA_PREFIX, stdlib_source_files())
        progress(f"  {stats['num_documents']} files, {stats['num_tokens']:,} byte tokens")
    return str(DEFAULT_DATA_PREFIX)


def run_spec(args, device, dispatcher: str, data_path, extra=(), megatron_args=None, **overrides):
    """The RunSpec of one run: ``dispatcher`` with ``extra`` Megatron flags, then --megatron-args
    (or ``megatron_args`` in their place)."""
    from moeblaze_megatron.training.train_loop import RunSpec

    extra = [*extra, *(args.megatron_args if megatron_args is None else megatron_args)]
    fields = dict(
        family=args.family, dispatcher=dispatcher, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, train_iters=args.steps, data_path=data_path,
        lr=args.lr, min_lr=args.lr / 10, warmup_iters=max(1, args.steps // 10), seed=args.seed,
        bf16=device.type == "cuda",
        # Megatron's gradient clipping asserts CUDA tensors; the CPU demo trains unclipped.
        clip_grad=1.0 if device.type == "cuda" else 0.0,
        attention=getattr(args, "attention", None) or "sdpa",
        extra_args=extra,
    )
    fields.update(overrides)
    return RunSpec(**fields)


def train(trainer, label: str, steps: int, progress, save_at: int | None = None, measure_saved: bool = True,
          allocated_before: int = 0):
    """Run ``steps`` steps; the first one also measures what autograd saves for backward.
    ``allocated_before``: CUDA bytes allocated before the trainer was built (what earlier runs
    still hold), taken out of the reported peak; the peak counter must be reset before the build."""
    import torch

    record = {"dispatcher": trainer.run.dispatcher, "losses": [], "step_seconds": [], "tokens_per_step": None}
    cuda = trainer.device.type == "cuda"
    for i in range(steps):
        if i == 0 and measure_saved:
            saved = SavedBytes(trainer.model)
            result = trainer.train_step(forward_context=saved.counting)
            record["saved_activation_bytes"] = saved.total
        else:
            result = trainer.train_step()
        record_step(record, result, label, i, steps, progress, trainer.iteration)
        if save_at is not None and trainer.iteration == save_at:
            trainer.save()
    if cuda:
        # The model, its optimizer state and the training steps; not what earlier runs hold.
        record["peak_memory_bytes"] = torch.cuda.max_memory_allocated(trainer.device) - allocated_before
    return record


class SavedBytes:
    """Bytes autograd keeps for backward during a micro-batch's forward pass (parameters
    excluded), the largest over the micro-batches counted. Every saved storage is counted once,
    whole: it stays alive until backward. Counting the forward only is exact because no saved
    storage is freed, and so none is reused, before backward starts. Tensors a custom autograd
    function keeps as plain attributes instead of through save_for_backward are not seen (the
    GPU's peak memory is the complete measure)."""

    def __init__(self, model_chunks):
        self.params = {p.untyped_storage().data_ptr() for m in model_chunks for p in m.parameters()}
        self.total = 0

    @contextlib.contextmanager
    def counting(self):
        import torch

        storages: dict[int, int] = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.params:
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self.total = max(self.total, sum(storages.values()))


def resume_check(args, device, data_path, progress, unit_roundoff: float) -> dict:
    """The tiny model: the stock run saves a Megatron checkpoint half way and goes on; that
    checkpoint is resumed under the stock dispatcher and under the candidate, and both must
    continue on the uninterrupted curve (within the same noise bound as the comparison)."""
    from moeblaze_megatron.training.train_loop import Trainer

    half = RESUME_STEPS // 2
    tiny = RESUME_RUN
    workdir = Path(tempfile.mkdtemp(prefix="moeblaze_resume_"))
    try:
        progress(f"resume check (tiny model, {RESUME_STEPS} steps, checkpoint at step {half}):")
        base, base_extra, base_env = form(args, "baseline")
        base_label = label(args, "baseline")
        with environment_set(base_env):
            trainer = Trainer(run_spec(args, device, base, data_path, base_extra, save=str(workdir), **tiny), device)
            initial = trainer.unwrapped_state_dict()
            uninterrupted = train(trainer, f"{base_label} (saves at {half})", RESUME_STEPS, progress,
                                  save_at=half, measure_saved=False)["losses"]
            trainer.close()
            trainer = Trainer(run_spec(args, device, base, data_path, base_extra, **tiny), device,
                              initial_state=initial, perturb_ulps=1.0)
            control = train(trainer, f"{base_label} control", RESUME_STEPS, progress, measure_saved=False)["losses"]
            trainer.close()
        results = {}
        for which in ("baseline", "candidate"):
            dispatcher, extra, env = form(args, which)
            name = label(args, which)
            with environment_set(env):
                trainer = Trainer(run_spec(args, device, dispatcher, data_path, extra, load=str(workdir), **tiny),
                                  device)
                if trainer.iteration != half:
                    raise RuntimeError(f"resumed at iteration {trainer.iteration}, expected {half}")
                resumed = train(trainer, f"{name} resumed", RESUME_STEPS - half, progress,
                                measure_saved=False)["losses"]
                trainer.close()
            dispatcher = name
            check = loss_check(uninterrupted[half:], resumed, control[half:], unit_roundoff,
                               tiny["seq_length"] * tiny["micro_batch_size"])
            results[dispatcher] = {"losses": resumed, "passed": check["passed"],
                                   "worst_diff_over_tolerance": check["worst_diff_over_tolerance"],
                                   "max_abs_diff": max(r["abs_diff"] for r in check["steps"])}
            progress(f"  resumed under {dispatcher}: max |diff| {results[dispatcher]['max_abs_diff']:.2e} "
                     f"({'ok' if check['passed'] else 'FAILED'})")
        return {"steps": RESUME_STEPS, "checkpoint_step": half, "uninterrupted": uninterrupted,
                "control": control, "resumed": results, "passed": all(r["passed"] for r in results.values())}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def environment(device) -> dict:
    import megatron.core
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "megatron_core": megatron.core.__version__, "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu_threads"] = torch.get_num_threads()
    return info


def write_outputs(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "report.md").write_text(markdown(result))
    plot(out / "losses.png", result)


def time_stock_variants(args, device, data_path, progress, initial_state=None):
    """Each of --stock-variants trained --variant-steps steps from the same weights on the same
    batches, its median step time after VARIANT_WARMUP steps; a variant that fails to build or
    train is recorded with its error. Returns ({name: record}, the initial state used)."""
    from moeblaze_megatron.training.families import te_stock_variant
    from moeblaze_megatron.training.train_loop import Trainer

    records = {}
    for name in args.stock_variants:
        variant = te_stock_variant(name)
        record = {"stock_args": list(variant.stock_args), "shared_args": list(variant.shared_args),
                  "candidate_args": list(variant.candidate_args),
                  "env": dict(variant.env), "note": variant.note}
        progress(f"stock variant {name}: {' '.join(variant.stock_args + variant.shared_args)}"
                 + "".join(f" with {k}={v}" for k, v in variant.env.items()))
        trainer = None
        try:
            with environment_set(variant.env):
                trainer = Trainer(run_spec(args, device, "alltoall", data_path, (*variant.stock_args, *variant.shared_args)),
                                  device, initial_state=initial_state)
                if initial_state is None:
                    initial_state = trainer.unwrapped_state_dict()
                timed = train(trainer, f"{TE_BASELINE} [{name}]", args.variant_steps, progress, measure_saved=False)
            summarize(timed, VARIANT_WARMUP)
            record.update(median_step_seconds=timed["median_step_seconds"], losses=timed["losses"],
                          step_seconds=timed["step_seconds"])
            progress(f"  {name}: median {timed['median_step_seconds'] * 1e3:.1f} ms/step")
        except Exception as error:  # a form this Megatron/TE/GPU cannot run is reported, not fatal
            record["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}"
            progress(f"  {name}: not run ({record['error']})")
        finally:
            if trainer is not None:
                trainer.close()
            del trainer
            gc_free()
        records[name] = record
    return records, initial_state


def fastest_variant(records: dict) -> str:
    """The name of the variant with the lowest median step time among those that ran."""
    timed = {name: r["median_step_seconds"] for name, r in records.items() if "median_step_seconds" in r}
    if not timed:
        errors = "; ".join(f"{name}: {r.get('error', '?')}" for name, r in records.items())
        raise SystemExit(f"--stock-variants: no variant ran ({errors})")
    return min(timed, key=lambda name: (timed[name], name))


def select_stock_variant(args, device, data_path, progress, initial_state=None):
    """Time the stock variants (when there are several, or --select-only asks), set
    ``args.stock_variant`` to the fastest; returns (the selection record or None, initial state)."""
    if args.baseline != TE_BASELINE or (len(args.stock_variants) == 1 and not args.select_only):
        return None, initial_state
    records, initial_state = time_stock_variants(args, device, data_path, progress, initial_state)
    args.stock_variant = fastest_variant(records)
    progress(f"fastest stock variant: {args.stock_variant} "
             f"({records[args.stock_variant]['median_step_seconds'] * 1e3:.1f} ms/step)")
    return {"variants": records, "chosen": args.stock_variant, "steps": args.variant_steps,
            "warmup": VARIANT_WARMUP}, initial_state


def compare(args, device, progress, save_partial=None) -> dict:
    """The stock variant selection (--baseline alltoall_te with several), the baseline, candidate
    and control runs, the loss check, the memory search (GPU) and the resume check, as
    compare.json's record (its "command" left to the caller). ``save_partial(result)`` is called
    after every run with what is measured so far (a run cut short keeps it)."""
    import torch

    from moeblaze_megatron.training.train_loop import Trainer

    data_path = ensure_dataset(args, progress)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    unit_roundoff = torch.finfo(dtype).eps / 2
    progress(f"{args.family} model, {args.steps} steps of {args.micro_batch_size} x {args.seq_length} tokens, "
             f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} on {device}; data: "
             f"{data_path or 'mock'}")
    result = {"config": {**{k: v for k, v in vars(args).items()}, "memory_budget_gib": args.memory_budget_gib},
              "environment": environment(device), "runs": {}}
    selection, initial_state = select_stock_variant(args, device, data_path, progress)
    if selection is not None:
        result["stock_selection"] = selection
        result["config"]["stock_variant"] = args.stock_variant
    runs = (("baseline", "baseline", 0.0), ("candidate", "candidate", 0.0), ("control", args.control, 1.0))
    for name, which, ulps in runs:
        dispatcher, extra, env = form(args, which)
        shown = label(args, which) + (" control (weights +-1 ulp)" if ulps else "")
        progress(f"{name}: building the {args.family} model: {shown}" + (f" ({' '.join(extra)})" if extra else "")
                 + " ...")
        allocated_before = 0
        if device.type == "cuda":
            gc_free()
            allocated_before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        with environment_set(env):
            trainer = Trainer(run_spec(args, device, dispatcher, data_path, extra), device,
                              initial_state=initial_state, perturb_ulps=ulps)
            if initial_state is None:
                initial_state = trainer.unwrapped_state_dict()  # on the CPU
            record = train(trainer, shown, args.steps, progress, measure_saved=name != "control",
                           allocated_before=allocated_before)
            record.update(label=label(args, which), repeats=which, extra_args=list(extra))
            summarize(record, args.warmup)
            result["runs"][name] = record
            if name != "control":
                progress(f"  {record['label']}: median {record['median_step_seconds'] * 1e3:.1f} ms/step, "
                         f"{record['tokens_per_second']:,.0f} tokens/s, saved for backward "
                         f"{mib(record.get('saved_activation_bytes'))} MiB"
                         + (f", peak {mib(record['peak_memory_bytes'])} MiB" if "peak_memory_bytes" in record else ""))
            if args.search != "none" and name != "control":
                progress(f"  searching the largest {args.search} within {args.memory_budget_gib:g} GiB "
                         f"(at most {args.search_time_limit:g}s) ...")
                result.setdefault("search", {"dimension": args.search})[name] = search_memory(
                    trainer, args.search, int(args.memory_budget_gib * 2**30), args.search_time_limit, progress,
                    allocated_before)
            trainer.close()
        del trainer
        if save_partial is not None:
            save_partial(result)

    base, cand = result["runs"]["baseline"], result["runs"]["candidate"]
    check = loss_check(base["losses"], cand["losses"], result["runs"]["control"]["losses"], unit_roundoff,
                       base["tokens_per_step"], control_of=args.control)
    result["loss_check"] = check
    progress(f"losses {'agree' if check['passed'] else 'DIVERGE'}: worst |diff| / tolerance "
             f"{check['worst_diff_over_tolerance']:.2f}")
    result["ratios"] = comparison_ratios(base, cand, result.get("search"))
    if save_partial is not None:
        save_partial(result)
    if args.resume_check:
        result["resume"] = resume_check(args, device, data_path, progress, unit_roundoff)
    return result


def select_only(args, device, progress) -> dict:
    """--select-only: the stock variants timed, nothing else (variants.json's record)."""
    data_path = ensure_dataset(args, progress)
    selection, _ = select_stock_variant(args, device, data_path, progress)
    return {"config": {**vars(args)}, "environment": environment(device), "stock_selection": selection}


def finish(out: Path, result: dict, progress=print) -> int:
    """Write ``result``'s outputs under ``out`` (saying where through ``progress``), print the
    report and, where the losses diverge or the resume failed, why; 0 if both passed, else 1."""
    write_outputs(out, result)
    progress(f"wrote {_shown(out)}/compare.json, report.md, losses.png")
    print()
    print((out / "report.md").read_text())
    ok = result["loss_check"]["passed"] and (result.get("resume") or {"passed": True})["passed"]
    if not ok:
        print("FAILED: " + ("losses diverge beyond rounding noise" if not result["loss_check"]["passed"]
                            else "the resume check failed"), flush=True)
    return 0 if ok else 1


def _shown(path: Path) -> str:
    """``path`` relative to the checkout where it lies inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def run(args, command: str) -> int:
    """The comparison of parsed arguments (compare_dispatchers.py's), its outputs written under
    ``args.out`` (default runs/compare/<family>-<cpu|gpu>, git-ignored); the exit status."""
    progress = Progress()
    progress("importing torch and Megatron-Core ...")
    # Progress lines only: Megatron-Core warns about every optional library it does not find and
    # logs every argument; torch and matplotlib log their own setup.
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("megatron", "torch.utils.cpp_extension", "matplotlib"):
        logging.getLogger(name).setLevel(logging.ERROR)
    device, status = argument_errors("compare_dispatchers.py", resolve, args)
    if status:
        return status
    out = Path(args.out) if args.out else DEFAULT_OUT / f"{args.family}-{'gpu' if device.type == 'cuda' else 'cpu'}"
    progress(f"outputs go to {_shown(out)}/")
    if getattr(args, "select_only", False):
        result = select_only(args, device, progress)
        result["command"] = command.strip()
        out.mkdir(parents=True, exist_ok=True)
        (out / "variants.json").write_text(json.dumps(result, indent=1) + "\n")
        progress(f"wrote {_shown(out)}/variants.json")
        print("\n".join(variants_markdown(result["stock_selection"])))
        return 0

    def save_partial(partial: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_text(json.dumps({**partial, "partial": True, "command": command.strip()},
                                                     indent=1) + "\n")

    if device.type == "cpu":
        from moeblaze_megatron.training.cpu_shims import enable_cpu_megatron

        with enable_cpu_megatron():
            result = compare(args, device, progress, save_partial=save_partial)
    else:
        result = compare(args, device, progress, save_partial=save_partial)
    result["command"] = command.strip()
    return finish(out, result, progress)
