"""The plugin under Megatron's Transformer Engine layer spec on one GPU (scripts/gpu_megatron_check.py
--te): MoEBlaze with ``transformer_impl='transformer_engine'`` against the stock MoE Megatron users
run with TE (alltoall + TEGroupedMLP, the fused permutation and the fused router), same weights.

1. Equivalence, bf16: an MoE layer of the TE spec and a small GPTModel of the TE decoder block spec
   (TE linears, layer norms and attention), stock and MoEBlaze from the same weights, both compared
   with a float32 evaluation of the same model through Megatron's local spec (SequentialMLP, SDPA,
   TF32 off; the TE weights renamed by benchlib.te_layouts): the output or loss and every gradient,
   with megatron_checks.verdict's bar (below 8 * 2**-9 or within twice the stock error).
2. Checkpoints: the layout of both models' torch_dist sharded state dicts (keys, global shapes,
   dtypes), then a checkpoint saved by the TEGroupedMLP model loaded into the MoEBlaze model and
   the other way round: every tensor of the loaded model equal to the saved one's, the loss of the
   loaded model against the saver's.
3. Step time and peak memory of one forward+backward: the TE layer (Qwen3-like and coarse) and
   the TE GPTModel, stock TE against MoEBlaze.

torch and Megatron are imported here: call only where Transformer Engine imports (on a GPU).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from moeblaze_megatron.training.named_grads import sequential_named_grads as named_grads

from .accuracy import rel_err
from .megatron_checks import BF16_TOL, gpt_errors, layer_errors, measure_layer, time_gpt_models, verdict
from .megatron_models import build_gpt, build_layer, gpt_batch, gpt_config, seed, transformer_config
from .te_layouts import compare_sharded_layouts, rename_te_key, sharded_layout, te_to_local_state

# The stock TE form's options (training.families.TE_STOCK_VARIANTS["te"]): its dispatch and
# experts; the fused router is the model's router, so MoEBlaze gets it too (as the command line
# does). bias_activation_fusion (the fused SwiGLU of TEGroupedMLP and of the shared expert) is
# what --swiglu gives both from the command line.
STOCK_TE_FIELDS = dict(moe_grouped_gemm=True, moe_permute_fusion=True)
MODEL_TE_FIELDS = dict(bias_activation_fusion=True)
SHARED_TE_FIELDS = dict(moe_router_fusion=True)


def require_te() -> str:
    """Transformer Engine's version; RuntimeError saying how to get it otherwise."""
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as error:
        raise RuntimeError(f"--te needs Transformer Engine ({error}); on the GPU machine see "
                           "../shared/tools/te-device.sh (TE lands in /tmp/site)") from None
    return transformer_engine.__version__


def te_fields(stock: bool, router_fusion: bool) -> dict:
    """The TransformerConfig fields of the stock TE form (``stock``) or of MoEBlaze beside it."""
    fields = {**(STOCK_TE_FIELDS if stock else {}), **MODEL_TE_FIELDS}
    if router_fusion:
        fields.update(SHARED_TE_FIELDS)
    return fields


def te_gpt_config(dispatcher, device, gpt, stock: bool, router_fusion: bool):
    """megatron_models.gpt_config in bf16 with the TE form's options (stock: all; MoEBlaze: the
    shared router fusion), validated by TransformerConfig as a command line would be."""
    fields = {k: v for k, v in gpt.items() if k not in ("vocab", "seq", "batch")}
    return transformer_config(dispatcher, torch.bfloat16, device, **fields, **te_fields(stock, router_fusion))


def build_te_layer(config, device):
    """The MoE layer of Megatron's TE layer spec with TEGroupedMLP experts (MoEBlazeGroupedMLP
    where the config says moeblaze: the plugin swaps them)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=True)
    return spec.submodules.mlp(config=config).to(device=device, dtype=config.params_dtype)


def build_te_gpt(config, device, vocab, seq):
    """A GPTModel of the TE decoder block spec (TE attention included)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq,
                     position_embedding_type="rope")
    return model.to(device=device, dtype=config.params_dtype)


def te_named_grads(module) -> dict:
    """Gradients under the local spec's names (MoEBlaze's stacked experts split per expert)."""
    return {rename_te_key(k): v for k, v in named_grads(module).items()}


def _load_oracle(oracle, te_model) -> None:
    oracle.load_state_dict(te_to_local_state(te_model.state_dict(), oracle.state_dict().keys()), strict=True)


def check_te_layer(name, shape, tokens, device, router_fusion=True):
    d, h, E, K = shape
    fields = dict(hidden_size=d, moe_ffn_hidden_size=h, num_moe_experts=E, moe_router_topk=K)
    seed(1)
    stock = build_te_layer(transformer_config("alltoall", torch.bfloat16, device, **fields,
                                              **te_fields(True, router_fusion)), device)
    seed(2)
    blaze = build_te_layer(transformer_config("moeblaze", torch.bfloat16, device, **fields,
                                              **te_fields(False, router_fusion)), device)
    oracle = build_layer(transformer_config("alltoall", torch.float32, device, **fields), device)
    # MoEBlaze under the TE spec writes TEGroupedMLP's plain layout: the same keys, strictly.
    assert blaze.state_dict().keys() == stock.state_dict().keys(), "MoEBlaze's TE-spec keys differ from TEGroupedMLP's"
    blaze.load_state_dict(stock.state_dict(), strict=True)
    _load_oracle(oracle, stock)
    errors = layer_errors({"stock": stock, "moeblaze": blaze, "oracle": oracle}, tokens, d, device, te_named_grads)
    return {"check": f"TE layer {name} (T={tokens}, d={d}, h={h}, E={E}, K={K})", "errors": errors, **verdict(errors)}


def check_te_gpt(gpt, device, router_fusion=True):
    models = {}
    for label, dispatcher, seed_value in (("stock", "alltoall", 3), ("moeblaze", "moeblaze", 4)):
        seed(seed_value)
        config = te_gpt_config(dispatcher, device, gpt, label == "stock", router_fusion)
        models[label] = build_te_gpt(config, device, gpt["vocab"], gpt["seq"])
    oracle = build_gpt(gpt_config("alltoall", torch.float32, device, gpt), device, gpt["vocab"], gpt["seq"])
    models["moeblaze"].load_state_dict(models["stock"].state_dict(), strict=True)
    _load_oracle(oracle, models["stock"])
    models["oracle"] = oracle
    errors, losses = gpt_errors(models, gpt, device, te_named_grads)
    return {"check": f"TE GPTModel ({gpt['num_layers']} MoE layers, E={gpt['num_moe_experts']}, "
                     f"K={gpt['moe_router_topk']}, {gpt['batch']}x{gpt['seq']} tokens)",
            "errors": errors, **verdict(errors), "loss": {k: v.item() for k, v in losses.items()}}


def _tensors(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and not k.endswith("_extra_state")}


def check_te_checkpoints(gpt, device, router_fusion=True):
    """torch_dist both ways between TEGroupedMLP and MoEBlaze GPTModels of the TE spec."""
    from megatron.core import dist_checkpointing

    def build(label, seed_value):
        seed(seed_value)
        config = te_gpt_config("alltoall" if label == "stock" else "moeblaze", device, gpt, label == "stock",
                               router_fusion)
        # The user's command keeps --moe-grouped-gemm: the spec names TEGroupedMLP, whose plain
        # layout MoEBlaze's experts then write (the strict comparison below needs the same keys).
        config.moe_grouped_gemm = True
        return build_te_gpt(config, device, gpt["vocab"], gpt["seq"])

    tokens, positions = gpt_batch(gpt, device, seed_value=9)

    @torch.no_grad()
    def loss_of(model):
        return model(tokens, positions, None, labels=tokens).float().mean()

    stock, blaze = build("stock", 11), build("moeblaze", 12)
    layout = compare_sharded_layouts(sharded_layout(stock.sharded_state_dict()), sharded_layout(blaze.sharded_state_dict()))
    result = {"check": f"TE torch_dist checkpoints TEGroupedMLP <-> MoEBlaze (GPTModel, E={gpt['num_moe_experts']})",
              "layout": layout, "directions": {}}
    with tempfile.TemporaryDirectory(prefix="moeblaze_te_ckpt_") as tmp:
        for writer_label, writer, reader_label, reader_seed in (("stock", stock, "moeblaze", 13),
                                                                ("moeblaze", blaze, "stock", 14)):
            reader = build(reader_label, reader_seed)
            before = _tensors(reader)
            want = _tensors(writer)
            differed = sum(not torch.equal(before[k], want[k]) for k in want if k in before)
            path = Path(tmp) / writer_label
            path.mkdir()
            dist_checkpointing.save(writer.sharded_state_dict(), str(path))
            loaded = dist_checkpointing.load(reader.sharded_state_dict(), str(path))
            reader.load_state_dict(loaded, strict=True)
            got = _tensors(reader)
            unequal = sorted(k for k in want if k not in got or not torch.equal(got[k], want[k]))
            loss_error = rel_err(loss_of(reader), loss_of(writer))
            result["directions"][f"{writer_label} -> {reader_label}"] = {
                "tensors": len(want), "differed_before_load": differed, "unequal_after_load": unequal[:20],
                "keys_equal": sorted(got) == sorted(want), "loss_rel_err": loss_error,
                "pass": not unequal and sorted(got) == sorted(want) and differed > 0 and loss_error <= BF16_TOL,
            }
            del reader
    result["pass"] = layout["same"] and all(d["pass"] for d in result["directions"].values())
    result["failed"] = ([] if layout["same"] else ["sharded layout"]) + [
        k for k, d in result["directions"].items() if not d["pass"]]
    return result


def time_te_layer(name, shape, tokens, device, warmup, reps, router_fusion=True):
    d, h, E, K = shape
    fields = dict(hidden_size=d, moe_ffn_hidden_size=h, num_moe_experts=E, moe_router_topk=K)
    rows = []
    generator = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(tokens, 1, d, device=device, generator=generator, dtype=torch.bfloat16)
    for label, dispatcher, stock in (("stock alltoall+TEGroupedMLP (TE spec)", "alltoall", True),
                                     ("moeblaze (TE spec)", "moeblaze", False)):
        seed(6)
        layer = build_te_layer(transformer_config(dispatcher, torch.bfloat16, device, **fields,
                                                  **te_fields(stock, router_fusion)), device)
        ms, peak = measure_layer(layer, x, device, warmup, reps)
        rows.append({"what": f"TE layer {name} T={tokens}", "impl": label, "ms": ms, "peak_MiB": peak,
                     "TFLOP/s": 18 * tokens * K * d * h / (ms * 1e-3) / 1e12})
        del layer
        torch.cuda.empty_cache()
    return rows


def time_te_gpt(gpt, device, warmup, reps, router_fusion=True):
    builders = [(label, lambda dispatcher=dispatcher, stock=stock: build_te_gpt(
        te_gpt_config(dispatcher, device, gpt, stock, router_fusion), device, gpt["vocab"], gpt["seq"]))
        for label, dispatcher, stock in (("stock alltoall+TEGroupedMLP (TE spec)", "alltoall", True),
                                         ("moeblaze (TE spec)", "moeblaze", False))]
    return time_gpt_models(f"TE GPTModel {gpt['batch']}x{gpt['seq']}", builders, gpt, device, warmup, reps)


def _guarded(name, fn, *args, **kwargs):
    """``fn(*args)``; a check that raises is reported as failed with its error, and the others run."""
    try:
        return fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the report names it
        message = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        print(f"{name}: {type(error).__name__}: {message}", flush=True)
        return {"check": name, "pass": False, "failed": ["raised"], "error": f"{type(error).__name__}: {message}"}


def run_te_checks(check_tokens, time_tokens, reps, router_fusion=True, shapes=None, gpt=None):
    """The TE equivalence, checkpoint and timing checks on the GPU, with the run's metadata, as
    one JSON record ({"meta", "checks", "timings"}); a check that raises is a failed record."""
    import datetime
    import time

    import megatron.core

    from .megatron_checks import GPT, LAYER_SHAPES
    from .megatron_models import megatron_world

    te_version = require_te()
    shapes = shapes or LAYER_SHAPES
    gpt = gpt or GPT
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 oracle must be float32
    torch.backends.cudnn.allow_tf32 = False
    started = time.time()
    with megatron_world(torch.device("cuda", 0)):
        checks = [
            _guarded("TE layer", check_te_layer, "qwen3-like", shapes["qwen3-like"], check_tokens, "cuda", router_fusion),
            _guarded("TE GPTModel", check_te_gpt, gpt, "cuda", router_fusion),
            _guarded("TE checkpoints", check_te_checkpoints, gpt, "cuda", router_fusion),
        ]
        timings, timing_errors = [], []
        for rows in [_guarded(f"TE layer timing {name}", time_te_layer, name, shape, time_tokens, "cuda", 3, reps,
                              router_fusion) for name, shape in shapes.items()] + [
                _guarded("TE GPTModel timing", time_te_gpt, gpt, "cuda", 3, max(2, reps // 2), router_fusion)]:
            if isinstance(rows, list):
                timings += rows
            else:
                timing_errors.append(rows)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "megatron_core": getattr(megatron.core, "__version__", "?"),
            "transformer_engine": te_version, "router_fusion": router_fusion, "stock_fields": STOCK_TE_FIELDS,
            "model_fields": MODEL_TE_FIELDS,
            "wall_s": round(time.time() - started, 1)}
    return {"meta": meta, "checks": checks, "timings": timings, "timing_errors": timing_errors}


def format_te_table(report) -> str:
    """The checks (errors per quantity, the checkpoint directions and layout) and the timings."""
    lines = ["| check | quantity | stock TE rel. err | moeblaze rel. err |", "|---|---|---|---|"]
    for check in report["checks"]:
        if "error" in check:
            lines.append(f"| {check['check']} | **verdict** | | FAIL: {check['error']} |")
            continue
        if "errors" in check:
            for quantity in check["errors"]["moeblaze"]:
                lines.append(f"| {check['check']} | {quantity} | {check['errors']['stock'][quantity]:.2e} | "
                             f"{check['errors']['moeblaze'][quantity]:.2e} |")
        else:
            layout = check["layout"]
            lines.append(f"| {check['check']} | sharded layout ({layout['keys']} keys) | | "
                         + ("same keys, shapes, dtypes" if layout["same"] else
                            f"DIFFERS: only stock {layout['only_stock'][:4]}, only ours {layout['only_ours'][:4]}, "
                            f"mismatched {[m['key'] for m in layout['mismatched'][:4]]}") + " |")
            for direction, d in check["directions"].items():
                lines.append(f"| {check['check']} | {direction} | {d['tensors']} tensors, "
                             f"{len(d['unequal_after_load'])} unequal after load | loss rel. err "
                             f"{d['loss_rel_err']:.2e} |")
        verdict_ = "PASS" if check["pass"] else "FAIL " + ", ".join(check.get("failed", []))
        lines.append(f"| {check['check']} | **verdict** | | {verdict_} |")
    lines += ["", "| step (fwd+bwd, bf16) | implementation | median ms | peak MiB | expert TFLOP/s |",
              "|---|---|---|---|---|"]
    for row in report["timings"]:
        peak = "-" if row["peak_MiB"] is None else f"{row['peak_MiB']:.0f}"
        tflops = "-" if row["TFLOP/s"] is None else f"{row['TFLOP/s']:.0f}"
        lines.append(f"| {row['what']} | {row['impl']} | {row['ms']:.2f} | {peak} | {tflops} |")
    for failed in report.get("timing_errors", []):
        lines.append(f"| {failed['check']} | not timed | - | - | {failed['error']} |")
    return "\n".join(lines)
