"""The largest size that fits a memory budget: a doubling-then-bisection search over a monotone
"fits" test, and the one-GPU search of the largest micro-batch or sequence a training step fits
(scripts/compare_dispatchers.py; scripts/bench_expert_parallel.py runs the search collectively).

torch is imported by the functions that need it, not here.
"""

from __future__ import annotations

import time


def search_memory(trainer, dimension: str, budget_bytes: int, time_limit: float, progress,
                  allocated_before: int = 0) -> dict:
    """Largest micro-batch (or sequence length) whose training steps stay within ``budget_bytes``:
    doubling, then bisection; each probe runs two steps on random tokens under an allocator cap
    at the budget, and fits if nothing ran out of memory and the peak stayed within the budget.
    ``allocated_before``: bytes held before this run's model was built, outside the budget."""
    import torch

    device = trainer.device
    granule = 1 if dimension == "micro-batch" else 256
    base_mbs, base_seq = trainer.args.micro_batch_size, trainer.args.seq_length
    start_value = base_mbs if dimension == "micro-batch" else max(granule, base_seq // granule * granule)
    cap = 64 * start_value
    generator = torch.Generator().manual_seed(0)
    total = torch.cuda.get_device_properties(device).total_memory
    probes = []
    deadline = time.perf_counter() + time_limit

    def fits(value: int) -> bool:
        mbs, seq = (value, base_seq) if dimension == "micro-batch" else (base_mbs, value)
        began = time.perf_counter()

        def two_steps():
            for _ in range(2):
                trainer.train_step(trainer.random_batches(mbs, seq, generator))

        record = fits_in_memory(device, two_steps, budget_bytes, allocated_before, trainer.forget_failed_step)
        probes.append({"value": value, "tokens": mbs * seq, **record, "seconds": time.perf_counter() - began})
        progress(probe_line(f"{dimension} {value:6d} ({mbs * seq:7d} tokens)", record))
        return record["fits"]

    torch.cuda.set_per_process_memory_fraction(min(1.0, (budget_bytes + allocated_before) / total), device)
    try:
        found = largest_fitting(fits, start_value, granule, cap, deadline, recheck=True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        gc_free()
    return {"dimension": dimension, "budget_bytes": budget_bytes, **found, "probes": probes}


def fits_in_memory(device, run_steps, budget_bytes: int, allocated_before: int = 0, after_failure=None) -> dict:
    """One memory probe: ``run_steps()`` from a fresh peak counter. Returns its record: ``fits``
    (no out-of-memory error and a peak within ``budget_bytes``), ``peak_bytes``, what the
    allocator held as it started (a probe after a failed one should start where the first did)
    and the out-of-memory message (it says how much was reserved but unallocated); bytes beyond
    ``allocated_before``. After a failure, ``after_failure()`` (the trainer's
    ``forget_failed_step``) drops what the model kept of the failed step (``dropped``), and
    ``held_after_failure`` lists the autograd graphs still alive anywhere (``graph_holders``):
    where either is not empty, the next probe would have started with that step's activations."""
    import torch

    gc_free()
    torch.cuda.reset_peak_memory_stats(device)
    record = {"allocated_at_start_bytes": torch.cuda.memory_allocated(device) - allocated_before,
              "reserved_at_start_bytes": torch.cuda.memory_reserved(device) - allocated_before}
    failure = None
    try:
        run_steps()
    except torch.OutOfMemoryError as error:
        failure = str(error)
    except RuntimeError as error:  # an allocation failing outside the caching allocator
        if "out of memory" not in str(error):
            raise
        failure = str(error)
    peak = torch.cuda.max_memory_allocated(device) - allocated_before
    record.update(fits=failure is None and peak <= budget_bytes, peak_bytes=peak,
                  error=None if failure is None else failure.strip().splitlines()[0][:600])
    if failure is not None:
        record["dropped"] = after_failure() if after_failure is not None else []
        record["held_after_failure"] = graph_holders(device)
    return record


def graph_holders(device, limit: int = 8) -> list[dict]:
    """The autograd graphs that Python objects keep alive on ``device``: each tensor there with a
    ``grad_fn`` that something refers to (``Owner.attribute``, ``function:line`` of a frame, or a
    container's type), with its own bytes (the graph behind it holds more), the largest ``limit``
    first. A tensor that only autograd's C++ side refers to (saved for a backward) is left out:
    its graph is alive only while a listed one is."""
    import gc
    import sys

    import torch

    gc.collect()
    here = sys._getframe()
    objects = gc.get_objects()
    # Plain tensors only: a compiler's fake tensors (torch.compile's caches) hold no memory, and
    # their symbolic sizes raise when read.
    tensors = [o for o in objects if type(o) in (torch.Tensor, torch.nn.Parameter)
               and o.device.type == device.type and o.grad_fn is not None]
    del objects
    tensors.sort(key=lambda t: -t.untyped_storage().nbytes())
    found = []
    for tensor in tensors:
        owners = []
        for referrer in gc.get_referrers(tensor):
            if referrer is tensors or referrer is here:
                continue
            if isinstance(referrer, dict):
                names = [str(k) for k, v in referrer.items() if v is tensor]
                holders = [type(o).__name__ for o in gc.get_referrers(referrer) if getattr(o, "__dict__", None) is referrer]
                owners += [f"{h}.{n}" for h in holders or ["dict"] for n in names]
            elif attributes := [k for k, v in getattr(referrer, "__dict__", {}).items() if v is tensor]:
                # An object whose attributes live inline (Python 3.12) refers to the tensor itself.
                # (No generator here: a closure's cell would be one more referrer.)
                owners += [f"{type(referrer).__name__}.{k}" for k in attributes]
            elif type(referrer).__name__ == "frame":
                owners.append(f"{referrer.f_code.co_name}:{referrer.f_lineno}")
            else:
                owners.append(type(referrer).__name__)
        if owners:
            found.append({"shape": list(tensor.shape), "grad_fn": tensor.grad_fn.name(),
                          "bytes": tensor.untyped_storage().nbytes(), "owners": owners})
        if len(found) == limit:
            break
    del tensors
    return found


def probe_line(label: str, record: dict) -> str:
    """A probe's progress line."""
    return (f"    {label}: {'fits' if record['fits'] else 'does not fit'}, peak {record['peak_bytes'] / 2**30:6.1f} GiB"
            f" (started at {record['allocated_at_start_bytes'] / 2**30:.1f} allocated, "
            f"{record['reserved_at_start_bytes'] / 2**30:.1f} reserved)"
            + (f"; dropped {', '.join(sorted(set(record['dropped'])))}" if record.get("dropped") else "")
            + (f"; graphs still alive, held by {', '.join(sorted({o for h in record['held_after_failure'] for o in h['owners']}))}"
               if record.get("held_after_failure") else ""))


def largest_fitting(fits, start: int, granule: int, cap: int, deadline: float, recheck: bool = False) -> dict:
    """The largest multiple of ``granule`` in [granule, cap] for which ``fits`` holds, assuming
    it is monotone: double from ``start`` (a multiple of ``granule``) until a failure (halve while
    ``start`` itself fails), then bisect. Stops early at ``deadline`` (time.perf_counter()) with
    the best bracket so far. ``recheck``: after a search that saw a failure, probe the largest
    fitting size once more: if it no longer fits, a failed probe changed what later probes see
    (memory it left behind) and the bracket is not to be trusted (``recheck_fits`` False)."""
    if start % granule or start <= 0:
        raise ValueError(f"start must be a positive multiple of granule={granule}, got {start}")
    good, bad, value = None, None, start
    while good is None or bad is None:
        if time.perf_counter() >= deadline:
            break
        if fits(value):
            good = value
            if value * 2 > cap:
                break
            value *= 2
        else:
            bad = value
            if value <= granule:
                break
            value = max(granule, value // 2 // granule * granule)
    while good is not None and bad is not None and bad - good > granule and time.perf_counter() < deadline:
        middle = (good + bad) // 2 // granule * granule
        if fits(middle):
            good = middle
        else:
            bad = middle
    found = {"largest_fitting": good, "smallest_failing": bad, "time_limited": time.perf_counter() >= deadline,
             "capped": bad is None and good is not None, "recheck_fits": None}
    if recheck and good is not None and bad is not None:
        found["recheck_fits"] = bool(fits(good))
    return found


def largest_text(found: dict) -> str:
    """A search's largest fitting size for a table, marked where its recheck failed."""
    text = str(found.get("largest_fitting"))
    return text + (" (recheck failed: memory left by a failed probe)" if found.get("recheck_fits") is False else "")


def gc_free() -> None:
    """Collect garbage and return the CUDA allocator's cached blocks, so that a peak measured
    next starts from what is alive."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        # cuBLAS keeps a workspace per handle and stream in the caching allocator: carved from a
        # large freed block, it pins that block's whole segment.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
