"""Megatron-Core checks of the plugin on one process: MoE layers and a small GPTModel
(benchlib.megatron_models) with the stock dispatcher and with MoEBlaze, compared with a float32
oracle, and their step times (scripts/gpu_megatron_check.py; scripts/bench_expert_parallel.py
reuses the errors and the layer timing at EP > 1)."""

from __future__ import annotations

import datetime
import statistics
import time

import torch

from moeblaze_megatron.training.named_grads import sequential_named_grads as named_grads

from .accuracy import rel_err
from .megatron_models import build_gpt, build_layer, gpt_batch, gpt_config, megatron_world, seed, transformer_config

BF16_TOL = 8 * 2.0**-9
# name: (hidden d, expert ffn h, experts E, top-k K)
LAYER_SHAPES = {"qwen3-like": (2048, 768, 128, 8), "coarse": (1024, 4096, 16, 4)}
SMOKE_LAYER_SHAPES = {"qwen3-like": (64, 32, 16, 4), "coarse": (32, 64, 4, 2)}
GPT = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, moe_ffn_hidden_size=1024,
           num_moe_experts=32, moe_router_topk=4, moe_shared_expert_intermediate_size=1024,
           vocab=32768, seq=2048, batch=4)
SMOKE_GPT = dict(num_layers=2, hidden_size=64, num_attention_heads=4, moe_ffn_hidden_size=32,
                 num_moe_experts=8, moe_router_topk=2, moe_shared_expert_intermediate_size=32,
                 vocab=128, seq=32, batch=2)


def grouped_errors(grads, reference) -> dict:
    """Relative errors of gradient groups (all experts' fc1 stacked, ...), each over its group."""
    groups = {}
    for key, want in reference.items():
        if "local_experts" in key:
            group = "experts " + ("fc1" if "linear_fc1" in key else "fc2")
        elif "router" in key:
            group = "router"
        elif "shared_experts" in key:
            group = "shared experts"
        else:
            group = "other params"
        groups.setdefault(group, ([], []))
        groups[group][0].append(grads[key].flatten())
        groups[group][1].append(want.flatten())
    return {g: rel_err(torch.cat(a), torch.cat(b)) for g, (a, b) in groups.items()}


def verdict(errors: dict) -> dict:
    """MoEBlaze passes a quantity below the bf16 bar or within twice the stock error."""
    ok = {k: errors["moeblaze"][k] <= max(BF16_TOL, 2 * errors["stock"][k]) for k in errors["moeblaze"]}
    return {"pass": all(ok.values()), "failed": sorted(k for k, v in ok.items() if not v)}


# ----------------------------------------------------------------------------------------------
# Equivalence


def check_layer(name, shape, tokens, device):
    d, h, E, K = shape
    layers = {}
    for label, dispatcher, dtype in (("stock", "alltoall", torch.bfloat16), ("moeblaze", "moeblaze", torch.bfloat16),
                                     ("oracle", "alltoall", torch.float32)):
        seed(1)
        layers[label] = build_layer(transformer_config(dispatcher, dtype, device, hidden_size=d, moe_ffn_hidden_size=h,
                                                       num_moe_experts=E, moe_router_topk=K), device)
    layers["moeblaze"].load_state_dict(layers["stock"].state_dict())
    layers["oracle"].load_state_dict(layers["stock"].state_dict())
    errors = layer_errors(layers, tokens, d, device)
    return {"check": f"layer {name} (T={tokens}, d={d}, h={h}, E={E}, K={K})", "errors": errors, **verdict(errors)}


def layer_errors(layers: dict, tokens: int, d: int, device, grads_of=named_grads) -> dict:
    """One forward+backward of each of ``layers`` ({"stock", "moeblaze", "oracle"} MoE layers with
    the same weights) on the same bf16 input and upstream gradient; the relative errors of the
    stock and MoEBlaze output, input gradient and gradient groups against the oracle's.
    ``grads_of(layer)``: its gradients under names the three share."""
    generator = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(tokens, 1, d, device=device, generator=generator).bfloat16()
    upstream = torch.randn(tokens, 1, d, device=device, generator=generator).bfloat16()
    results = {}
    for label, layer in layers.items():
        xx = x.to(layer.config.params_dtype).clone().requires_grad_()
        out, _ = layer(xx)
        (out.float() * upstream.float()).sum().backward()
        results[label] = (out.detach(), xx.grad, grads_of(layer))
        del out, xx
    errors = {}
    for label in ("stock", "moeblaze"):
        out, dx, grads = results[label]
        errors[label] = {"output": rel_err(out, results["oracle"][0]), "input grad": rel_err(dx, results["oracle"][1]),
                         **grouped_errors(grads, results["oracle"][2])}
    return errors


def check_gpt(gpt, device):
    models = {}
    for label, dispatcher, dtype in (("stock", "alltoall", torch.bfloat16), ("moeblaze", "moeblaze", torch.bfloat16),
                                     ("oracle", "alltoall", torch.float32)):
        seed(3)
        models[label] = build_gpt(gpt_config(dispatcher, dtype, device, gpt), device, gpt["vocab"], gpt["seq"])
    models["moeblaze"].load_state_dict(models["stock"].state_dict())
    models["oracle"].load_state_dict(models["stock"].state_dict())
    errors, losses = gpt_errors(models, gpt, device)
    return {"check": f"GPTModel ({gpt['num_layers']} MoE layers, E={gpt['num_moe_experts']}, K={gpt['moe_router_topk']}, "
                     f"{gpt['batch']}x{gpt['seq']} tokens)", "errors": errors, **verdict(errors),
            "loss": {k: v.item() for k, v in losses.items()}}


def gpt_errors(models: dict, gpt, device, grads_of=named_grads):
    """(relative errors of the stock and MoEBlaze loss and gradient groups against the oracle's,
    {label: loss}) of one forward+backward of each of ``models`` on the same batch."""
    tokens, positions = gpt_batch(gpt, device, seed_value=4)
    losses, grads = {}, {}
    for label, model in models.items():
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        losses[label] = loss.detach()
        grads[label] = grads_of(model)
    errors = {label: {"loss": rel_err(losses[label], losses["oracle"]), **grouped_errors(grads[label], grads["oracle"])}
              for label in ("stock", "moeblaze")}
    return errors, losses


# ----------------------------------------------------------------------------------------------
# Step time


def measure_layer(layer, x, device, warmup, reps):
    """measure() of one forward+backward of a Megatron MoE layer on a fresh leaf copy of ``x``."""
    xx = x.clone().requires_grad_()

    def step():
        for p in layer.parameters():
            p.grad = None
        xx.grad = None
        out, _ = layer(xx)
        out.backward(torch.ones_like(out))

    return measure(step, [*layer.parameters(), xx], device, warmup, reps)


def measure(step, params, device, warmup, reps):
    """(median ms, peak MiB above the memory allocated before the step) of ``step()``, which
    starts by dropping the gradients of ``params``."""
    for _ in range(warmup):
        step()
    for p in params:
        p.grad = None
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        for _ in range(reps):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        peak = None
    return statistics.median(times), peak


def time_layer(name, shape, tokens, device, warmup, reps):
    d, h, E, K = shape
    rows = []
    variants = (("stock alltoall+SequentialMLP", "alltoall", None), ("moeblaze", "moeblaze", "activation"),
                ("moeblaze recompute=fc1", "moeblaze", "fc1"))
    generator = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(tokens, 1, d, device=device, generator=generator, dtype=torch.bfloat16)
    for label, dispatcher, recompute in variants:
        seed(6)
        config = transformer_config(dispatcher, torch.bfloat16, device, hidden_size=d, moe_ffn_hidden_size=h,
                                    num_moe_experts=E, moe_router_topk=K)
        if recompute is not None:
            from moeblaze_megatron.config import MoEBlazeConfig, set_moeblaze_config

            set_moeblaze_config(config, MoEBlazeConfig(recompute=recompute))
        layer = build_layer(config, device)
        ms, peak = measure_layer(layer, x, device, warmup, reps)
        rows.append({"what": f"layer {name} T={tokens}", "impl": label, "ms": ms, "peak_MiB": peak,
                     "TFLOP/s": 18 * tokens * K * d * h / (ms * 1e-3) / 1e12})
        del layer
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def time_gpt(gpt, device, warmup, reps):
    builders = [(label, lambda dispatcher=dispatcher: build_gpt(gpt_config(dispatcher, torch.bfloat16, device, gpt),
                                                                device, gpt["vocab"], gpt["seq"]))
                for label, dispatcher in (("stock alltoall+SequentialMLP", "alltoall"), ("moeblaze", "moeblaze"))]
    return time_gpt_models(f"GPTModel {gpt['batch']}x{gpt['seq']}", builders, gpt, device, warmup, reps)


def time_gpt_models(what, builders, gpt, device, warmup, reps):
    """measure() of one training forward+backward of each model ``build()`` gives (seeded alike),
    one at a time on the same batch: rows of the timing table."""
    rows = []
    tokens, positions = gpt_batch(gpt, device, seed_value=7)
    for label, build in builders:
        seed(8)
        model = build()

        def step():
            for p in model.parameters():
                p.grad = None
            model(tokens, positions, None, labels=tokens).float().mean().backward()

        ms, peak = measure(step, list(model.parameters()), device, warmup, reps)
        rows.append({"what": what, "impl": label, "ms": ms, "peak_MiB": peak, "TFLOP/s": None})
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------


def format_table(checks, timings) -> str:
    lines = ["| check | quantity | stock rel. err | moeblaze rel. err |", "|---|---|---|---|"]
    for check in checks:
        for quantity in check["errors"]["moeblaze"]:
            lines.append(f"| {check['check']} | {quantity} | {check['errors']['stock'][quantity]:.2e} | "
                         f"{check['errors']['moeblaze'][quantity]:.2e} |")
        lines.append(f"| {check['check']} | **verdict** | | {'PASS' if check['pass'] else 'FAIL ' + ', '.join(check['failed'])} |")
    lines += ["", "| step (fwd+bwd, bf16) | implementation | median ms | peak MiB | expert TFLOP/s |", "|---|---|---|---|---|"]
    for row in timings:
        peak = "-" if row["peak_MiB"] is None else f"{row['peak_MiB']:.0f}"
        tflops = "-" if row["TFLOP/s"] is None else f"{row['TFLOP/s']:.0f}"
        lines.append(f"| {row['what']} | {row['impl']} | {row['ms']:.2f} | {peak} | {tflops} |")
    return "\n".join(lines)


def run_checks(device, smoke, check_tokens, time_tokens, reps):
    """The equivalence checks and the step times (on ``device``, "cuda" or "cpu"; ``smoke``: the
    tiny shapes and counts that test this code on the CPU), with the run's metadata, as one JSON
    record."""
    shapes = SMOKE_LAYER_SHAPES if smoke else LAYER_SHAPES
    gpt = SMOKE_GPT if smoke else GPT
    check_tokens, time_tokens = (64, 128) if smoke else (check_tokens, time_tokens)
    reps, warmup = (2, 1) if smoke else (reps, 3)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference must be float32
        torch.backends.cudnn.allow_tf32 = False

    started = time.time()
    with megatron_world(torch.device(device, 0) if device == "cuda" else torch.device("cpu")):
        checks = [check_layer("qwen3-like", shapes["qwen3-like"], check_tokens, device), check_gpt(gpt, device)]
        timings = []
        for name, shape in shapes.items():
            timings += time_layer(name, shape, time_tokens, device, warmup, reps)
        timings += time_gpt(gpt, device, warmup, max(2, reps // 2))

    import megatron.core

    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "megatron_core": getattr(megatron.core, "__version__", "?"),
        "smoke": smoke,
        "wall_s": round(time.time() - started, 1),
    }
    return {"meta": meta, "checks": checks, "timings": timings}
