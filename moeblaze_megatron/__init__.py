"""MoEBlaze for Megatron-Core: index-map token routing and fused expert MLP kernels."""

from .megatron_plugin import install
from .moe_mlp import moe_mlp
from .routing import RoutingPlan, build_routing_plan

__all__ = ["RoutingPlan", "build_routing_plan", "install", "moe_mlp"]
__version__ = "0.1.0"
