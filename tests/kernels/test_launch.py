"""kernels/launch.py on the CPU: the host helpers, the switch (read in kernels/settings.py), the
signature key and launches under the interpreter (which take Triton's own path; the direct calls
are checked on the GPU in tests/gpu: bitwise against Triton's path, a new signature per shape and
alignment, each call's own grid, launch hooks)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moeblaze_megatron.kernels import launch as launch_mod
from moeblaze_megatron.kernels.settings import read_settings


def test_host_helpers_match_triton():
    for a in range(0, 70):
        for b in (1, 2, 3, 16, 64):
            assert launch_mod.cdiv(a, b) == triton.cdiv(a, b)
    for n in range(1, 5000):
        assert launch_mod.next_pow2(n) == triton.next_power_of_2(n)
    assert launch_mod.next_pow2(0) == 1


def test_spans_past_int32_reads_the_furthest_element_offset():
    def view(shape, strides):
        return torch.empty(1, device="meta").as_strided(shape, strides)

    assert not launch_mod.spans_past_int32(torch.empty(2**31, device="meta"))  # last offset 2**31 - 1
    assert launch_mod.spans_past_int32(torch.empty(2**31 + 1, device="meta"))
    assert launch_mod.spans_past_int32(view((3, 8), (2**30, 1)))  # 2 * 2**30 + 7
    assert not launch_mod.spans_past_int32(view((2, 8), (2**30, 1)), torch.empty(0, 2**40, device="meta"))
    assert launch_mod.spans_past_int32(view((2, 8), (2**30, 1)), view((8, 2), (1, 2**31)))  # any of them


def test_direct_launch_switch():
    assert read_settings({}).direct_launch
    assert not read_settings({"MOEBLAZE_DIRECT_LAUNCH": "0"}).direct_launch
    with pytest.raises(ValueError, match="MOEBLAZE_DIRECT_LAUNCH must be 0 or 1"):
        read_settings({"MOEBLAZE_DIRECT_LAUNCH": "yes"})


@pytest.mark.parametrize("key", [launch_mod._arg_key, lambda arg: launch_mod._signature((arg,))],
                         ids=["one_argument", "signature"])
def test_signature_key_holds_what_triton_specializes_on(key):
    buf = torch.zeros(64, dtype=torch.float32)
    assert key(buf) == key(torch.zeros(8, dtype=torch.float32))  # data and shape are not in it
    assert key(buf) != key(buf.to(torch.float16))  # dtype
    assert key(buf) != key(buf[1:])  # 16-byte alignment
    assert key(16) != key(17) and key(1) != key(True) and key(1) != key(1.0)  # numbers by value and type
    # A parameter and a tensor subclass key as the tensor they hold.
    assert key(torch.nn.Parameter(buf)) == key(buf)
    assert key(buf.as_subclass(_Tagged)) == key(buf)
    desc = TensorDescriptor.from_tensor(torch.zeros(8, 16), [4, 16])
    assert key(desc) == key(TensorDescriptor.from_tensor(torch.ones(8, 16), [4, 16]))
    assert key(desc) != key(TensorDescriptor.from_tensor(torch.zeros(8, 16), [8, 16]))  # the box


class _Tagged(torch.Tensor):
    pass


class _Fake36Launcher:
    """Triton 3.6's CUDA launcher, as far as ``_raw_launch`` reads it: ``__call__(gridX, gridY,
    gridZ, stream, function, *args)`` over ``launch``."""

    global_scratch_size = profile_scratch_size = 0
    num_ctas = 1
    launch_cooperative_grid, launch_pdl = "coop", "pdl"

    def __init__(self, launch):
        self.launch = launch

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        raise AssertionError("a raw launch does not come here")


class _Fake38Launcher(_Fake36Launcher):
    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, enter, exit_, *args):
        raise AssertionError("not this one either")


class _FakeKernel:
    """What an entry reads of a ``triton.jit`` function (the interpreter's has no signature)."""

    __name__ = "fake_kernel"
    arg_names = ["x_ptr", "desc", "n", "BLOCK"]
    signature = inspect.signature(lambda x_ptr, desc, n, BLOCK=1: None)


def _wrap_as_triton_36(launcher, tensordesc_indices, tensordesc_meta):
    """Triton 3.6's descriptor wrapper around the C launch (its closure's names)."""
    def inner(*args):
        return launcher(tensordesc_indices, tensordesc_meta, *args)

    return inner


def test_raw_launch_only_of_triton_36_launchers():
    raw = launch_mod._raw_launch(_Fake36Launcher(len))  # a C function: no descriptor parameters
    assert raw == (len, "coop", "pdl", ())
    meta = [{"block_size": [1, 64]}, {"block_size": [64, 64]}]
    raw = launch_mod._raw_launch(_Fake36Launcher(_wrap_as_triton_36(print, {7, 2}, meta)))
    assert raw.launch is print and [(i, m) for i, m, _ in raw.descriptors] == [(2, meta[0]), (7, meta[1])]
    # Anything else runs through its launcher: another version's, scratch memory, other wrappers.
    assert launch_mod._raw_launch(_Fake38Launcher(len)) is None
    scratch = _Fake36Launcher(len)
    scratch.global_scratch_size = 128
    assert launch_mod._raw_launch(scratch) is None
    assert launch_mod._raw_launch(_Fake36Launcher(lambda *args: None)) is None
    assert launch_mod._raw_launch(_Fake36Launcher(_wrap_as_triton_36(print, {1}, [None]))) is None
    assert launch_mod._raw_launch(object()) is None


def test_direct_call_expands_descriptors_keeping_their_fills(monkeypatch):
    """An entry over a Triton 3.6 launcher: its C launch gets Triton's base arguments, every
    parameter in order with each descriptor expanded, and a descriptor filled once per layout."""
    from triton.backends.nvidia import driver

    fills, launches = [], []

    def fill(desc, meta):
        fills.append(desc.base.data_ptr())
        return [f"map{len(fills)}", *desc.shape, *desc.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", fill, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 99, raising=False)
    meta = [{"block_size": [4, 16]}]

    class Compiled:
        run = _Fake36Launcher(_wrap_as_triton_36(lambda *args: launches.append(args), {1}, meta))
        function, packed_metadata = "fn", "packed"

    entry = launch_mod._Entry(_FakeKernel(), Compiled(), 3, {"BLOCK": 4})
    assert entry.raw is not None and entry.pre_hook is None
    weight, fresh = torch.zeros(8, 16), torch.zeros(8, 16)
    for base in (weight, weight, fresh, weight):
        entry(lambda meta: (5,), (torch.zeros(4), TensorDescriptor.from_tensor(base, [4, 16]), 3), 0)
    assert fills == [weight.data_ptr(), fresh.data_ptr()]  # the weight's map filled once
    grid_and_base = (5, 1, 1, 99, "fn", "coop", "pdl", None, None, "packed", None, None, None)
    for args, want_map in zip(launches, ["map1", "map1", "map2", "map1"]):
        assert args[:13] == grid_and_base
        assert args[14:] == (want_map, 8, 16, 16, 1, 3, 4)  # the map, shape, strides, then n and BLOCK


def test_direct_calls_skip_config_hooks_that_only_size_boxes():
    from moeblaze_megatron.kernels.calls import OneConfig

    from moeblaze_megatron.kernels.configs import set_gather_gemm_boxes, set_tma_box

    assert set_gather_gemm_boxes.only_sizes_boxes and set_tma_box.only_sizes_boxes
    seen = []

    class Compiled:
        run = _Fake36Launcher(len)
        function, packed_metadata = "fn", "packed"

    for hook, kept in ((launch_mod.box_hook(lambda nargs: seen.append(1)), False), (seen.append, True)):
        one = OneConfig(SimpleNamespace(fn=_FakeKernel()), triton.Config({"BLOCK": 4}, pre_hook=hook))
        assert (launch_mod._Entry(one, Compiled(), 3, {}).pre_hook is not None) == kept


@triton.jit
def _fill(out_ptr, n, value, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, value + tl.program_id(0), mask=i < n)


@pytest.mark.parametrize("programs", [1, 3, 5])
def test_launch_runs_tuple_and_callable_grids(programs):
    out = torch.full((5 * 4,), -1, dtype=torch.int32)
    n = programs * 4
    launch_mod.launch(_fill, (programs,), (out, n, 10), {"BLOCK": 4})
    assert out[:n].tolist() == [10 + i // 4 for i in range(n)] and (out[n:] == -1).all()
    out.fill_(-1)
    launch_mod.launch(_fill, lambda meta: (launch_mod.cdiv(n, meta["BLOCK"]),), (out, n, 20), {"BLOCK": 4})
    assert out[:n].tolist() == [20 + i // 4 for i in range(n)] and (out[n:] == -1).all()


def _timed_once(kernel_call, quantiles):
    kernel_call()  # the interpreter has no GPU timer: one run, no timing
    return [1.0, 1.0, 1.0]


def _autotuned_fill(prune, hook=None):
    configs = [triton.Config({"BLOCK": 4}, pre_hook=hook), triton.Config({"BLOCK": 8}, pre_hook=hook)]
    return triton.autotune(configs=configs, key=["n"], prune_configs_by={"early_config_prune": prune},
                           do_bench=_timed_once)(_fill)


def test_a_lone_config_runs_without_the_autotuner():
    # Triton 3.6 times even a lone config; an in-place epilogue would need a copy to be timed.
    hooked = []
    kernel = _autotuned_fill(lambda configs, named, **kw: configs[1:], hook=lambda nargs: hooked.append(nargs["BLOCK"]))
    out = torch.full((24,), -1, dtype=torch.int32)
    launch_mod.launch(kernel, lambda meta: (launch_mod.cdiv(20, meta["BLOCK"]),), (out, 20, 5), {})
    # BLOCK 8 (the kept config): programs of 8 elements, three of them over 20.
    assert out[:20].tolist() == [5 + i // 8 for i in range(20)] and (out[20:] == -1).all()
    assert kernel.cache == {} and hooked == [8] and kernel.best_config.kwargs == {"BLOCK": 8}


def test_a_failed_launch_leaves_the_autotuner_none_of_its_tensors(monkeypatch):
    import gc
    import weakref

    kernel = _autotuned_fill(lambda configs, named, **kw: configs)  # both configs: the autotuner runs

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

    monkeypatch.setattr(kernel.fn, "run", out_of_memory)
    out = torch.full((16,), -1, dtype=torch.int32)
    alive = weakref.ref(out)
    with pytest.raises(torch.OutOfMemoryError, match="raised by the test"):
        launch_mod.launch(kernel, (2,), (out, 16, 0), {})
    assert kernel.nargs is None
    del out
    gc.collect()
    assert alive() is None  # a failed memory probe must not keep its buffers for the next one


def test_tuning_key_is_the_autotuners_own():
    from moeblaze_megatron.kernels.compile_workers import tuning_key

    kernel = _autotuned_fill(lambda configs, named, **kw: configs)  # both configs: the autotuner times them
    out = torch.full((16,), -1, dtype=torch.int32)
    launch_mod.launch(kernel, (2,), (out, 16, 0), {})
    assert list(kernel.cache) == [tuning_key(kernel, {"out_ptr": out, "n": 16, "value": 0}, {})]


def test_compile_workers_knob():
    import os

    cpus = os.cpu_count() or 1
    assert read_settings({}).compile_workers == max(1, min(8, cpus))
    # torchrun's ranks on one machine share its CPUs.
    assert read_settings({"LOCAL_WORLD_SIZE": "4"}).compile_workers == max(1, min(8, cpus // 4))
    assert read_settings({"LOCAL_WORLD_SIZE": str(4 * cpus)}).compile_workers == 1
    assert read_settings({"MOEBLAZE_COMPILE_WORKERS": "0"}).compile_workers == 0
    assert read_settings({"MOEBLAZE_COMPILE_WORKERS": "16"}).compile_workers == 16
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ValueError, match=f"MOEBLAZE_COMPILE_WORKERS must be a whole number .*got '{bad}'"):
            read_settings({"MOEBLAZE_COMPILE_WORKERS": bad})
    # The knob it replaced is refused, not ignored.
    with pytest.raises(ValueError, match="MOEBLAZE_COMPILE_THREADS is gone.*MOEBLAZE_COMPILE_WORKERS"):
        read_settings({"MOEBLAZE_COMPILE_THREADS": "8"})


def test_workers_start_at_the_first_compiled_launch_only(monkeypatch):
    # Under expert parallelism each step's token counts are new signatures, compiled already on
    # disk: a miss after the first must not start workers that idled out.
    started, compiled = [], []
    monkeypatch.setattr(launch_mod.SETTINGS, "interpret", False)
    monkeypatch.setattr(launch_mod.SETTINGS, "direct_launch", True)
    monkeypatch.setattr(launch_mod, "_entries", {})
    monkeypatch.setattr(launch_mod.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch_mod.compile_workers, "start", lambda: started.append(1))
    monkeypatch.setattr(launch_mod.compile_workers, "wait_for", lambda kernel: None)
    monkeypatch.setattr(launch_mod, "_through_triton", lambda kernel, constexprs, grid, args: compiled.append(args))
    monkeypatch.setattr(launch_mod, "_Entry", lambda *a: (lambda grid, args, device: None))
    for n in (16, 24, 16, 40):
        launch_mod.launch(_fill, (1,), (torch.empty(8), n, 0), dict(BLOCK=8))
    assert [args[1] for args in compiled] == [16, 24, 40]  # each new signature through Triton, once
    assert started == [1]
