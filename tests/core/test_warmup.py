"""warmup.py: at a layer's first call of its kind on a GPU, the routing plan build's kernels and
the layer's go to the compile workers at once, and the first plan of a kind is the PyTorch
build's while the Triton build's kernels compile (the same plan); nothing a second time, nothing
without workers, nothing on the CPU. The GPU and the workers are stood in for (no GPU here)."""

from __future__ import annotations

import pytest
import torch

from moe_testing import assert_plans_identical, make_topk_ids, three_step_available
from moeblaze_megatron import build_routing_plan, warmup
from moeblaze_megatron.kernels import compile_workers
from moeblaze_megatron.passes import PassOptions


def _layer(seed, T=300, d=16, h=8, E=12, K=3):
    g = torch.Generator().manual_seed(seed)
    ids = make_topk_ids("random", T, E, K, g)
    x = torch.randn(T, d, generator=g)
    probs = torch.rand(T, K, generator=g)
    fc1, fc2 = torch.randn(E, 2 * h, d, generator=g), torch.randn(E, d, h, generator=g)
    return x, ids, probs, fc1, fc2


@pytest.fixture
def fake_gpu_with_workers(monkeypatch):
    """CPU tensors that say they are on a GPU, workers that are on and running, and a record of
    what would go to them (how many launches per prefetch)."""
    if not three_step_available(torch.device("cpu")):
        pytest.skip("recording the Triton builds needs TRITON_INTERPRET=1 here")
    submitted, running = [], [True]
    # Meta stand-ins stay what they are: they stand for the CPU tensors the interpreter runs.
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: not self.is_meta))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(compile_workers, "enabled", lambda: True)
    monkeypatch.setattr(compile_workers, "running", lambda: running[0])
    monkeypatch.setattr(compile_workers, "prefetch", lambda calls: submitted.append(len(calls)) or len(calls))
    monkeypatch.setattr(compile_workers, "run_while_waiting", lambda task: None)
    monkeypatch.setattr(warmup, "_prefetched", set())
    return submitted, running


@pytest.mark.parametrize("method", ["three_step", "sort"])
def test_the_first_plan_of_a_kind_is_the_pytorch_build_while_its_kernels_compile(fake_gpu_with_workers, monkeypatch,
                                                                                method):
    submitted, _ = fake_gpu_with_workers
    x, ids, probs, fc1, fc2 = _layer(7)
    options = PassOptions("swiglu", True, "reference", method)
    got = [warmup.prepare(x, ids, probs, fc1, fc2, 12, ids.numel(), options, (True,) * 4)]
    assert got == ["torch"] and len(submitted) == 1 and submitted[0] > 0  # the build's kernels went
    got.append(warmup.prepare(x, ids, probs, fc1, fc2, 12, ids.numel(), options, (True,) * 4))
    assert got[-1] == method and len(submitted) == 1  # that kind again: nothing new
    # Another kind (more tokens) past the largest first plan built in PyTorch: the Triton build.
    monkeypatch.setattr(warmup, "TORCH_PLAN_MAX_CELLS", 301 * 12 - 1)
    x2, ids2, probs2, _, _ = _layer(8, T=301)
    assert warmup.prepare(x2, ids2, probs2, fc1, fc2, 12, ids2.numel(), options, (True,) * 4) == method
    assert len(submitted) == 2
    # Whichever method prepare names, the plan is the same.
    monkeypatch.undo()
    want = build_routing_plan(ids, 12, method="torch", validate=False)
    for name in {*got, method}:
        assert_plans_identical(build_routing_plan(ids, 12, method=name, validate=False), want, name)


def test_the_plan_kernels_go_to_the_workers_only_once_they_run(fake_gpu_with_workers):
    submitted, running = fake_gpu_with_workers
    x, ids, probs, fc1, fc2 = _layer(9)
    options = PassOptions("swiglu", True, "reference", "three_step")
    running[0] = False  # a handful of small kernels compile sooner here than behind a cold start
    assert warmup.prepare(x, ids, probs, fc1, fc2, 12, ids.numel(), options, (True,) * 4) == "three_step"
    assert submitted == []


def test_the_layers_kernels_go_to_the_workers_once_per_kind(fake_gpu_with_workers):
    submitted, _ = fake_gpu_with_workers
    x, ids, probs, fc1, fc2 = _layer(10)
    options = PassOptions("swiglu", False, "triton", "torch")
    rows = ids.numel() - 5  # a plan cut to its used slots sizes the layer's buffers
    assert warmup.prepare(x, ids, probs, fc1, fc2, 12, rows, options, (True,) * 4) == "torch"
    assert len(submitted) == 1 and submitted[0] >= 6  # forward and backward GEMMs, the combines
    warmup.prepare(x, ids, probs, fc1, fc2, 12, rows, options, (True,) * 4)
    assert len(submitted) == 1
    # Forward only (no gradient asked for) is another kind: fewer launches.
    warmup.prepare(x, ids, probs, fc1, fc2, 12, rows, options, (False,) * 4)
    assert len(submitted) == 2 and submitted[1] < submitted[0]


def test_nothing_on_the_cpu():
    x, ids, probs, fc1, fc2 = _layer(11)
    options = PassOptions("swiglu", True, "triton", "auto")
    before = set(warmup._prefetched)
    assert warmup.prepare(x, ids, probs, fc1, fc2, 12, ids.numel(), options, (True,) * 4) == "torch"
    assert warmup._prefetched == before
