"""Distributed checkpoints move both ways between stock torchtitan and the override: written with
torch.distributed.checkpoint through torchtitan's own checkpoint objects (``ModelWrapper`` for the
model, the ``OptimizersContainer`` for AdamW's state, what its CheckpointManager saves), on the
whole model parallelized by torchtitan (FSDP2 over a mesh of one) and on an MoE layer whose
experts are ``Shard(0)`` over an EP mesh of two (gloo). Loading gives bitwise the saved weights
and optimizer state, and the next training step agrees within bfloat16 rounding."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from moe_testing import run_distributed
from titan_testing import (
    REL_TOL,
    expert_parallel_dims,
    global_state,
    layer_inputs,
    make_moe_config,
    rel_error,
    titan_world,
    with_override,
)

CPU = torch.device("cpu")
OVERRIDE = {"backend": "reference"}


def _states(trainer):
    from torchtitan.components.checkpointer.base import ModelWrapper

    return {"model": ModelWrapper(trainer.model), "optimizer": trainer.optimizers}


def _flat(trainer):
    """Model weights and the optimizer's flat FQN-keyed state, as plain tensors."""
    from moeblaze_megatron.training.titan_loop import full_state

    out = {f"model.{k}": v for k, v in full_state(trainer.model).items()}
    for k, v in trainer.optimizers.state_dict().items():
        if isinstance(v, torch.Tensor):
            out[f"optim.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def test_model_and_optimizer_checkpoints_move_both_ways(tmp_path):
    from moeblaze_megatron.training.titan_loop import TitanRun, TitanTrainer, single_process

    with single_process(CPU):
        for source, target in ((None, OVERRIDE), (OVERRIDE, None)):
            path = tmp_path / f"from_{'stock' if source is None else 'moeblaze'}"
            writer = TitanTrainer(TitanRun(override=source, steps=4, seed=1), CPU)
            batch = writer.next_batch()
            writer.train_step(batch)  # AdamW state exists, weights moved
            dcp.save(_states(writer), checkpoint_id=str(path))
            reader = TitanTrainer(TitanRun(override=target, steps=4, seed=2), CPU)
            dcp.load(_states(reader), checkpoint_id=str(path))
            saved, loaded = _flat(writer), _flat(reader)
            assert saved.keys() == loaded.keys()
            assert [k for k in saved if not torch.equal(saved[k], loaded[k])] == []
            # The same next step from the same state: the same loss up to bfloat16 rounding.
            batch = writer.next_batch()
            a, b = writer.train_step(batch).loss, reader.train_step(batch).loss
            assert abs(a - b) <= 8 * 2.0**-9 * abs(a), (a, b)
            writer.close()
            reader.close()


def _ep_checkpoint_worker(rank, world_size, port, root):
    from torchtitan.components.checkpointer.base import ModelWrapper

    failures = []
    with titan_world(rank, world_size, port):
        parallel_dims, context = expert_parallel_dims(world_size, "partial_dtensor")
        state = global_state("softmax_top2", seed=5)
        other = global_state("softmax_top2", seed=6)
        stock_cfg = make_moe_config("softmax_top2", expert_parallel=True)
        x, _ = layer_inputs(rank, 5)
        for name, writer_cfg, reader_cfg in (("stock_to_moeblaze", stock_cfg, with_override(stock_cfg, **OVERRIDE)),
                                             ("moeblaze_to_stock", with_override(stock_cfg, **OVERRIDE), stock_cfg)):
            modules = []
            for cfg, weights in ((writer_cfg, state), (reader_cfg, other)):
                moe = cfg.build()
                moe.load_state_dict(weights)
                moe.parallelize(parallel_dims)
                modules.append(moe)
            writer, reader = modules
            if not isinstance(writer.routed_experts.inner_experts.w1_EFD, torch.distributed.tensor.DTensor):
                failures.append(f"{name}: the experts are not DTensors on the EP mesh")
            path = f"{root}/{name}"
            dcp.save({"model": ModelWrapper(writer)}, checkpoint_id=path)
            dcp.load({"model": ModelWrapper(reader)}, checkpoint_id=path)
            for key, value in writer.state_dict().items():
                got = reader.state_dict()[key]
                local = (lambda t: t.to_local() if hasattr(t, "to_local") else t)
                if not torch.equal(local(got), local(value)):
                    failures.append(f"{name}: {key} differs after loading")
            outputs = []
            for moe in (writer, reader):
                with context():
                    y = moe(x)
                outputs.append(y.to_local() if hasattr(y, "to_local") else y)
            err = rel_error(outputs[1], outputs[0])
            if not err <= REL_TOL[torch.bfloat16]:
                failures.append(f"{name}: outputs differ by {err:.2e} after loading")
        dist.barrier()
    return failures


def test_expert_parallel_checkpoints_move_both_ways(tmp_path):
    reports = run_distributed(_ep_checkpoint_worker, 2, str(tmp_path), timeout=240)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(reports) for f in fs]
    assert not failures, "\n".join(failures)
