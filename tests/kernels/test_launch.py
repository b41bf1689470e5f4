"""kernels/launch.py on the CPU: the host helpers, the switch (read in kernels/knobs.py), the
signature key and launches under the interpreter (which take Triton's own path; the direct calls
are checked on the GPU in tests/gpu: bitwise against Triton's path, a new signature per shape and
alignment, each call's own grid, launch hooks)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moeblaze_megatron.kernels import launch as launch_mod
from moeblaze_megatron.kernels.knobs import read_knobs


def test_host_helpers_match_triton():
    for a in range(0, 70):
        for b in (1, 2, 3, 16, 64):
            assert launch_mod.cdiv(a, b) == triton.cdiv(a, b)
    for n in range(1, 5000):
        assert launch_mod.next_pow2(n) == triton.next_power_of_2(n)
    assert launch_mod.next_pow2(0) == 1


def test_direct_launch_switch():
    assert read_knobs({}).direct_launch
    assert not read_knobs({"MOEBLAZE_DIRECT_LAUNCH": "0"}).direct_launch
    with pytest.raises(ValueError, match="MOEBLAZE_DIRECT_LAUNCH must be 0 or 1"):
        read_knobs({"MOEBLAZE_DIRECT_LAUNCH": "yes"})


def test_signature_key_holds_what_triton_specializes_on():
    buf = torch.zeros(64, dtype=torch.float32)
    key = launch_mod._arg_key
    assert key(buf) == key(torch.zeros(8, dtype=torch.float32))  # data and shape are not in it
    assert key(buf) != key(buf.to(torch.float16))  # dtype
    assert key(buf) != key(buf[1:])  # 16-byte alignment
    assert key(16) != key(17) and key(1) != key(True)  # integers by value (and type)


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
