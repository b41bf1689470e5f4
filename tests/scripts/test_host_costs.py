"""scripts/benchlib/host_costs.py on the CPU: the launch timeline's function marks (the GPU
parts, the lead sweep and the timeline's events, run on the device in host_overhead.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from benchlib import host_costs
from moeblaze_megatron import moe_mlp
from moeblaze_megatron.fused import TritonMoEMLP


def test_marks_wrap_the_path_to_the_launches_and_come_off_after():
    moe_module = sys.modules["moeblaze_megatron.moe_mlp"]
    before = (moe_module.moe_mlp, moe_module.check_moe_mlp_args, TritonMoEMLP.__dict__["forward"])
    seen = []
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 16, generator=g, requires_grad=True)
    ids = torch.randint(0, 4, (40, 2), generator=g)
    ids[:, 1] = (ids[:, 0] + 1) % 4
    probs = torch.rand(40, 2, generator=g)
    fc1, fc2 = torch.randn(4, 64, 16, generator=g), torch.randn(4, 16, 32, generator=g)
    with host_costs._marked(host_costs.TIMELINE_MARKS, lambda name, edge: seen.append(f"{edge}{name}")):
        # Called through the package's name, as a user does: the wrapper is found there too.
        y = sys.modules["moeblaze_megatron"].moe_mlp(x, ids, probs, fc1, fc2, backend="triton")
    y.sum().backward()
    assert seen[:3] == [">moe_mlp", ">check_moe_mlp_args", "<check_moe_mlp_args"] and seen[-1] == "<moe_mlp"
    for name in ("build_routing_plan", "TritonMoEMLP.forward", "fused_forward", "gather_gemm_call", "combine"):
        assert seen.count(f">{name}") == seen.count(f"<{name}") >= 1, name
    assert "<TritonMoEMLP.forward" in seen[seen.index(">TritonMoEMLP.forward"):]
    # Nothing recorded once the block is left, and every original is back.
    assert (moe_module.moe_mlp, moe_module.check_moe_mlp_args, TritonMoEMLP.__dict__["forward"]) == before
    assert sys.modules["moeblaze_megatron"].moe_mlp is moe_mlp
    count = len(seen)
    moe_mlp(x, ids, probs, fc1, fc2, backend="triton")
    assert len(seen) == count


def test_marks_come_off_when_the_block_raises():
    moe_module = sys.modules["moeblaze_megatron.moe_mlp"]
    original = moe_module.moe_mlp
    with pytest.raises(RuntimeError, match="inside"):
        with host_costs._marked(host_costs.TIMELINE_MARKS, lambda name, edge: None):
            assert moe_module.moe_mlp is not original
            raise RuntimeError("inside")
    assert moe_module.moe_mlp is original
