"""MoEBlaze for Megatron-Core: index-map token routing and fused expert MLP kernels.

The framework-neutral op (``moe_mlp``, ``build_routing_plan``, ``RoutingPlan``) imports neither
Megatron nor Triton; ``install`` (the Megatron adapter, ``megatron_plugin.install``) is loaded
when first asked for, so using the op alone does not import Megatron.
"""

from .moe_mlp import moe_mlp
from .routing import RoutingPlan, build_routing_plan

__all__ = ["RoutingPlan", "build_routing_plan", "install", "moe_mlp"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "install":
        from .megatron_plugin import install

        return install
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
