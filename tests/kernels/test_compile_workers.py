"""kernels/compile_workers.py and the layer's prefetch (warmup.layer_launches, compile_workers.prefetch):
the launches the layer predicts on meta tensors are the ones its passes make (under the
interpreter); worker processes compile them for sm_90a into Triton's disk cache, where this
process's own compile then finds every one (no GPU: a stand-in driver names the target, in a
process without the interpreter); a worker that fails or cannot start leaves the compile to the
process, and nothing waits on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeblaze_megatron import build_routing_plan
from moeblaze_megatron.fused import fused_backward, fused_forward
from moeblaze_megatron.kernels import calls as calls_mod
from moeblaze_megatron.kernels import compile_workers
from moeblaze_megatron.kernels import launch as launch_mod
from moeblaze_megatron.passes import PassOptions
from moeblaze_megatron.warmup import layer_launches

ROOT = Path(__file__).resolve().parents[2]


_ONE_CONFIG = calls_mod.one_config


def _signature(kernel, constexprs, args):
    """What a launch compiles to: the kernel, its constexprs (a lone config's values among them)
    and every argument's launch key (dtype and alignment, int values, descriptor layouts)."""
    kernel, constexprs = _ONE_CONFIG(kernel, args, constexprs)
    base = kernel.autotuner if isinstance(kernel, calls_mod.OneConfig) else kernel
    name = (base.fn if hasattr(base, "configs") else base).__name__
    return name, tuple(sorted(constexprs.items())), tuple(map(launch_mod._arg_key, args))


def _layer(activation, pair, T=40, d=32, h=48, E=4, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    ids[3, -1] = -1  # a dropped slot
    plan = build_routing_plan(ids, E)
    x = torch.randn(T, d, generator=g).to(torch.bfloat16).requires_grad_()
    probs = torch.rand(T, K, generator=g).requires_grad_()
    width = 2 * h if activation == "swiglu" else h
    fc1 = torch.randn(E, width, d, generator=g).to(torch.bfloat16)
    fc1 = tuple(w.contiguous().requires_grad_() for w in fc1.split(h, dim=1)) if pair else fc1.requires_grad_()
    fc2 = torch.randn(E, d, h, generator=g).to(torch.bfloat16).requires_grad_()
    return x, probs, fc1, fc2, plan, ids


def _launches(x, probs, fc1, fc2, ids, activation, recompute, needs):
    """The layer's predicted launches, as the op's warm-up records them (the plan from shapes)."""
    options = PassOptions(activation, recompute == "activation", "triton")
    return layer_launches(x, ids, probs, fc1, fc2, fc2.shape[0], ids.numel(), options, needs)


@pytest.mark.parametrize("activation,pair,recompute,needs", [
    ("swiglu", False, "activation", (True, True, True, True)),
    ("swiglu", True, "fc1", (True, True, True, True)),
    ("swiglu", False, "activation", (False, False, True, True)),  # frozen input, weights only
    ("swiglu", True, "activation", (False, True, False, False)),  # the router's gradient alone
    ("gelu", False, "fc1", (True, False, False, False)),
])
def test_the_predicted_launches_are_the_passes_own(monkeypatch, activation, pair, recompute, needs):
    x, probs, fc1, fc2, plan, ids = _layer(activation, pair)
    made = []

    def spy(kernel, args, constexprs):  # every launch asks it first, before any pre-hook runs
        made.append(_signature(kernel, constexprs, args))
        return _ONE_CONFIG(kernel, args, constexprs)

    monkeypatch.setattr(launch_mod, "one_config", spy)
    with torch.no_grad():  # the passes the op runs for the kernels (its forward, then its backward)
        y, probs_sorted, pre = fused_forward(x, probs, fc1, fc2, plan, activation, save_pre=recompute == "activation")
        fused_backward(torch.randn_like(y), x, probs_sorted, fc1, fc2, plan, activation, pre, needs)
    monkeypatch.setattr(launch_mod, "one_config", _ONE_CONFIG)
    predicted = [_signature(call.kernel, call.constexprs, call.args)
                 for call in _launches(x, probs, fc1, fc2, ids, activation, recompute, needs)]
    assert len(made) >= 4 and predicted == made
    # Nothing but the backward's launches is added by asking for gradients.
    forward_only = _launches(x, probs, fc1, fc2, ids, activation, recompute, (False,) * 4)
    assert [_signature(c.kernel, c.constexprs, c.args) for c in forward_only] == made[:len(forward_only)] < made


@pytest.mark.parametrize("grouped", [False, True])
def test_recording_the_launches_imports_no_sympy(grouped):
    """The layer's launches are recorded before any goes to the compile workers: nothing on that
    path may import sympy (it delayed the paper-d2048-e16-k4 shape's first call, whose weight
    gradients take torch's grouped GEMM: benchmarks/notes/compile-latency.md,
    "gathered_weight_grad returns only the shape on meta stand-ins"). In a fresh interpreter;
    ``grouped`` forces the weight gradients' grouped-GEMM path, which the GPU takes for experts at
    least as wide as the model."""
    probe = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from moeblaze_megatron import fused\n"
        "from test_compile_workers import _launches, _layer\n"
        "x, probs, fc1, fc2, plan, ids = _layer('swiglu', False)\n"
        f"if {grouped}: fused.grouped_weight_grads_apply = lambda x, ffn: True\n"
        "calls = _launches(x, probs, fc1, fc2, ids, 'swiglu', 'activation', (True,) * 4)\n"
        "names = [getattr(getattr(c.kernel, 'fn', c.kernel), '__name__', '?') for c in calls]\n"
        "print('sympy' in sys.modules, names.count('weight_grad_kernel'), len(names))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", probe, str(Path(__file__).parent)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    sympy, weight_grads, total = out.stdout.split()
    assert sympy == "False"
    assert int(weight_grads) == (0 if grouped else 2) and int(total) >= 6  # the grouped GEMM is torch's


@pytest.mark.parametrize("method", ["three_step", "sort"])
def test_the_predicted_plan_launches_are_the_builds_own(monkeypatch, method):
    from moeblaze_megatron.kernels.plan_sort import sort_routing_plan
    from moeblaze_megatron.kernels.plan_three_step import three_step_routing_plan

    build = three_step_routing_plan if method == "three_step" else sort_routing_plan
    ids = torch.rand(37, 6, generator=torch.Generator().manual_seed(1)).topk(3, dim=1).indices
    made = []

    def spy(kernel, args, constexprs):
        made.append(_signature(kernel, constexprs, args))
        return _ONE_CONFIG(kernel, args, constexprs)

    monkeypatch.setattr(launch_mod, "one_config", spy)
    build(ids, 6)
    monkeypatch.setattr(launch_mod, "one_config", _ONE_CONFIG)
    stand_in = calls_mod.stand_in(ids)
    assert stand_in.is_meta and stand_in.shape == ids.shape and stand_in.stride() == ids.stride()
    predicted = compile_workers.recorded_launches(ids.device, lambda: build(stand_in, 6))
    assert made and [_signature(c.kernel, c.constexprs, c.args) for c in predicted] == made


def test_a_stand_in_keeps_the_alignment():
    base = torch.empty(64, dtype=torch.bfloat16)
    for offset in (0, 1, 3, 8):
        view = base[offset:offset + 32].view(4, 8)
        got = calls_mod.stand_in(view)
        assert got.is_meta and got.shape == view.shape and got.stride() == view.stride()
        assert (got.data_ptr() % 16 == 0) == (view.data_ptr() % 16 == 0)


def test_the_prefetch_needs_workers_and_a_gpu():
    # Under the interpreter nothing compiles: no workers, no requests.
    from moeblaze_megatron import warmup

    x, probs, fc1, fc2, plan, ids = _layer("swiglu", False)
    assert not compile_workers.enabled()
    assert compile_workers.submit([{"module": "m", "name": "n", "spec": "{}"}]) == 0
    options = PassOptions("swiglu", True, "triton", "three_step")
    # The plan's method as asked, untouched; nothing recorded or submitted.
    assert warmup.prepare(x, ids, probs, fc1, fc2, 4, ids.numel(), options, (True,) * 4) == "three_step"
    assert not warmup._prefetched


_IN_WORKERS = """
import json, sys
from hopper_compile import layer_launches, offline_target
from benchlib.profiling import compile_times
from moeblaze_megatron.kernels import compile_workers
from moeblaze_megatron.kernels.settings import SETTINGS

SETTINGS.compile_workers = 2
out = {}
with offline_target():
    calls = layer_launches(64, 32, 32, 4, 2)
    # The layer's launches, handed over at once (as the layer's prefetch does), then compiled here.
    names = ["fc1_act", "fc2", "dh_act_bwd", "dw1"]
    out["submitted"] = compile_workers.prefetch([calls[n] for n in names])
    out["again"] = compile_workers.prefetch([calls[n] for n in names])  # each request once
    with compile_times() as here:
        for name in names:
            call = calls[name]
            compile_workers.wait_for(call.kernel)
            kernel = call.kernel
            named = dict(zip(kernel.arg_names, call.args))
            for config in kernel.early_config_prune(kernel.configs, named, **call.constexprs):
                values = {**call.constexprs, **config.all_kwargs()}
                config.pre_hook({**named, **values})
                kernel.fn.warmup(*call.args, grid=call.grid, **values)
    out["here"] = here
    # A launch whose configs are compiled now: compile_ahead has nothing to hand over.
    out["ahead_compiled"] = compile_workers.compile_ahead(calls["fc1_act"])
    # A request no worker can resolve fails in the worker; waiting for it returns.
    bad = {"module": "no_such_module_here", "name": "k", "spec": "{}"}
    compile_workers.submit([bad])
    compile_workers._by_kernel.pop(("no_such_module_here", "k"))[0].exception(timeout=120)
    out["stats"] = compile_workers.stats()
    out["enabled"] = compile_workers.enabled()
print(json.dumps(out))
"""


def _run_offline(code, tmp_path):
    # Imported here: the sympy probe imports this module in a process that has only the package.
    from hopper_compile import run_compiled

    return run_compiled(code, tmp_path)


def test_workers_compile_what_this_process_then_finds_cached(tmp_path):
    got = _run_offline(_IN_WORKERS, tmp_path)
    # Every config of the four launches compiled in the workers; here, each one a disk-cache hit.
    assert got["submitted"] >= 6 and got["again"] == 0, got
    assert got["here"]["kernels"] == 0 and got["here"]["cache_hits"] == got["submitted"], got
    assert got["stats"]["compiled"] == got["submitted"] and got["stats"]["failed"] == 1, got
    assert got["ahead_compiled"] == 0 and got["enabled"], got


_NO_WORKER = """
import json, sys
from hopper_compile import layer_launches, offline_target
from moeblaze_megatron.kernels import compile_workers
from moeblaze_megatron.kernels.settings import SETTINGS

SETTINGS.compile_workers = 2
sys.executable = "/nonexistent/python"  # the workers cannot start
with offline_target():
    call = layer_launches(64, 32, 32, 4, 2)["fc2"]
    submitted = compile_workers.prefetch([call])
    compile_workers.wait_for(call.kernel)  # returns: the queued requests failed with the pool
    out = dict(submitted=submitted, enabled=compile_workers.enabled(), broken=compile_workers._pool().broken,
               after=compile_workers.prefetch([call]))
print(json.dumps(out))
"""


def test_workers_that_cannot_start_leave_the_compiles_to_this_process(tmp_path):
    got = _run_offline(_NO_WORKER, tmp_path)
    assert got["submitted"] >= 1 and not got["enabled"] and "nonexistent" in got["broken"], got
    assert got["after"] == 0, got


def test_a_wait_on_unfinished_compiles_runs_the_idle_tasks_once(monkeypatch):
    import threading
    from concurrent.futures import Future

    from triton.runtime.jit import JITFunction

    def kernel_source(x):
        return x

    kernel = JITFunction(kernel_source)
    key = (kernel_source.__module__, kernel_source.__qualname__)
    monkeypatch.setattr(compile_workers, "enabled", lambda: True)
    monkeypatch.setattr(compile_workers, "_idle_tasks", [])
    ran = []

    def wait_once(done):
        future = Future()
        if done:
            future.set_result(0.0)
        else:
            threading.Timer(0.2, future.set_result, (0.0,)).start()
        monkeypatch.setitem(compile_workers._by_kernel, key, [future])
        compile_workers.wait_for(kernel)
        assert future.done()

    compile_workers.run_while_waiting(lambda: ran.append("first"))
    wait_once(done=True)  # nothing to wait for: the task waits for a real wait
    assert ran == []
    compile_workers.run_while_waiting(lambda: 1 / 0)  # one that raises is dropped
    wait_once(done=False)
    assert ran == ["first"]
    wait_once(done=False)  # once
    assert ran == ["first"]
    monkeypatch.setattr(compile_workers, "enabled", lambda: False)
    compile_workers.run_while_waiting(lambda: ran.append("off"))
    assert compile_workers._idle_tasks == []


def test_torch_first_backward_imports_what_the_layer_imports_while_waiting():
    # warmup.BACKWARD_IMPORT is worth importing early only while torch's backward imports it.
    import inspect

    from moeblaze_megatron import warmup

    assert f"from {warmup.BACKWARD_IMPORT} import" in inspect.getsource(torch.autograd._make_grads)


_KEYS_IN_ORDER = """
import json, sys
from triton.runtime.jit import JITFunction
from moeblaze_megatron.kernels import combine, plan_sort, plan_three_step, gather_gemm, weight_grad

kernels = {}
for module in (combine, plan_sort, plan_three_step, gather_gemm, weight_grad):
    for name, obj in vars(module).items():
        while hasattr(obj, "fn") and not isinstance(obj, JITFunction):  # an autotuner over it
            obj = obj.fn
        if isinstance(obj, JITFunction) and obj.__module__ == module.__name__:
            kernels[f"{module.__name__}.{name}"] = obj
order = sorted(kernels, reverse=sys.argv[1] == "reversed")
print(json.dumps({name: kernels[name].cache_key for name in order}))
"""


def test_kernel_cache_keys_do_not_depend_on_what_compiled_first(tmp_path):
    # A worker's first compile may be any kernel; its cache key must be the one this process files
    # (Triton 3.6 left a helper's globals out where the helper's key came second: numerics).
    forward = _run_offline(_KEYS_IN_ORDER.replace("sys.argv[1]", "'forward'"), tmp_path)
    backward = _run_offline(_KEYS_IN_ORDER.replace("sys.argv[1]", "'reversed'"), tmp_path)
    assert len(forward) >= 8 and forward == backward
