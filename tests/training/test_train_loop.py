"""The minimal Megatron-Core loop on the CPU: MoEBlaze against the stock dispatcher on the tiny
model and on narrowed versions of the example families, and Megatron --save/--load resumes (also
across dispatchers)."""

from __future__ import annotations

import pytest
import torch
from moe_testing import RaiseInBackward

from moeblaze_megatron.training.cpu_shims import enable_cpu_megatron
from moeblaze_megatron.training.train_loop import RunSpec, Trainer, single_process

CPU = torch.device("cpu")
# fp32 losses of two dispatchers from the same weights differ only by summation order in the
# MoE layers (a few ulps, 1e-7 relative); after a handful of steps that grows to ~1e-6. 1e-5
# relative still catches a wrong expert, probability or weight mapping (differences of 1e-2+).
LOSS_RTOL = 1e-5
# Narrowed example families: the same router, expert-count ratios and features at CPU width.
NARROW = ["--hidden-size", "64", "--ffn-hidden-size", "128", "--moe-ffn-hidden-size", "32",
          "--num-attention-heads", "4", "--kv-channels", "16", "--num-query-groups", "2",
          "--moe-shared-expert-intermediate-size", "32"]


@pytest.fixture(scope="module")
def cpu_world():
    with enable_cpu_megatron(), single_process(CPU):
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from moeblaze_megatron.training.corpus import build_byte_dataset, stdlib_source_files

    prefix = tmp_path_factory.mktemp("corpus") / "pystdlib"
    build_byte_dataset(prefix, stdlib_source_files(), max_bytes=300_000)
    return str(prefix)


def tiny(dispatcher, corpus, **overrides):
    fields = dict(family="tiny", dispatcher=dispatcher, seq_length=32, micro_batch_size=2, train_iters=8,
                  data_path=corpus, lr=3e-3, min_lr=3e-4, warmup_iters=2, clip_grad=0.0)
    fields.update(overrides)
    return RunSpec(**fields)


def train(run, steps, initial_state=None, save_at=None):
    trainer = Trainer(run, CPU, initial_state=initial_state)
    state = trainer.unwrapped_state_dict() if initial_state is None else initial_state
    losses = []
    for _ in range(steps):
        losses.append(trainer.train_step().loss)
        if trainer.iteration == save_at:
            trainer.save()
    iteration = trainer.iteration
    trainer.close()
    return losses, state, iteration


def assert_close_losses(got, want, rtol):
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rtol * abs(w), f"step {step}: {g} vs {w}"


def test_moeblaze_trains_like_stock_and_resumes_across_dispatchers(cpu_world, corpus, tmp_path):
    """Each dispatcher saves a Megatron checkpoint at step 4 of 8 and goes on; each checkpoint is
    resumed under both dispatchers. Resuming under the dispatcher that saved it reproduces the
    uninterrupted losses exactly; under the other, to fp32 rounding; and the two uninterrupted
    runs (same initial weights) agree to fp32 rounding."""
    uninterrupted, state = {}, None
    for dispatcher in ("allgather", "moeblaze"):
        save = tmp_path / dispatcher
        losses, state, _ = train(tiny(dispatcher, corpus, save=str(save)), 8, initial_state=state, save_at=4)
        uninterrupted[dispatcher] = losses
        assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert uninterrupted["allgather"][-1] < uninterrupted["allgather"][0] - 0.5  # it learns
    assert_close_losses(uninterrupted["moeblaze"], uninterrupted["allgather"], LOSS_RTOL)

    for saved_by in ("allgather", "moeblaze"):
        for resumed_under in ("allgather", "moeblaze"):
            trainer = Trainer(tiny(resumed_under, corpus, load=str(tmp_path / saved_by)), CPU)
            assert trainer.iteration == 4 and trainer.args.consumed_train_samples == 8
            resumed = [trainer.train_step().loss for _ in range(4)]
            trainer.close()
            want = uninterrupted[saved_by][4:]
            if resumed_under == saved_by:
                assert resumed == want, f"{saved_by} checkpoint resumed under {resumed_under}"
            else:
                assert_close_losses(resumed, want, LOSS_RTOL)


@pytest.mark.parametrize("family,experts", [("mixtral", None), ("deepseek_v3", "16"), ("qwen3_moe", "16")])
def test_example_families_train_alike(cpu_world, family, experts):
    """Each example family's router and MoE options (top-2 softmax; sigmoid + expert bias + group-
    limited routing + shared expert + dense first layer + seq aux loss; top-8 of many experts +
    QK-norm), narrowed to CPU width, give the same losses under both dispatchers."""
    extra = NARROW + (["--num-experts", experts] if experts else [])
    runs = {}
    state = None
    for dispatcher in ("allgather", "moeblaze"):
        run = RunSpec(family=family, dispatcher=dispatcher, seq_length=32, micro_batch_size=2, train_iters=3,
                      warmup_iters=1, clip_grad=0.0, extra_args=extra)
        runs[dispatcher], state, _ = train(run, 3, initial_state=state)
    assert_close_losses(runs["moeblaze"], runs["allgather"], LOSS_RTOL)


def test_run_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="family"):
        RunSpec(family="gpt5", dispatcher="moeblaze", seq_length=8, micro_batch_size=1, train_iters=2)
    with pytest.raises(ValueError, match="warmup_iters"):
        RunSpec(family="tiny", dispatcher="moeblaze", seq_length=8, micro_batch_size=1, train_iters=2, warmup_iters=2)
    with pytest.raises(ValueError, match="seq_length"):
        RunSpec(family="tiny", dispatcher="moeblaze", seq_length=0, micro_batch_size=1, train_iters=2)


@pytest.mark.parametrize("dispatcher", ["alltoall", "moeblaze"])
def test_a_failed_step_is_forgotten(cpu_world, corpus, dispatcher):
    """A step that runs out of memory in its backward, half way down the model, leaves the graph
    of its forward attached to the model (stock alltoall's dispatcher keeps the router
    probabilities), and its first layers' gradients begun. forget_failed_step drops both: no
    graph stays alive and the next step trains exactly as if the failed one never ran."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2] / "scripts"))
    from benchlib.memory_search import graph_holders
    from megatron.core.utils import unwrap_model

    run = tiny(dispatcher, corpus)
    clean, state, _ = train(run, 2)
    trainer = Trainer(run, CPU, initial_state=state)
    assert trainer.train_step().loss == clean[0]
    layers = unwrap_model(trainer.model[0]).decoder.layers
    hook = layers[1].register_forward_hook(lambda module, inputs, out: (RaiseInBackward.apply(out[0]), *out[1:]))
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        trainer.train_step()
    hook.remove()
    held = graph_holders(CPU)
    if dispatcher == "alltoall":
        assert any("MoEAlltoAllTokenDispatcher.probs" in h["owners"] for h in held), held
    dropped = trainer.forget_failed_step()
    assert ("MoEAlltoAllTokenDispatcher.probs" in dropped) == (dispatcher == "alltoall"), dropped
    assert graph_holders(CPU) == []
    assert trainer.train_step().loss == clean[1]
    trainer.close()


def test_an_interrupted_shared_expert_overlap_is_reset():
    """Megatron's overlapped shared experts step through a state machine in each forward and assert
    it was left IDLE; a step that raised between two of its calls would fail every later forward
    (seen on the H200 in the memory search of the TE stock run with --moe-shared-expert-overlap).
    reset_step_states sets it back, and the next forward's first call passes Megatron's own check."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.shared_experts import SharedExpertState, overlap_state_check

    from moeblaze_megatron.training.attached_graphs import reset_step_states

    class Overlapped(torch.nn.Module):  # the calling order of SharedExpertMLP, under Megatron's decorator
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(moe_shared_expert_overlap=True)
            self._overlap_state = SharedExpertState.IDLE

        @overlap_state_check(SharedExpertState.IDLE, SharedExpertState.PRE_FORWARD_COMM_DONE)
        def pre_forward_comm(self):
            pass

        @overlap_state_check(SharedExpertState.PRE_FORWARD_COMM_DONE, SharedExpertState.FC1_FORWARD_DONE)
        def linear_fc1_forward_and_act(self):
            pass

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Overlapped(), Overlapped())
    assert reset_step_states([model]) == []
    model[2].pre_forward_comm()
    model[2].linear_fc1_forward_and_act()  # ... and the step raised here
    with pytest.raises(AssertionError, match="must be called from IDLE state"):
        model[2].pre_forward_comm()
    assert reset_step_states([model]) == ["Overlapped._overlap_state (FC1_FORWARD_DONE)"]
    assert model[1]._overlap_state is model[2]._overlap_state is SharedExpertState.IDLE
    model[2].pre_forward_comm()
