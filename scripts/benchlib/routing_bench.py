"""The routing plan's build time against the index computations of stock MoE stacks
(scripts/bench_routing.py says what is timed and how).

Nothing here imports moeblaze_megatron when imported: ``run`` does, so that a caller can set
TRITON_INTERPRET (the CPU mode) before the kernels are first imported.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from .wording import faster

FULL_SWEEP = {
    "tokens": [4096, 16384, 65536, 262144, 1048576],
    "experts": [8, 16, 32, 64, 128, 256, 512],
    "topk": [1, 2, 4, 8],
}
QUICK_SWEEP = {"tokens": [4096, 65536, 1048576], "experts": [8, 64, 512], "topk": [1, 8]}
CPU_SWEEP = {"tokens": [100, 600], "experts": [8, 20], "topk": [1, 2]}

PLAN_METHODS = ["three_step", "sort", "auto", "auto_validated"]
BASELINES = ["argsort", "megatron", "masked_select"]
METHODS = PLAN_METHODS + BASELINES


def random_topk_ids(num_tokens, num_experts, topk, device, generator):
    """int64 [T, K]: each row the top-k of uniform scores, i.e. K distinct uniform experts."""
    scores = torch.rand(num_tokens, num_experts, device=device, generator=generator)
    return scores.topk(topk, dim=1).indices


def routing_map_of(topk_ids, num_experts):
    """The bool [T, E] map Megatron's router hands to the dispatcher."""
    routing_map = torch.zeros(topk_ids.shape[0], num_experts, dtype=torch.bool, device=topk_ids.device)
    return routing_map.scatter_(1, topk_ids, True)


def argsort_plan(topk_ids, num_experts):
    """torchtitan's permutation: (token ids grouped by expert, expert offsets, inverse map).

    Tokens per expert come from a scatter-add rather than bincount, which would synchronize with
    the host to size its output (torchtitan uses histc for the same reason).
    """
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return order // topk_ids.shape[1], offsets, inverse


def megatron_index_reimplemented(routing_map, num_out_tokens):
    """Megatron-Core 0.19 ``moe_utils.permute`` (no drop-and-pad, not fused): its index steps."""
    num_tokens = routing_map.shape[0]
    expert_major = routing_map.bool().T.contiguous()
    flat_sorted = expert_major.reshape(-1).argsort(descending=True, stable=True)[:num_out_tokens]
    return flat_sorted % num_tokens


def masked_select_index(routing_map):
    """The routing-map permute of earlier Megatron-Core releases: token ids by masked_select."""
    expert_major = routing_map.T.contiguous()
    num_experts, num_tokens = expert_major.shape
    token_ids = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
    return token_ids.masked_select(expert_major)


def megatron_permute():
    """(callable(routing_map, num_out_tokens) -> token ids, label)."""
    try:
        import megatron.core
        from megatron.core.transformer.moe.moe_utils import permute
    except Exception as error:  # noqa: BLE001  (megatron-core absent or not importable here)
        label = f"reimplementation of megatron.core 0.19 moe_utils.permute ({error.__class__.__name__} on import)"
        return megatron_index_reimplemented, label

    def run(routing_map, num_out_tokens):
        tokens = torch.empty(routing_map.shape[0], 1, dtype=torch.bfloat16, device=routing_map.device)
        return permute(tokens, routing_map, num_out_tokens=num_out_tokens)[2]

    return run, f"megatron.core {megatron.core.__version__} moe_utils.permute on [T, 1] tokens"


def make_runners(topk_ids, num_experts, build_routing_plan, megatron_fn):
    routing_map = routing_map_of(topk_ids, num_experts)
    num_out = topk_ids.numel()
    plan_kwargs = {
        "three_step": {"method": "three_step", "validate": False},
        "sort": {"method": "sort", "validate": False},
        "auto": {"method": "auto", "validate": False},
        "auto_validated": {"method": "auto", "validate": True},
    }
    runners = {
        name: (lambda kw=kw: build_routing_plan(topk_ids, num_experts, **kw)) for name, kw in plan_kwargs.items()
    }
    runners["argsort"] = lambda: argsort_plan(topk_ids, num_experts)
    runners["megatron"] = lambda: megatron_fn(routing_map, num_out)
    runners["masked_select"] = lambda: masked_select_index(routing_map)
    return runners


def check_shape(topk_ids, num_experts, build_routing_plan, megatron_fn):
    """Every method's output equals what the PyTorch plan says; raises AssertionError if not."""
    want = build_routing_plan(topk_ids, num_experts, method="torch")
    fields = ("expert_token_indices", "expert_token_offsets", "token_expert_indices", "token_index_map")
    runners = make_runners(topk_ids, num_experts, build_routing_plan, megatron_fn)
    for name in PLAN_METHODS:
        got = runners[name]()
        for field in fields:
            a, b = getattr(got, field), getattr(want, field)
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: {field} differs from the torch plan"
    token_ids, offsets, inverse = runners["argsort"]()
    assert torch.equal(token_ids, want.expert_token_indices.long()), "argsort: token order differs"
    assert torch.equal(offsets, want.expert_token_offsets.long()), "argsort: offsets differ"
    assert torch.equal(inverse, want.token_index_map.reshape(-1).long()), "argsort: inverse map differs"
    for name in ("megatron", "masked_select"):
        assert torch.equal(runners[name]().long(), want.expert_token_indices.long()), f"{name}: token order differs"


def time_ms(fn, device, heavy):
    """(median, 20th, 80th percentile) in milliseconds."""
    if device == "cuda":
        from triton.testing import do_bench

        # do_bench sizes its repetitions to the given time budget (ms); L2 is flushed each run.
        warmup, rep = (5, 15) if heavy else (10, 30)
        median, low, high = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
        return median, low, high
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return statistics.median(times), times[1], times[-2]


def graph_time_ms(fn, heavy):
    """(median, 20th, 80th percentile) in milliseconds of replays of ``fn`` captured in a CUDA
    graph; raises if ``fn`` cannot be captured."""
    from triton.testing import do_bench

    # Warm up on a side stream before capturing, as torch.cuda.graphs asks.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    stream = torch.cuda.current_stream()
    stream.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    finally:
        # When the capture fails, torch.cuda.graph's exit raises before it restores the stream.
        torch.cuda.set_stream(stream)
    # do_bench records events around each replay; the L2 flush before each one (a 256 MB memset)
    # keeps the host's replay launch ahead of the GPU, so the events time the GPU work.
    warmup, rep = (5, 15) if heavy else (10, 30)
    median, low, high = do_bench(graph.replay, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return median, low, high


def graph_times(runners, heavy, not_captured):
    """{name: graph_time_ms or None}; why a runner could not be captured goes into
    ``not_captured`` (the first reason per runner)."""
    stats = {}
    for name, fn in runners.items():
        try:
            stats[name] = graph_time_ms(fn, heavy)
        except Exception as error:  # noqa: BLE001  (a host synchronization inside fn, typically)
            stats[name] = None
            first_line = (str(error).strip().splitlines() or [""])[0]
            not_captured.setdefault(name, f"{type(error).__name__}: {first_line}"[:300])
    torch.cuda.empty_cache()  # the graphs' private memory pools
    return stats


def ratios(median):
    """(argsort / three_step, auto / min(three_step, sort, argsort)), or None where a time is
    missing."""
    needed = ("three_step", "sort", "argsort", "auto")
    if any(median.get(name) is None for name in needed):
        return None, None
    best = min(median["three_step"], median["sort"], median["argsort"])
    return median["argsort"] / median["three_step"], median["auto"] / best


def shapes(sweep):
    return [(t, e, k) for t in sweep["tokens"] for e in sweep["experts"] for k in sweep["topk"] if k <= e]


def environment(device, megatron_label):
    import triton

    cpu = f"CPU ({platform.processor() or platform.machine()}), Triton interpreted"
    return {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else cpu,
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "megatron": megatron_label,
        "timer": "Triton do_bench, L2 flushed before each run; graph: do_bench of CUDA graph replays"
        if device == "cuda"
        else "wall clock, 5 runs; a smoke test: the Triton build runs in the interpreter; no graph timing",
    }


def summarize(records):
    """Summary lines for each timing, GPU (CUDA graph) first: three_step against torchtitan's
    argsort where E <= 64 (its slowest and fastest shape), and auto against the best of the
    three paths (its worst shape)."""
    lines = []
    for label, prefix in (("GPU (CUDA graph)", "graph_"), ("eager", "")):
        timed = [r for r in records if r[f"{prefix}auto_vs_best"] is not None]
        if not timed:
            lines.append(f"{label}: not measured")
            continue
        speedup, auto_vs_best = f"{prefix}speedup_three_step_vs_argsort", f"{prefix}auto_vs_best"
        small_e = sorted((r for r in timed if r["experts"] <= 64), key=lambda r: r[speedup])
        worst_auto = max(timed, key=lambda r: r[auto_vs_best])
        at = lambda r: f"T={r['tokens']} E={r['experts']} K={r['topk']}"  # noqa: E731
        if small_e:
            lines.append(f"{label}: three_step against argsort where E <= 64: from {faster(small_e[0][speedup])} "
                         f"({at(small_e[0])}) to {faster(small_e[-1][speedup])} ({at(small_e[-1])}), "
                         f"{len(small_e)} shapes")
        lines.append(f"{label}: auto against the best of three_step, sort, argsort: at worst "
                     f"{faster(1 / worst_auto[auto_vs_best])} ({at(worst_auto)}; "
                     f"{sum(r[auto_vs_best] <= 1.05 for r in timed)} of {len(timed)} shapes within 5%)")
    return lines


def _ms(value):
    return "-" if value is None else f"{value:.3f}"


def _ratio(value, unit=""):
    return "-" if value is None else f"{value:.2f}{unit}"


def markdown(env, records, summary):
    head = [
        "# Routing plan build time",
        "",
        (
            f"{env['date']} on {env['gpu']}; torch {env['torch']}, Triton {env['triton']}, "
            f"CUDA {env['cuda']}, Python {env['python']}. Megatron column: {env['megatron']}."
        ),
        f"Command: `{env['command']}`",
        "",
        (
            f"Median ms ({env['timer']}). Plain columns: eager calls (host launch cost included); "
            "graph columns: replays of a CUDA graph of the call (GPU time alone; - where not "
            "measured). speedup = argsort / three_step; auto/best = auto / min(three_step, sort, "
            "argsort); both eager / graph. The routing map the Megatron columns start from is built "
            "outside the timing. GPU time is what the build costs in training, where the host "
            "enqueues ahead of the GPU; eager times at small T are host-launch bound and noisy."
        ),
        "",
        *[f"- {line}" for line in summary],
        "",
        (
            "| T | E | K | three_step | sort | auto (picks) | auto+validate | argsort "
            "| megatron | masked_select | three_step graph | sort graph | argsort graph | speedup "
            "| auto/best |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for r in records:
        ms, graph = r["median_ms"], r["graph_ms"]
        rows.append(
            f"| {r['tokens']} | {r['experts']} | {r['topk']} | {ms['three_step']:.3f} | {ms['sort']:.3f} | "
            f"{ms['auto']:.3f} ({r['auto_picks']}) | {ms['auto_validated']:.3f} | "
            f"{ms['argsort']:.3f} | {ms['megatron']:.3f} | {ms['masked_select']:.3f} | "
            f"{_ms(graph['three_step'])} | {_ms(graph['sort'])} | {_ms(graph['argsort'])} | "
            f"{_ratio(r['speedup_three_step_vs_argsort'], 'x')} / {_ratio(r['graph_speedup_three_step_vs_argsort'], 'x')} | "
            f"{_ratio(r['auto_vs_best'])} / {_ratio(r['graph_auto_vs_best'])} |"
        )
    return "\n".join(head + rows) + "\n"


def run(device, quick, out, seed=0):
    """The sweep (FULL_SWEEP, QUICK_SWEEP with ``quick``, CPU_SWEEP on the CPU), after checking
    every method against the torch plan on a few shapes; writes ``out`` (JSON) and the markdown
    table beside it, printing progress and the table last. On the CPU, TRITON_INTERPRET=1 must be
    set before this is called."""
    from moeblaze_megatron import build_routing_plan
    from moeblaze_megatron.routing import choose_routing_method

    megatron_fn, megatron_label = megatron_permute()
    env = environment(device, megatron_label)
    sweep = CPU_SWEEP if device == "cpu" else (QUICK_SWEEP if quick else FULL_SWEEP)
    todo = shapes(sweep)
    generator = torch.Generator(device=device).manual_seed(seed)
    started = time.perf_counter()

    # Correctness first: the smallest and the largest expert counts at the smallest T, and one
    # mid-size shape (the PyTorch plan's dense map is E x T int32, so keep T moderate).
    check_t = sweep["tokens"][0]
    mid_t = sweep["tokens"][min(2, len(sweep["tokens"]) - 1)]
    checks = [(check_t, sweep["experts"][0], sweep["topk"][-1]), (check_t, sweep["experts"][-1], sweep["topk"][0]),
              (mid_t, sweep["experts"][len(sweep["experts"]) // 2], sweep["topk"][-1])]
    for num_tokens, num_experts, topk in checks:
        topk_ids = random_topk_ids(num_tokens, num_experts, topk, device, generator)
        check_shape(topk_ids, num_experts, build_routing_plan, megatron_fn)
        print(f"checked T={num_tokens} E={num_experts} K={topk}: every method matches the torch plan", flush=True)

    records = []
    not_captured = {}
    for num_tokens, num_experts, topk in todo:
        topk_ids = random_topk_ids(num_tokens, num_experts, topk, device, generator)
        runners = make_runners(topk_ids, num_experts, build_routing_plan, megatron_fn)
        heavy = num_tokens * num_experts >= 2**25
        stats = {name: time_ms(fn, device, heavy) for name, fn in runners.items()}
        if device == "cuda":
            graph_stats = graph_times(runners, heavy, not_captured)
        else:
            graph_stats = dict.fromkeys(runners)  # no CUDA graphs on the CPU
        median = {name: s[0] for name, s in stats.items()}
        graph = {name: s and s[0] for name, s in graph_stats.items()}
        speedup, auto_vs_best = ratios(median)
        graph_speedup, graph_auto_vs_best = ratios(graph)
        record = {
            "tokens": num_tokens,
            "experts": num_experts,
            "topk": topk,
            "auto_picks": choose_routing_method(topk_ids, num_experts),
            "median_ms": median,
            "p20_ms": {name: s[1] for name, s in stats.items()},
            "p80_ms": {name: s[2] for name, s in stats.items()},
            "graph_ms": graph,
            "graph_p20_ms": {name: s and s[1] for name, s in graph_stats.items()},
            "graph_p80_ms": {name: s and s[2] for name, s in graph_stats.items()},
            "speedup_three_step_vs_argsort": speedup,
            "auto_vs_best": auto_vs_best,
            "graph_speedup_three_step_vs_argsort": graph_speedup,
            "graph_auto_vs_best": graph_auto_vs_best,
        }
        records.append(record)
        print(
            f"T={num_tokens:>8} E={num_experts:>4} K={topk}: "
            + " ".join(f"{name}={median[name]:.3f}/{_ms(graph[name])}" for name in METHODS)
            + f" ms eager/graph  [{time.perf_counter() - started:.0f} s]",
            flush=True,
        )
        del topk_ids, runners

    summary = summarize(records)
    table = markdown(env, records, summary)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, reason in not_captured.items():
        print(f"{name}: no CUDA graph ({reason})")
    result = {**env, "sweep": sweep, "summary": summary, "graph_not_captured": not_captured, "records": records}
    out.write_text(json.dumps(result, indent=1) + "\n")
    md_path = out.with_suffix(".md")
    md_path.write_text(table)
    print(f"wrote {out} and {md_path} ({time.perf_counter() - started:.0f} s)\n")
    print(table)
