"""scripts/tune_kernels.py's launches (benchlib.kernel_tuning), run once each on the CPU (Triton
interpreted, bfloat16, a tiny layer, SwiGLU and SiLU): every op computes what its name says, so the
GPU-only script cannot rot unseen; and benchlib's chunked relative error."""

from __future__ import annotations

import pytest
import torch
from benchlib import kernel_tuning
from benchlib.accuracy import rel_err
from moe_testing import rel_error

T, D, H, E, K = 48, 32, 16, 5, 2


class CountingSampler:
    """A stand-in for the GPU's NVML sampler: an energy counter (mJ) the test's own calls advance
    (``mj``), with fixed (watts, SM MHz, clock-event reasons) readings taken at each window's start."""

    def __init__(self, samples=((650.0, 1500, 0x4),), mj=0.0):
        self.mj = mj
        self.readings = list(samples)
        self.samples = []

    def energy_mj(self):
        return self.mj

    def __enter__(self):
        self.samples = list(self.readings)
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture(scope="module", params=["swiglu", "silu"])
def layer(request):
    plan, references, ops, (x, fc1, rows) = kernel_tuning.layer_ops(T, D, H, E, K, seed=3, dev="cpu",
                                                                    activation=request.param)
    assert fc1.shape[1] == (2 * H if request.param == "swiglu" else H)
    return plan, references, {op[0]: op for op in ops}, x


def _run(ops, name):
    _, _, kind, launch, outputs, reset = ops[name]
    for t in outputs():
        t.fill_(float("nan"))
    reset()
    launch(None)
    return [t.clone() for t in outputs()]


def test_every_op_writes_finite_outputs(layer):
    _, _, ops, _ = layer
    assert {"fc1_act", "fc2", "dh_act_bwd", "dw2", "dw1", "dw1_contiguous", "dw1_grouped_mm", "dw2_grouped_mm",
            "dw1_pointer", "dw2_pointer", "dx", "fc2_grouped_mm", "dx_grouped_mm", "fc1_act_pointer",
            "dh_act_bwd_pointer", "dx_pointer", "fc2_rows_pointer", "dx_rows_pointer", "fc1_plain", "dh_plain",
            "fc1_ws", "dh_ws", "dh_ws_plain"} <= set(ops)
    for name, (_, _, kind, *_) in ops.items():
        if name.endswith("_grouped_mm"):
            continue  # returns a fresh tensor; checked below
        if kind == "gluon":
            continue  # Hopper only (tune() skips them elsewhere); tests/gpu runs the kernel
        for out in _run(ops, name):
            assert torch.isfinite(out).all(), name


def test_the_plain_ops_are_the_fused_ones_main_loops(layer):
    """fc1_plain stores fc1's pre-activations (what fc1_act stores beside act(pre)); dh_plain the
    dH that dh_act_bwd's epilogue starts from (checked through its partials: <dH, act(pre)>)."""
    plan, references, ops, _ = layer
    used = int(plan.expert_token_offsets[-1])
    pre = _run(ops, "fc1_act")[1][:used]
    assert torch.equal(_run(ops, "fc1_plain")[0][:used], pre)
    saved = references["fc1_plain"][0][:used].float()  # what the dH ops start from
    if saved.shape[1] == 2 * H:
        gate, up = saved.chunk(2, dim=1)
        act = gate * torch.sigmoid(gate) * up
    else:
        act = saved * torch.sigmoid(saved)
    dh = _run(ops, "dh_plain")[0][:used].float()
    partials = _run(ops, "dh_act_bwd")[2][:used]
    assert torch.allclose(partials, (dh * act).sum(dim=1), rtol=1e-4, atol=1e-4 * partials.abs().max().item())


def test_weight_gradient_ops_agree_with_a_float64_reduction(layer):
    plan, references, ops, x = layer
    dw1 = _run(ops, "dw1")[0]
    # dW1 reduces d pre, which the dH launch writes over the saved pre-activations (its second output).
    dpre = _run(ops, "dh_act_bwd")[1].double()
    idx = plan.expert_token_indices.long()
    offsets = plan.expert_token_offsets.tolist()
    expected = torch.stack([dpre[lo:hi].T @ x.double()[idx[lo:hi]] for lo, hi in zip(offsets[:-1], offsets[1:])])
    assert rel_error(dw1, expected) < 1e-2
    grouped_mm = _run(ops, "dw1_grouped_mm")[0]
    assert grouped_mm.shape == dw1.shape
    assert rel_error(grouped_mm, references["dw1_grouped_mm"][0]) < 1e-2
    dw2_grouped_mm = _run(ops, "dw2_grouped_mm")[0]
    assert dw2_grouped_mm.shape == references["dw2_grouped_mm"][0].shape
    assert rel_error(dw2_grouped_mm, references["dw2_grouped_mm"][0]) < 1e-2


def test_pointer_load_diagnostics_give_the_kernels_bits(layer):
    _, references, ops, _ = layer
    for pointer_op, plain_op in (("dw1_pointer", "dw1"), ("dw2_pointer", "dw2")):
        assert torch.equal(_run(ops, pointer_op)[0], _run(ops, plain_op)[0]), pointer_op
        assert torch.equal(references[pointer_op][0], _run(ops, plain_op)[0]), pointer_op


@pytest.mark.parametrize("name", ["fc2_grouped_mm", "dx_grouped_mm"])
def test_grouped_mm_row_diagnostics_agree_with_the_kernels(layer, name):
    _, references, ops, _ = layer
    out = _run(ops, name)[0]
    assert out.shape == references[name][0].shape and torch.isfinite(out).all()
    assert rel_error(out, references[name][0]) < 1e-2
    assert rel_error(out, _run(ops, name.removesuffix("_grouped_mm"))[0]) < 1e-2


def test_pointer_diagnostics_give_the_tma_forms_bits(layer):
    _, references, ops, _ = layer
    for name in ("fc1_act_pointer", "dh_act_bwd_pointer", "dx_pointer", "fc2_rows_pointer", "dx_rows_pointer"):
        got = _run(ops, name)
        assert len(got) == len(references[name])
        for out, ref in zip(got, references[name]):
            assert torch.equal(out, ref), name


def test_chunked_relative_error_matches_the_whole_tensor_formula():
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(7, 5, 3, generator=gen)
    b = a + 0.01 * torch.randn(7, 5, 3, generator=gen)
    whole = ((a.double() - b.double()).norm() / b.double().norm()).item()
    for chunk in (1, 15, 16, 1 << 26):  # one row, exactly one slice, a slice and a bit, everything
        assert abs(rel_err(a, b, chunk=chunk) - whole) < 1e-12 * whole


def test_relative_error_of_zero_references_and_losses():
    zero = torch.zeros(3, 2)
    assert rel_err(zero, zero) == 0.0
    assert rel_err(torch.ones(3, 2), zero) == float("inf")  # never a pass against a zero reference
    assert rel_err(torch.tensor(1.5), torch.tensor(2.0)) == pytest.approx(0.25)  # a 0-dim loss


def test_energy_per_call_takes_the_reset_out(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # no GPU here: nothing to wait for
    sampler = CountingSampler()

    def op():
        sampler.mj += 3.0

    def reset():
        sampler.mj += 1.0

    rec = kernel_tuning.energy_per_call(op, reset, sampler, seconds=0.01)
    assert rec["joules"] == pytest.approx(3e-3)  # 4 mJ per op-and-reset, less the reset's 1 mJ
    assert rec["reset_joules"] == pytest.approx(1e-3)
    assert rec["steps"] >= 3 and rec["mean_watts"] == 650.0 and rec["power_capped_share"] == 1.0
    alone = kernel_tuning.energy_per_call(op, kernel_tuning.nothing, sampler, seconds=0.0)
    assert alone["joules"] == pytest.approx(3e-3) and "reset_joules" not in alone and alone["steps"] == 3


def test_negative_energy_seconds_are_refused():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "tune_kernels.py"
    done = subprocess.run([sys.executable, str(script), "--energy-seconds", "-1"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 1 and "--energy-seconds must be >= 0, got -1.0" in done.stderr
