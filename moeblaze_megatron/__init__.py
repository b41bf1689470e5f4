"""MoEBlaze for Megatron-Core: index-map token routing and fused expert MLP kernels.

The framework-neutral op (``moe_mlp``, ``build_routing_plan``, ``RoutingPlan``) imports neither
Megatron nor Triton; ``install`` (the Megatron adapter, ``megatron_plugin.install``) is loaded
when first asked for (PEP 562), so the core and a torchtitan user never import Megatron.
"""

import importlib

from .moe_mlp import moe_mlp
from .routing import RoutingPlan, build_routing_plan

__all__ = ["RoutingPlan", "build_routing_plan", "install", "moe_mlp"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "install":
        # By name, not an import statement: the package root stays below its adapters.
        return importlib.import_module(f"{__name__}.megatron_plugin").install
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
