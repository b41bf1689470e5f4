"""The op's one entry and the expert-parallel front's one rule.

``moe_mlp`` takes fc1 stacked or as the (gate, up) pair and gives the same bits either way (the
kernels' dx to float32 rounding: they sum the halves one after the other), with the pair's
gradient as a pair; weights in another dtype than x are cast inside each pass (only
the weights are kept for backward) and their gradients come back in their own dtype;
``parallel.moe.resolve_mode`` turns the options into one ``EPMode`` per forward (the traffic
model asked only where the options leave a choice; under compile from this rank's own token
count, with the choice's index for the ops to check); the options are checked once, in
``config.py``, and the ring refuses recompute='activation' by name.
"""

from __future__ import annotations

import pytest
import torch

from moe_testing import GRAD_INPUTS, TRITON_INTERPRETED, make_moe_problem
from moeblaze_megatron import moe_mlp
from moeblaze_megatron.config import MoEBlazeConfig, OptionError, ring_recompute_problem
from moeblaze_megatron.parallel import moe as front
from moeblaze_megatron.parallel.traffic import MODES, EPMode, LayerTraffic, step_bytes
from moeblaze_megatron.training.audit import saved_bytes_for_backward

BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not (TRITON_INTERPRETED or torch.cuda.is_available()), reason="needs the Triton kernels"))]


def _problem(dtype=torch.float32, seed=0, routing="unused"):
    return make_moe_problem(29, 16, 12, 6, 3, "swiglu", dtype, torch.Generator().manual_seed(seed), routing=routing)


def _grads(y, leaves, grad_y):
    for t in leaves:
        t.grad = None
    y.backward(grad_y)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recompute", ["activation", "fc1"])
def test_the_pair_form_gives_the_stacked_forms_bits(backend, recompute):
    p = _problem()
    grad_y = torch.randn(p["x"].shape, generator=torch.Generator().manual_seed(2))
    stacked = _grads(moe_mlp(p["x"], p["topk_ids"], p["topk_probs"], p["fc1_weight"], p["fc2_weight"],
                             recompute=recompute, backend=backend),
                     [p[n] for n in GRAD_INPUTS], grad_y)
    gate, up = (h.detach().contiguous().requires_grad_() for h in p["fc1_weight"].chunk(2, dim=1))
    leaves = [p["x"], p["topk_probs"], gate, up, p["fc2_weight"]]
    paired = _grads(moe_mlp(p["x"], p["topk_ids"], p["topk_probs"], (gate, up), p["fc2_weight"],
                            recompute=recompute, backend=backend), leaves, grad_y)
    assert torch.equal(paired[0], stacked[0]) and torch.equal(paired[2], stacked[2])
    assert torch.equal(torch.cat([paired[3], paired[4]], dim=1), stacked[3])
    assert torch.equal(paired[5], stacked[4])
    if backend == "reference":  # the pair stacked inside each pass: the same GEMMs
        assert torch.equal(paired[1], stacked[1])
    else:
        # The kernels' dx sums the gate half, then the up half: fp32 rounding apart, no more.
        torch.testing.assert_close(paired[1], stacked[1], rtol=0, atol=4 * 2.0**-23 * stacked[1].abs().max().item())


def test_weights_in_another_dtype_are_cast_in_each_pass_and_only_they_are_kept():
    p = _problem(torch.bfloat16, seed=3)
    master = [p[n].detach().float().requires_grad_() for n in ("fc1_weight", "fc2_weight")]
    grad_y = torch.randn(p["x"].shape, generator=torch.Generator().manual_seed(4)).bfloat16()
    # The same bits as weights cast by hand: the cast is the op's own.
    want = _grads(moe_mlp(p["x"], p["topk_ids"], p["topk_probs"], master[0].bfloat16(), master[1].bfloat16(),
                          backend="reference"), master, grad_y)
    x = p["x"].detach().requires_grad_()
    y, saved = saved_bytes_for_backward(lambda: moe_mlp(x, p["topk_ids"], p["topk_probs"], *master,
                                                        backend="reference"), master)
    got = _grads(y, master, grad_y)
    assert got[1].dtype == got[2].dtype == torch.float32
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # Kept: x, the probabilities, the ids' plan and the pre-activations; no bf16 copy of a weight.
    weight_copies = sum(w.numel() * 2 for w in master)
    pre = 29 * 3 * 2 * 12 * 2
    assert saved < pre + x.numel() * 2 + weight_copies, saved


def test_the_pair_form_is_checked():
    p = _problem()
    gate, up = p["fc1_weight"].detach().chunk(2, dim=1)
    with pytest.raises(ValueError, match=r"\(gate, up\) pair of a SwiGLU expert MLP.*activation='gelu'"):
        moe_mlp(p["x"], p["topk_ids"], p["topk_probs"], (gate, up), p["fc2_weight"][:, :, :6], "gelu")
    with pytest.raises(TypeError, match=r"fc1_weight\[1\] \(up\) must be a torch.Tensor"):
        moe_mlp(p["x"], p["topk_ids"], p["topk_probs"], (gate, None), p["fc2_weight"])
    with pytest.raises(ValueError, match="used_slots is for a plan built here"):
        from moeblaze_megatron import build_routing_plan

        moe_mlp(p["x"], p["topk_ids"], p["topk_probs"], p["fc1_weight"], p["fc2_weight"],
                plan=build_routing_plan(p["topk_ids"], 6), used_slots=3)


# ---------------------------------------------------------------------------------------------
# The expert-parallel front's rule


class _Group:
    """A stand-in for a process group of ``size`` ranks (only its size is read)."""

    def __init__(self, size):
        self.size = size


@pytest.fixture
def fake_groups(monkeypatch):
    means = []
    monkeypatch.setattr(front.dist, "get_world_size", lambda group: group.size)

    def mean(tokens, group, device):
        means.append(tokens)
        return 1000.0

    monkeypatch.setattr(front, "group_mean_tokens", mean)
    return means


def _traffic_of(asked):
    def traffic(tokens):
        asked.append(tokens)
        return LayerTraffic(tokens=tokens, hidden=2048, topk=8, experts_per_rank=16, ranks=8,
                            weight_numel=16 * 3 * 768 * 2048)
    return traffic


@pytest.mark.parametrize("options,want", [
    (dict(), EPMode.ALLTOALL),
    (dict(ep_mode="ring", ring_mode="expert", recompute="fc1"), EPMode.EXPERT_RING),
    (dict(ep_mode="ring", ring_mode="token", recompute="fc1"), EPMode.TOKEN_RING),
])
def test_a_named_mode_asks_nothing(fake_groups, options, want):
    asked = []
    mode, chosen = front.resolve_mode(MoEBlazeConfig(**options), _Group(4), 123, _traffic_of(asked), "cpu")
    assert (mode, chosen) == (want, -1) and asked == [] and fake_groups == []


@pytest.mark.parametrize("options", [dict(), dict(ep_mode="auto", recompute="fc1")])
def test_one_rank_is_local(fake_groups, options):
    for group in (None, _Group(1)):
        assert front.resolve_mode(MoEBlazeConfig(**options), group, 5, _traffic_of([]), "cpu") == (EPMode.LOCAL, -1)


@pytest.mark.parametrize("ep_mode,candidates", [("ring", ("expert", "token")),
                                                ("auto", ("alltoall", "expert", "token"))])
def test_a_choice_is_made_by_bytes_from_a_count_every_rank_agrees_on(fake_groups, ep_mode, candidates):
    options = MoEBlazeConfig(ep_mode=ep_mode, ring_mode="auto", recompute="fc1")
    asked = []
    traffic = _traffic_of([])(1000.0)
    want = min(candidates, key=lambda m: (sum(step_bytes(m, traffic)), MODES.index(m)))
    mode, chosen = front.resolve_mode(options, _Group(8), 123, _traffic_of(asked), "cpu")
    # Eager: the group's mean, gathered (here 1000), and nothing for the ops to check.
    assert (mode, chosen) == (EPMode(want), -1) and asked == [1000.0] and fake_groups == [123]
    # Compiled: this rank's own count, and the choice's index for the ops to check.
    asked.clear()
    mode, chosen = front.resolve_mode(options, _Group(8), 1000, _traffic_of(asked), "cpu", compiling=True)
    assert mode == EPMode(want) and chosen == MODES.index(want) and asked == [1000] and fake_groups == [123]


def test_the_ring_refuses_to_drop_recompute():
    for ep_mode in ("ring", "auto"):
        with pytest.raises(OptionError, match=f"ep_mode='{ep_mode}' needs recompute='fc1'") as error:
            MoEBlazeConfig(ep_mode=ep_mode)
        assert error.value.option == "ep_mode" and error.value.choices is None
        assert MoEBlazeConfig(ep_mode=ep_mode, recompute="fc1").saves_pre_activations is False
    assert ring_recompute_problem("alltoall", "activation") is None
    assert MoEBlazeConfig().saves_pre_activations is True


def test_each_option_is_checked_once_with_its_name():
    with pytest.raises(OptionError, match=r"recompute must be one of \('activation', 'fc1'\), got 'full'") as error:
        MoEBlazeConfig(recompute="full")
    assert (error.value.option, error.value.value, error.value.choices) == ("recompute", "full", ("activation", "fc1"))
    with pytest.raises(ValueError, match="backend must be one of"):
        moe_mlp(*(_problem()[n] for n in ("x", "topk_ids", "topk_probs", "fc1_weight", "fc2_weight")),
                backend="cuda")


def test_the_experts_routing_counts_its_rows_without_a_host_read():
    ids = torch.tensor([[0, 2], [2, -1], [-1, -1], [1, 2]])
    routing = front.ExpertRouting(ids, 4)
    assert routing.tokens_per_expert.tolist() == [1, 1, 3, 0]
    assert front.ExpertRouting(ids, 4, EPMode.EXPERT_RING).tokens_per_expert is None
