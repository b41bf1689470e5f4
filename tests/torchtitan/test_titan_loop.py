"""training.titan_loop's loss choice: torchtitan's chunked loss and the plain cross entropy train
the same step (the same loss and gradients, up to the order the chunks add in), for stock and the
override; the default follows the torch version (torch 2.11's FSDP2 cannot train the chunked
loss); an unknown loss is named."""

from __future__ import annotations

import pytest
import torch
from moe_testing import RaiseInBackward

CPU = torch.device("cpu")


def _first_step(loss, override):
    from moeblaze_megatron.training.titan_loop import TitanRun, TitanTrainer

    trainer = TitanTrainer(TitanRun(override=override, steps=4, seed=3, loss=loss), CPU)
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    inputs, labels, positions = trainer.next_batch()
    global_valid_tokens = torch.tensor(labels.numel())
    # train_step's forward and backward, without its optimizer step.
    inputs, labels, extra = annotate_input_spmd_types(trainer.parallel_dims, inputs, labels, {"positions": positions})
    value = float(trainer._forward_backward(inputs, labels, global_valid_tokens, extra).detach())
    grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).double().clone()
             for name, p in trainer.model.named_parameters()}
    trainer.close()
    return value, grads


@pytest.mark.parametrize("override", [None, {"backend": "reference"}], ids=["stock", "moeblaze"])
def test_plain_and_chunked_losses_train_the_same_step(override):
    from moeblaze_megatron.training.titan_loop import single_process

    with single_process(CPU):
        chunked, chunked_grads = _first_step("chunked", override)
        plain, plain_grads = _first_step("plain", override)
    assert abs(plain - chunked) <= 1e-5 * abs(chunked) and chunked > 0
    assert plain_grads.keys() == chunked_grads.keys() and "lm_head.weight" in plain_grads
    for name, grad in chunked_grads.items():
        # Gradients reach the model in bfloat16 (FSDP's mixed precision): the two sums round
        # apart by at most one bf16 ulp of the largest entry.
        scale = grad.abs().max().item()
        assert scale > 0, name
        assert (plain_grads[name] - grad).abs().max().item() <= torch.finfo(torch.bfloat16).eps * scale, name


def test_default_loss_follows_the_torch_version(monkeypatch):
    from moeblaze_megatron.training import titan_loop

    for version, expected in (("2.11.0+cu130", "plain"), ("2.12.0", "chunked"), ("2.14.1+cpu", "chunked")):
        monkeypatch.setattr(torch, "__version__", version)
        assert titan_loop.default_loss() == expected, version


def test_unknown_loss_is_named():
    from moeblaze_megatron.training.titan_loop import TitanRun

    with pytest.raises(ValueError, match=r"loss must be one of \('chunked', 'plain'\), got 'mean'"):
        TitanRun(loss="mean")


def test_releasing_the_cuda_graph_frees_torchtitans_shared_pool(monkeypatch):
    """release_cuda_graph tears down torchtitan's graph manager (its warm-up graph holds the pool
    every captured step allocated from), not only the wrappers; a later wrapper sets it up again.
    Stand-ins for the graphs: no CUDA here."""
    import types

    from torchtitan.distributed import cudagraph

    from moeblaze_megatron.training.titan_loop import TitanTrainer

    torn = []
    manager = cudagraph._CUDAGraphManager()
    manager._initialized, manager._graph_pool, manager._dummy_graph = True, "pool", "warm-up graph"
    manager._wrappers = [types.SimpleNamespace(teardown=lambda: torn.append("wrapper"))]
    monkeypatch.setattr(cudagraph, "_manager", manager)
    trainer = types.SimpleNamespace(run=types.SimpleNamespace(cuda_graphs=True), device=torch.device("cuda", 0),
                                    fwd_bwd="captured step", _forward_backward="eager step")
    TitanTrainer.release_cuda_graph(trainer)
    assert torn == ["wrapper"] and trainer.fwd_bwd == "eager step"
    assert (manager._initialized, manager._graph_pool, manager._dummy_graph, manager._wrappers) == (False, None, None, [])


@pytest.mark.parametrize("override", [None, {"backend": "reference"}], ids=["stock", "moeblaze"])
def test_a_failed_step_is_forgotten(override):
    """A step that runs out of memory in its backward, after the second layer's, leaves no graph
    alive once forget_failed_step ran, and the next step trains exactly as if it never ran."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    from benchlib.memory_search import graph_holders

    from moeblaze_megatron.training.titan_loop import TitanRun, TitanTrainer, single_process

    run = TitanRun(override=override, steps=4, seed=3)
    with single_process(CPU):
        clean = TitanTrainer(run, CPU)
        state, first, second = clean.full_state(), clean.next_batch(), clean.next_batch()
        losses = [clean.train_step(first).loss, clean.train_step(second).loss]
        clean.close()
        trainer = TitanTrainer(run, CPU, initial_state=state)
        assert trainer.train_step(first).loss == losses[0]
        layer = list(trainer.model.layers.values())[1]
        hook = layer.register_forward_hook(lambda module, inputs, out: RaiseInBackward.apply(out))
        with pytest.raises(torch.OutOfMemoryError, match="simulated"):
            trainer.train_step(second)
        hook.remove()
        trainer.forget_failed_step()
        assert graph_holders(CPU) == []
        assert trainer.train_step(second).loss == losses[1]
        trainer.close()
