"""Registers MoEBlaze with Megatron-Core: ``--moe-token-dispatcher-type moeblaze``.

``install()`` makes every ``MoELayer`` whose config says ``moe_token_dispatcher_type='moeblaze'``
use ``MoEBlazeTokenDispatcher`` and ``MoEBlazeGroupedMLP``, whatever spec builder made the layer
(``get_gpt_layer_local_spec``, ``get_gpt_decoder_block_spec``, the Transformer Engine spec);
layers of any other dispatcher type are built by Megatron untouched.

Plugin options live in a ``config.MoEBlazeConfig`` attached to the ``TransformerConfig`` as its
``moeblaze`` attribute (``config.set_moeblaze_config``); a config without one uses the defaults.
From the command line, ``moeblaze_extra_args_provider()`` adds the ``--moeblaze-*`` flags and
``transformer_config_from_args(args)`` builds the TransformerConfig with the options attached.

Options MoEBlaze does not support are refused when the layer is built (and, through the
argument parser, before training starts, as a plain argument error) with a message naming the
option and what to do instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import sys

from .config import (
    OPTION_CHOICES,
    MoEBlazeConfig,
    OptionError,
    activation_problem,
    expert_bias_problem,
    expert_tp_problem,
    fp8_recipe_problem,
    get_moeblaze_config,
    megatron_fp8_format,
    set_moeblaze_config,
)
from .dispatcher import MoEBlazeTokenDispatcher
from .experts import MoEBlazeGroupedMLP, activation_of_config

__all__ = [
    "MOEBLAZE",
    "add_moeblaze_args",
    "check_moeblaze_args",
    "check_moeblaze_config",
    "install",
    "is_installed",
    "moeblaze_config_from_args",
    "moeblaze_extra_args_provider",
    "transformer_config_from_args",
    "uninstall",
]

MOEBLAZE = "moeblaze"


# ----------------------------------------------------------------------------------------------
# Command line


def add_moeblaze_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Accept ``--moe-token-dispatcher-type moeblaze``, add the ``--moeblaze-*`` flags, and check
    the parsed arguments for options MoEBlaze refuses. Safe to call twice on one parser."""
    if getattr(parser, "_moeblaze_args_added", False):
        return parser
    for action in parser._actions:
        if action.dest == "moe_token_dispatcher_type" and action.choices is not None:
            if MOEBLAZE not in action.choices:
                action.choices = (*action.choices, MOEBLAZE)
    group = parser.add_argument_group(title="moeblaze")
    for option, help_text in _FLAG_HELP.items():
        # No argparse choices: MoEBlazeConfig checks every option once (moeblaze_config_from_args),
        # and a bad value gets one line, not Megatron's whole usage text.
        group.add_argument(_flag(option), default=getattr(MoEBlazeConfig, option), help=help_text,
                           metavar="{" + ",".join(OPTION_CHOICES[option]) + "}")
    parse_known_args = parser.parse_known_args

    def parse_and_check(args=None, namespace=None):
        parsed, extras = parse_known_args(args, namespace)
        try:
            moeblaze_config_from_args(parsed)
            if getattr(parsed, "moe_token_dispatcher_type", None) == MOEBLAZE:
                check_moeblaze_args(parsed)
        except ValueError as error:
            # An argument error, as argparse gives one: the message, exit code 2, no traceback
            # (and not Megatron's whole usage text either).
            parser.exit(2, f"{parser.prog}: error: {flag_message(error)}\n")
        return parsed, extras

    parser.parse_known_args = parse_and_check
    parser._moeblaze_args_added = True
    return parser


def moeblaze_extra_args_provider(extra_args_provider=None):
    """An ``extra_args_provider`` for Megatron's ``pretrain``/``parse_args`` that adds the
    MoEBlaze arguments, then applies ``extra_args_provider`` (the user's own) if given."""

    def provider(parser):
        parser = add_moeblaze_args(parser)
        return extra_args_provider(parser) if extra_args_provider is not None else parser

    return provider


def moeblaze_config_from_args(args) -> MoEBlazeConfig:
    """The MoEBlazeConfig given by parsed ``--moeblaze-*`` arguments (defaults where absent); an
    ``OptionError`` (checked by MoEBlazeConfig) for a value it does not take."""
    values = {option: getattr(args, f"moeblaze_{option}") for option in OPTION_CHOICES
              if hasattr(args, f"moeblaze_{option}")}
    fp8 = megatron_fp8_format(getattr(args, "fp8", None), getattr(args, "fp8_recipe", None))
    return MoEBlazeConfig(**values, fp8=fp8)


def flag_message(error: Exception) -> str:
    """An error about the options as the command line says it: an option named by its flag."""
    if isinstance(error, OptionError) and error.choices is not None:
        choices = ", ".join(repr(c) for c in error.choices)
        return f"argument {_flag(error.option)}: invalid choice: {error.value!r} (choose from {choices})"
    return str(error)


def _flag(option: str) -> str:
    return "--moeblaze-" + option.replace("_", "-")


# The --moeblaze-* flags, one per MoEBlazeConfig field (their choices: config.OPTION_CHOICES).
_FLAG_HELP = {
    "recompute": "What the MoEBlaze experts keep for backward: 'activation' keeps the expert pre-activations; "
                 "'fc1' keeps only the layer input and recomputes the first expert GEMM.",
    "routing_method": "How the MoEBlaze routing plan is built: 'three_step' (atomic-free Triton build), 'sort', "
                      "'torch', or 'auto' (picked by device and expert count).",
    "backend": "MoEBlaze expert MLP implementation: 'triton' (fused kernels), 'reference' (PyTorch), or 'auto' "
               "(Triton on CUDA).",
    "ep_mode": "With expert parallelism: 'alltoall' sends each token once per rank holding one of its experts; "
               "'ring' runs RelayMoE's ring (expert weights or tokens circulate point to point; no dispatch "
               "buffer, only the layer input kept for backward; needs --moeblaze-recompute fc1); 'auto' picks "
               "per layer the one that sends fewer bytes per training step (also needs --moeblaze-recompute fc1).",
    "ring_mode": "Which ring runs in ring (and auto) mode: 'expert' (the weight shards travel), 'token' (the token "
                 "blocks travel), or 'auto' (per layer, the one that sends fewer bytes).",
}


def transformer_config_from_args(args, config_class=None):
    """Megatron's ``core_transformer_config_from_args`` with the MoEBlaze options attached (what
    that function itself does once ``install()`` has run)."""
    from megatron.training import arguments

    builder = _original_config_from_args or arguments.core_transformer_config_from_args
    return _with_options_of(args, builder(args, config_class))


def _with_options_of(args, config):
    """``config`` with the MoEBlazeConfig of the parsed ``--moeblaze-*`` flags attached."""
    return set_moeblaze_config(config, moeblaze_config_from_args(args))


# ----------------------------------------------------------------------------------------------
# What MoEBlaze refuses


def _activation_of_args(args) -> tuple[bool, str]:
    if getattr(args, "swiglu", False):
        return True, "silu"
    if getattr(args, "quick_geglu", False):
        return True, "quick_gelu"
    for flag in ("squared_relu", "openai_gelu"):
        if getattr(args, flag, False):
            return False, flag
    return False, "gelu"


def _problems(get, gated: bool, activation: str) -> list[str]:
    """Every unsupported option, each with what to do instead. ``get(name)`` reads a
    TransformerConfig field (or its command-line equivalent)."""
    problems = []

    def refuse(condition, message):
        if condition:
            problems.append(message)

    def add(problem: str | None):
        if problem is not None:
            problems.append(problem)

    if get("fp8"):
        add(fp8_recipe_problem(get("fp8_recipe")))
        refuse(
            get("fp8_param") or get("fp8_param_gather"),
            "fp8_param (--fp8-param-gather): MoEBlaze's experts keep their parameters in the model's dtype and "
            "quantize them once per optimizer step; drop --fp8-param-gather",
        )
    refuse(get("fp4"), "fp4 (--fp4-format): MoEBlaze experts run the FP8 blockwise recipe (--fp8-format e4m3 "
                       "--fp8-recipe blockwise) or the model's dtype; drop fp4")
    refuse(get("use_kitchen"), "use_kitchen (quantized linear layers): not supported by MoEBlaze experts")
    etp = get("expert_tensor_parallel_size") or get("tensor_model_parallel_size") or 1
    add(expert_tp_problem(etp))
    refuse(
        get("moe_pad_expert_input_to_capacity"),
        "moe_pad_expert_input_to_capacity: MoEBlaze never pads expert inputs; drop "
        "--moe-pad-expert-input-to-capacity (token dropping with --moe-expert-capacity-factor works)",
    )
    refuse(
        get("overlap_moe_expert_parallel_comm"),
        "overlap_moe_expert_parallel_comm: the EP communication overlap schedule is not supported; "
        "drop --overlap-moe-expert-parallel-comm",
    )
    refuse(
        get("overlap_dispatch_backward_with_experts_wgrad") or get("delay_wgrad_compute"),
        "delayed expert weight gradients (overlap_dispatch_backward_with_experts_wgrad, "
        "delay_wgrad_compute): MoEBlaze computes weight gradients in backward; drop these options",
    )
    refuse(
        get("moe_expert_rank_capacity_factor") is not None or get("moe_paged_stash"),
        "moe_expert_rank_capacity_factor / moe_paged_stash: options of the flex dispatcher; use "
        "--moe-expert-capacity-factor for token dropping",
    )
    refuse(
        get("moe_latent_size"),
        "moe_latent_size (latent MoE projections): not supported; drop --moe-latent-size",
    )
    refuse(
        get("moe_apply_probs_on_input"),
        "moe_apply_probs_on_input: MoEBlaze applies router probabilities to the expert outputs; "
        "drop --moe-apply-probs-on-input",
    )
    refuse(
        get("moe_permute_fusion"),
        "moe_permute_fusion: MoEBlaze never permutes tokens; drop --moe-permute-fusion",
    )
    refuse(
        get("moe_mlp_glu_interleave_size"),
        "moe_mlp_glu_interleave_size: MoEBlaze expects Megatron's [gate | up] fc1 layout; drop it",
    )
    add(expert_bias_problem(bool(get("add_bias_linear"))))
    add(activation_problem(gated, activation))
    refuse(
        get("activation_func_clamp_value") is not None,
        "activation_func_clamp_value: not supported by MoEBlaze experts; drop it",
    )
    refuse(bool(get("glu_linear_offset")), "glu_linear_offset != 0: not supported by MoEBlaze experts")
    refuse(
        get("transformer_impl") == "inference_optimized",
        "transformer_impl='inference_optimized': use 'local' or 'transformer_engine'",
    )
    problems += cuda_graph_problems(get)
    offloaded = set(get("offload_modules") or ()) if get("fine_grained_activation_offloading") else set()
    refuse(
        bool(offloaded & {"expert_fc1", "moe_act", "fused_group_mlp"}),
        f"fine-grained offloading of {sorted(offloaded & {'expert_fc1', 'moe_act', 'fused_group_mlp'})}: "
        "MoEBlaze experts keep no such buffers; drop them from --offload-modules",
    )
    return problems


def cuda_graph_problems(get) -> list[str]:
    """What MoEBlaze refuses of a CUDA graph setting (``get`` as in ``_problems``).

    At expert-parallel size 1 the MoEBlaze layer has no data-dependent shape and no host
    synchronization, so every scope is captured, the whole MoE layer included; Megatron's own
    check that a captured MoE layer drops and pads is lifted for it (``install``). At EP > 1 the
    exchange's sizes depend on the routing and the ring gathers its ranks' row counts to the host.
    """
    impl = get("cuda_graph_impl") or "none"
    if impl == "none":
        return []
    names = set(cuda_graph_module_names(get("cuda_graph_modules")))
    captures_layer = impl == "full_iteration" or not names or "moe" in names
    ep = get("expert_model_parallel_size") or 1
    problems = []
    if ep > 1 and (captures_layer or "moe_preprocess" in names):
        scope = "full_iteration" if impl == "full_iteration" else (sorted(names) or "whole layer")
        problems.append(
            f"CUDA graphs over the MoE dispatch at expert-parallel size {ep} (cuda_graph_impl={impl!r}, "
            f"cuda_graph_modules={scope}): the token exchange's sizes depend on the routing and the ring "
            "gathers each rank's row count to the host; capture only attn and moe_router, or use "
            "--expert-model-parallel-size 1"
        )
    if "moe" in names and "moe_router" in names:
        problems.append("cuda_graph_modules with both moe and moe_router: moe captures the router already; "
                        "name one of them")
    recomputed = set(get("recompute_modules") or ()) if get("recompute_granularity") == "selective" else set()
    if captures_layer and "moe" in recomputed:
        problems.append(
            "MoE-layer recompute (--recompute-modules moe) inside a CUDA graph of the MoE layer: use "
            "--moeblaze-recompute fc1 (the experts then keep only their input) or capture attn and moe_router only"
        )
    return problems


def cuda_graph_module_names(modules) -> list[str]:
    """``cuda_graph_modules`` (a string, a comma list, CudaGraphModule members, a list of either;
    "full" and None mean the whole layer) as the modules' names."""
    if modules is None or modules == "full":
        return []
    if isinstance(modules, str):
        modules = [m for m in modules.split(",") if m]
    elif not isinstance(modules, (list, tuple)):
        modules = [modules]
    return [getattr(m, "name", str(m)) for m in modules if getattr(m, "name", m) != "full"]


def _raise_if_problems(problems: list[str]) -> None:
    if problems:
        lines = "\n  - ".join(problems)
        raise ValueError(f"moe_token_dispatcher_type='moeblaze' does not support:\n  - {lines}")


def check_moeblaze_config(config) -> None:
    """Raise ValueError naming every option of ``config`` (a TransformerConfig) MoEBlaze refuses."""
    gated, activation = activation_of_config(config)
    _raise_if_problems(_problems(lambda name: getattr(config, name, None), gated, activation))
    get_moeblaze_config(config)


def check_moeblaze_args(args) -> None:
    """Raise ValueError naming every parsed Megatron argument MoEBlaze refuses."""
    gated, activation = _activation_of_args(args)
    _raise_if_problems(_problems(lambda name: getattr(args, name, None), gated, activation))


# ----------------------------------------------------------------------------------------------
# Installation

_original_moe_layer_init = None
_original_parse_args = None
_original_config_from_args = None
_original_config_post_init = None
# The functions install() put in Megatron's place, each with the one it replaced.
_replacements: dict = {}


def is_installed() -> bool:
    return _original_moe_layer_init is not None


def install() -> None:
    """Make ``moe_token_dispatcher_type='moeblaze'`` build MoEBlaze MoE layers; every parse of
    Megatron's command line accept ``--moe-token-dispatcher-type moeblaze`` and the
    ``--moeblaze-*`` flags; and Megatron-LM's ``core_transformer_config_from_args`` attach the
    flags' MoEBlazeConfig to the config it builds (also where a module imported it by name before
    this call, as Megatron-LM's ``gpt_builders.py`` does). Idempotent."""
    global _original_moe_layer_init, _original_parse_args, _original_config_from_args
    global _original_config_post_init
    if _original_moe_layer_init is not None:
        return
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        from megatron.training import arguments
    except ImportError:  # megatron.core alone: there is no command line to extend
        arguments = None
    if arguments is not None:
        # pretrain() parses sys.argv again without the entry point's extra_args_provider (fault
        # tolerance and in-process restart setup), so the flags must be known to every parse.
        _original_parse_args = arguments.parse_args

        @functools.wraps(_original_parse_args)
        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            return _original_parse_args(moeblaze_extra_args_provider(extra_args_provider), ignore_unknown_args)

        _original_config_from_args = arguments.core_transformer_config_from_args

        @functools.wraps(_original_config_from_args)
        def core_transformer_config_from_args(args, config_class=None):
            return _with_options_of(args, _original_config_from_args(args, config_class))

        _rebind(_original_parse_args, parse_args)
        _rebind(_original_config_from_args, core_transformer_config_from_args)

    _original_config_post_init = TransformerConfig.__post_init__
    TransformerConfig.__post_init__ = _moeblaze_post_init(_original_config_post_init)

    original = MoELayer.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["config"].moe_token_dispatcher_type != MOEBLAZE:
            return original(*bound.args, **bound.kwargs)
        return _init_moeblaze_layer(original, bound)

    MoELayer.__init__ = __init__
    _original_moe_layer_init = original


def uninstall() -> None:
    """Undo ``install()``: Megatron's MoELayer, TransformerConfig and argument handling go back to
    their own code."""
    global _original_moe_layer_init, _original_parse_args, _original_config_from_args
    global _original_config_post_init
    if _original_moe_layer_init is None:
        return
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    MoELayer.__init__ = _original_moe_layer_init
    _original_moe_layer_init = None
    TransformerConfig.__post_init__ = _original_config_post_init
    _original_config_post_init = None
    for replacement in list(_replacements):
        _rebind_back(replacement)
    _original_parse_args = _original_config_from_args = None


def _rebind(original, replacement) -> None:
    """Every loaded module's binding of ``original`` (its home module's, and a name imported
    from it) now names ``replacement``; ``uninstall`` swaps them back."""
    _replacements[replacement] = original
    for namespace in _other_namespaces():
        for attr, value in list(namespace.items()):
            if value is original:
                namespace[attr] = replacement


def _rebind_back(replacement) -> None:
    original = _replacements.pop(replacement)
    for namespace in _other_namespaces():
        for attr, value in list(namespace.items()):
            if value is replacement:
                namespace[attr] = original


def _other_namespaces():
    """The loaded modules' namespaces but this module's (which keeps the originals)."""
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if name != __name__ and isinstance(namespace, dict):
            yield namespace


class _ModulesWithoutMoE(list):
    """``cuda_graph_modules`` as Megatron's own checks see it for a MoEBlaze layer: ``moe`` reads
    as absent (Megatron allows it for drop-and-pad layers only; ``cuda_graph_problems`` has the
    MoEBlaze rule)."""

    def __contains__(self, item):
        return getattr(item, "name", item) != "moe" and list.__contains__(self, item)


def _moeblaze_post_init(original):
    """TransformerConfig.__post_init__ that lets a MoEBlaze config through the two checks
    written for other dispatchers: the captured MoE layer must drop and pad, and the shared-expert
    overlap needs alltoall or flex. Every other check runs as Megatron wrote it."""
    from megatron.core.transformer import transformer_config

    @functools.wraps(original)
    def __post_init__(self):
        if getattr(self, "moe_token_dispatcher_type", None) != MOEBLAZE:
            return original(self)
        normalize = transformer_config.normalize_cuda_graph_modules

        def normalize_without_moe(scopes):
            modules, *rest = normalize(scopes)
            return (_ModulesWithoutMoE(modules), *rest)

        overlap = self.moe_shared_expert_overlap
        self.moe_shared_expert_overlap = False
        transformer_config.normalize_cuda_graph_modules = normalize_without_moe
        try:
            original(self)
        finally:
            transformer_config.normalize_cuda_graph_modules = normalize
            self.moe_shared_expert_overlap = overlap
            if isinstance(self.cuda_graph_modules, _ModulesWithoutMoE):
                self.cuda_graph_modules = list(self.cuda_graph_modules)

    return __post_init__


def _init_moeblaze_layer(original_init, bound: inspect.BoundArguments) -> None:
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    layer = bound.arguments["self"]
    config = bound.arguments["config"]
    check_moeblaze_config(config)
    submodules = bound.arguments["submodules"]
    if submodules is None:
        raise ValueError("MoELayer needs submodules (an MoESubmodules from a layer spec)")
    bound.arguments["submodules"] = dataclasses.replace(
        submodules, experts=_moeblaze_experts_builder(submodules.experts)
    )
    if bound.arguments["pg_collection"] is None:
        bound.arguments["pg_collection"] = get_default_pg_collection()
    pg_collection = bound.arguments["pg_collection"]
    # MoELayer picks its dispatcher with a closed if/elif: let it build the stock allgather one
    # (construction only stores attributes, no communication) and replace it afterwards.
    config.moe_token_dispatcher_type = "allgather"
    try:
        original_init(*bound.args, **bound.kwargs)
    finally:
        config.moe_token_dispatcher_type = MOEBLAZE
    layer.token_dispatcher = MoEBlazeTokenDispatcher(
        layer.num_local_experts, layer.local_expert_indices, config=config, pg_collection=pg_collection
    )
    if layer.shared_expert_overlap and layer.shared_experts is not None:
        layer.token_dispatcher.set_shared_experts(layer.shared_experts)


def _moeblaze_experts_builder(builder):
    """MoEBlazeGroupedMLP in place of Megatron's stock experts (SequentialMLP, TEGroupedMLP),
    writing the replaced experts' plain checkpoint layout."""
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    target = builder
    while isinstance(target, functools.partial):
        target = target.func
    target = getattr(target, "module", target)  # a ModuleSpec
    if isinstance(target, type) and issubclass(target, MoEBlazeGroupedMLP):
        return builder
    if isinstance(target, type) and issubclass(target, TEGroupedMLP):
        return functools.partial(MoEBlazeGroupedMLP, checkpoint_layout="te_grouped")
    if isinstance(target, type) and issubclass(target, SequentialMLP):
        return MoEBlazeGroupedMLP
    raise ValueError(
        f"moe_token_dispatcher_type='moeblaze' runs its own experts (MoEBlazeGroupedMLP), but the "
        f"layer spec names {target!r}; use a stock spec (SequentialMLP / TEGroupedMLP experts) or "
        "MoEBlazeGroupedMLP"
    )
