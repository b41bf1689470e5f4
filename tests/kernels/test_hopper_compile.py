"""The layer's expert GEMMs compiled for Hopper (sm_90a) with no GPU (a stand-in driver names the
target): the (gate, up) halves take wgmma and TMA, and the warp-specialized Gluon kernel, which
has no interpreter, compiles within the registers its launch gives a thread."""

from __future__ import annotations

from hopper_compile import histogram, run_compiled

_COMPILE = """
import json
from hopper_compile import compile_variant, kept_configs, layer_launches, offline_target

launches, configs_per_launch = {launches!r}, {configs_per_launch!r}
records = []
with offline_target():
    calls = layer_launches(24576, 1536, 256, 128, 8)  # 7B-like
    for name in launches:
        for config in kept_configs(calls[name])[:configs_per_launch]:
            records.append({{"launch": name, **compile_variant(calls[name], config)}})
print(json.dumps(records))
"""


def _compile(tmp_path, launches, configs_per_launch):
    code = _COMPILE.format(launches=launches, configs_per_launch=configs_per_launch)
    return run_compiled(code, tmp_path, timeout=600)


def test_the_halves_compile_for_hopper(tmp_path):
    launches = ["fc1_act_halves", "dx_halves", "dw1"]
    records = _compile(tmp_path, launches, 1)
    assert [r["launch"] for r in records] == launches
    for r in records:
        # Hopper's matrix instructions and TMA loads, a register count from ptxas, a fresh compile.
        assert r["wgmma"] and r["tma"] and 0 < r["registers"] <= 255 and r["compile_seconds"] > 0, r
        assert any(op.startswith("wgmma.mma_async") for op in r["histogram"]), r["histogram"]


def test_the_warp_specialized_epilogues_compile_for_hopper(tmp_path):
    """The Gluon kernel compiles with this machine's Triton for sm_90a, fc1's forward (stacked and
    as halves) and dH's backward, within the registers its launch gives a thread (12 warps x 168),
    its main loop's wgmma chain not serialized by ptxas, and no more than a few spilled bytes (dH: 8
    with Triton 3.6's ptxas, 72 with 3.8's; the tilings that did not fit spilled kilobytes)."""
    from moeblaze_megatron.kernels.configs import EPI_ACT_BWD, EPI_ACT_FWD
    from moeblaze_megatron.kernels.gather_gemm_ws import WS_TILES, ws_registers

    limit = {"fc1_act_ws": ws_registers(WS_TILES[EPI_ACT_FWD]), "fc1_act_halves_ws": ws_registers(WS_TILES[EPI_ACT_FWD]),
             "dh_act_bwd_ws": ws_registers(WS_TILES[EPI_ACT_BWD])}
    assert limit == {"fc1_act_ws": 168, "fc1_act_halves_ws": 168, "dh_act_bwd_ws": 168}

    launches = list(limit)
    records = _compile(tmp_path, launches, 1)
    assert [r["launch"] for r in records] == launches
    for record in records:
        assert record["config"] == "fixed" and record["wgmma"] and record["tma"], record
        assert 0 < record["registers"] <= limit[record["launch"]] and not record["wgmma_serialized"], record
        assert record["spill_store_bytes"] <= 128, record
        # Hopper's 227 KB a program may have (dH: four stages, the tile buffer, a tile's pre by TMA).
        assert 0 < record["shared_bytes"] <= 227 * 1024, record
        assert any(op.startswith("setmaxnreg") for op in record["histogram"]), record["histogram"]
        assert any(op.startswith("cp.async.mbarrier.arrive") for op in record["histogram"]), record["histogram"]


def test_a_predicated_instruction_counts_under_its_opcode():
    ptx = "\n".join([".reg .b32 %r<4>;", "// a comment", "$L__BB0_1:", "\tld.global.v4.b32 {%r1, %r2}, [%rd1];",
                     "\t@%p1 st.global.v4.b32 [%rd2], {%r1, %r2};", "\t@!%p2 st.global.v4.b32 [%rd3], {%r1, %r2};",
                     "\t@%p3 bra $L__BB0_1;", "\tret;"])
    assert histogram(ptx) == {"ld.global.v4.b32": 1, "st.global.v4.b32": 2, "bra": 1, "ret;": 1}
