"""The plugin's options and the one declaration of every choice they take.

Imports nothing of the package: the op, the adapters and the command line read their choices
from here, so a new choice is declared once.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "EP_MODES",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "MoEBlazeConfig",
    "OptionError",
    "RECOMPUTE_MODES",
    "RING_CHOICES",
    "RING_MODES",
    "ROUTING_METHODS",
    "activation_name",
    "activation_problem",
    "check_option",
    "option_problem",
    "expert_bias_problem",
    "expert_tp_problem",
    "fp8_problem",
    "fp8_recipe_problem",
    "megatron_fp8_format",
    "get_moeblaze_config",
    "ring_recompute_problem",
    "saves_pre_activations",
    "set_moeblaze_config",
]

# The expert activations the op computes; "swiglu" is silu(gate) * up on [gate | up] fc1 rows.
ACTIVATIONS = ("swiglu", "silu", "gelu")
# What the experts keep for backward: the pre-activations, or only the input (fc1 recomputed).
RECOMPUTE_MODES = ("activation", "fc1")
# How the routing plan is built (routing.build_routing_plan).
ROUTING_METHODS = ("auto", "three_step", "sort", "torch")
# The expert MLP implementation: fused Triton kernels, the pure-PyTorch reference, or by device.
BACKENDS = ("auto", "triton", "reference")
# How the experts run across expert-parallel ranks: tokens sent once per destination rank
# (alltoall), RelayMoE's ring (weights or tokens circulate), or per layer whichever moves fewer bytes.
EP_MODES = ("alltoall", "ring", "auto")
# What travels around the ring: the expert weight shards, or the token blocks.
RING_MODES = ("expert", "token")
# The ring option: one of the rings, or per layer the one that moves fewer bytes.
RING_CHOICES = ("auto", *RING_MODES)
# FP8 experts (blockwise recipe): E4M3 throughout, or E4M3 forward and E5M2 gradients
# (Megatron's --fp8-format); None: the experts compute in the input's dtype.
FP8_FORMATS = ("e4m3", "hybrid")
# Megatron's --fp8-recipe choices the FP8 experts run (the others are refused by name).
FP8_RECIPES = ("blockwise",)

# Every option and the choices it takes: the one declaration the checks below, the op's
# arguments and the command line's help read.
OPTION_CHOICES = {
    "recompute": RECOMPUTE_MODES,
    "routing_method": ROUTING_METHODS,
    "backend": BACKENDS,
    "ep_mode": EP_MODES,
    "ring_mode": RING_CHOICES,
    "fp8": (None, *FP8_FORMATS),
}


class OptionError(ValueError):
    """An option given a value it does not take: ``option`` (a ``MoEBlazeConfig`` field), its
    ``value``, and ``choices`` where the value is not among them (None where the value breaks a
    rule between options), so that a command line can name its own flag instead."""

    def __init__(self, message: str, option: str, value, choices: tuple | None = None):
        super().__init__(message)
        self.option, self.value, self.choices = option, value, choices


def option_problem(option: str, value) -> str | None:
    """Why ``value`` is not one of ``option``'s choices (None: it is)."""
    allowed = OPTION_CHOICES[option]
    return None if value in allowed else f"{option} must be one of {allowed}, got {value!r}"


def check_option(option: str, value) -> None:
    """Raise an ``OptionError`` unless ``value`` is one of ``option``'s choices."""
    problem = option_problem(option, value)
    if problem is not None:
        raise OptionError(problem, option, value, OPTION_CHOICES[option])


def saves_pre_activations(recompute: str) -> bool:
    """Whether the experts keep their pre-activations for backward (else fc1 is recomputed)."""
    return recompute == "activation"


def ring_recompute_problem(ep_mode: str, recompute: str) -> str | None:
    """Why ``ep_mode`` cannot honour ``recompute`` (None: it can). RelayMoE's ring keeps only the
    layer input for backward and recomputes each hop's first GEMM there: it cannot keep the
    pre-activations, so a mode that may run a ring needs recompute='fc1'."""
    if ep_mode in ("ring", "auto") and recompute == "activation":
        return (f"ep_mode={ep_mode!r} needs recompute='fc1' (--moeblaze-recompute fc1): the ring recomputes "
                "each hop's first GEMM in backward and keeps no pre-activations; or use ep_mode='alltoall'")
    return None


def fp8_problem(fp8, ep_mode: str) -> str | None:
    """Why FP8 experts cannot run with ``ep_mode`` (None: they can). The ring's hops run the
    experts in the input's dtype only."""
    if fp8 is not None and ep_mode in ("ring", "auto"):
        return (f"fp8={fp8!r} runs the experts locally and under ep_mode='alltoall'; ep_mode={ep_mode!r} may "
                "run the ring, whose hops compute in bf16: use --moeblaze-ep-mode alltoall")
    return None


_RECIPE_ADVICE = {
    "tensorwise": "use --fp8-recipe blockwise (Megatron-Core's recipe for Hopper)",
    "delayed": "use --fp8-recipe blockwise (Megatron-Core's recipe for Hopper)",
    "mxfp8": "MXFP8 needs Blackwell's block-scaled tensor cores: on Hopper use --fp8-recipe blockwise",
}


def megatron_fp8_format(fp8, recipe) -> str | None:
    """The experts' ``fp8`` option for Megatron's ``--fp8-format`` and ``--fp8-recipe``: the format
    under a recipe they run, else None (``fp8_recipe_problem`` names the refusal)."""
    return fp8 if fp8 and fp8_recipe_problem(recipe) is None else None


def fp8_recipe_problem(recipe: str | None) -> str | None:
    """Why Megatron's ``--fp8-recipe`` is refused for MoEBlaze's FP8 experts (None: it runs)."""
    if recipe in FP8_RECIPES:
        return None
    advice = _RECIPE_ADVICE.get(recipe, "use --fp8-recipe blockwise")
    return f"fp8_recipe={recipe!r}: MoEBlaze's FP8 experts run the blockwise recipe only; {advice}"


@dataclass(frozen=True)
class MoEBlazeConfig:
    """The plugin's own options (Megatron's ``--moeblaze-*`` flags).

    recompute: ``"activation"`` keeps the expert pre-activations for backward; ``"fc1"`` keeps only
        the layer input and recomputes the first expert GEMM in backward (less memory, a third
        more forward FLOPs in backward).
    routing_method: how the routing plan is built (``build_routing_plan``'s methods).
    backend: the expert MLP implementation: ``"auto"`` (fused Triton kernels on CUDA, the PyTorch
        reference elsewhere), ``"triton"`` or ``"reference"``.
    ep_mode: with expert parallelism, ``"alltoall"`` (each token sent once per destination rank),
        ``"ring"`` (RelayMoE's ring: no dispatch buffer, only the layer input kept for backward) or
        ``"auto"`` (per layer, the alltoall exchange or a ring, whichever moves fewer bytes in a
        training step, from shapes alone; ``parallel.traffic``). The ring recomputes each hop's
        first GEMM in backward: ``"ring"`` and ``"auto"`` take ``recompute="fc1"`` only.
    ring_mode: which ring runs: ``"expert"`` (the weight shards travel), ``"token"`` (the token
        blocks travel) or ``"auto"`` (per layer, the one that moves fewer bytes).
    fp8: ``None`` (the experts compute in the input's dtype) or an FP8 format of the blockwise
        recipe, ``"e4m3"`` or ``"hybrid"`` (E5M2 gradients). Megatron's experts take it from
        ``--fp8-format`` with ``--fp8-recipe blockwise``; the torchtitan override from its option.
    """

    recompute: str = "activation"
    routing_method: str = "auto"
    backend: str = "auto"
    ep_mode: str = "alltoall"
    ring_mode: str = "auto"
    fp8: str | None = None

    def __post_init__(self):
        # The one place the options are checked: the command line and the torchtitan override
        # build this, and report an OptionError under their own names for the option.
        for option in OPTION_CHOICES:
            check_option(option, getattr(self, option))
        problem = ring_recompute_problem(self.ep_mode, self.recompute)
        if problem is not None:
            raise OptionError(problem, "ep_mode", self.ep_mode)
        problem = fp8_problem(self.fp8, self.ep_mode)
        if problem is not None:
            raise OptionError(problem, "fp8", self.fp8)

    @property
    def saves_pre_activations(self) -> bool:
        """Whether the experts keep their pre-activations for backward."""
        return saves_pre_activations(self.recompute)


def get_moeblaze_config(config) -> MoEBlazeConfig:
    """The MoEBlazeConfig attached to a model config (its ``moeblaze`` attribute), or the defaults."""
    options = getattr(config, "moeblaze", None)
    if options is None:
        return MoEBlazeConfig()
    if not isinstance(options, MoEBlazeConfig):
        raise TypeError(f"config.moeblaze must be a MoEBlazeConfig, got {type(options).__name__}")
    return options


def set_moeblaze_config(config, options: MoEBlazeConfig):
    """Attach ``options`` to a model config (kept by ``copy.deepcopy``); returns ``config``."""
    if not isinstance(options, MoEBlazeConfig):
        raise TypeError(f"options must be a MoEBlazeConfig, got {type(options).__name__}")
    config.moeblaze = options
    return config


# ----------------------------------------------------------------------------------------------
# Rules every adapter applies (each declared here once)

_ACTIVATION_OF = {(True, "silu"): "swiglu", (False, "silu"): "silu", (False, "gelu"): "gelu"}


def activation_problem(gated: bool, func_name: str) -> str | None:
    """Why a gated (GLU) or plain expert MLP with activation function ``func_name`` ('silu',
    'gelu', ...) is refused (None: supported)."""
    if (bool(gated), func_name) in _ACTIVATION_OF:
        return None
    kind = f"gated activation with {func_name}" if gated else f"activation {func_name}"
    return f"{kind}: MoEBlaze supports SwiGLU (--swiglu), SiLU and GeLU experts"


def activation_name(gated: bool, func_name: str) -> str:
    """The op's activation ('swiglu', 'silu' or 'gelu') for a gated or plain expert MLP with
    activation function ``func_name``; a ValueError naming the refused ones."""
    problem = activation_problem(gated, func_name)
    if problem is not None:
        raise ValueError(problem)
    return _ACTIVATION_OF[(bool(gated), func_name)]


def expert_tp_problem(expert_tensor_parallel_size: int) -> str | None:
    """Why an expert tensor-parallel size is refused (None: accepted). MoEBlaze experts hold whole
    expert weights: expert tensor parallelism is 1."""
    if expert_tensor_parallel_size in (None, 1):
        return None
    return (
        f"expert_tensor_parallel_size={expert_tensor_parallel_size}: MoEBlaze experts are not "
        "tensor-parallel; set --expert-tensor-parallel-size 1 (attention tensor parallelism with "
        "--sequence-parallel works, and --expert-model-parallel-size spreads the experts)"
    )


def expert_bias_problem(add_bias: bool) -> str | None:
    """Why expert biases are refused (None: no bias asked for). The fused GEMMs have no bias term."""
    if not add_bias:
        return None
    return "add_bias_linear=True: MoEBlaze experts have no bias; set add_bias_linear=False (--disable-bias-linear)"
