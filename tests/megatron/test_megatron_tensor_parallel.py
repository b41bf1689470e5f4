"""Attention tensor parallelism with sequence parallelism (TP = 2, expert TP = 1) on two CPU
processes: the MoE layer (with tensor-parallel shared experts) receives each rank's sequence shard,
as it does inside a TransformerLayer. MoEBlaze is compared with the stock allgather dispatcher and
with the stock layer in float64, at EP = 1 and with the experts spread over the two TP ranks
(EP = 2: the alltoall exchange and both rings). Every rank compares its outputs and local
gradients.

(A whole GPTModel with sequence parallelism needs Transformer Engine or Apex layer norms, which
this machine does not have; the MoE layer is the part this plugin changes.)
"""

from __future__ import annotations

import torch

from moe_testing import run_distributed
from megatron_testing import (
    REL_TOL,
    build_moe_layer,
    copy_parameters,
    megatron_on_cpu,
    moe_config,
    rel_error,
    seed_everything,
)
from moeblaze_megatron.config import MoEBlazeConfig, set_moeblaze_config
from moeblaze_megatron.training.named_grads import sequential_named_grads as named_grads

SEQ, BATCH, HIDDEN = 16, 2, 32


def _tp_worker(rank, world_size, port, expert_parallel):
    with megatron_on_cpu(
        rank, world_size, port, tensor_model_parallel_size=2, expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=1,
    ):
        overrides = dict(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            expert_tensor_parallel_size=1,
            expert_model_parallel_size=expert_parallel,
            moe_aux_loss_coeff=0.01,
            moe_router_topk=3,
            moe_shared_expert_intermediate_size=16,
        )
        variants = [("stock", "allgather", None), ("moeblaze", "moeblaze", MoEBlazeConfig()),
                    ("oracle", "allgather", None)]
        if expert_parallel > 1:
            variants += [(f"ring_{mode}", "moeblaze", MoEBlazeConfig(ep_mode="ring", ring_mode=mode,
                                                                               recompute="fc1"))
                         for mode in ("expert", "token")]
        layers = {}
        for label, dispatcher, options in variants:
            seed_everything(50)
            config = moe_config(dispatcher, dtype=torch.float64 if label == "oracle" else torch.float32, **overrides)
            if options is not None:
                set_moeblaze_config(config, options)
            layers[label] = build_moe_layer(config)
        for label in layers:
            if label != "stock":
                copy_parameters(layers["stock"], layers[label])
        assert layers["moeblaze"].shared_experts.linear_fc1.weight.shape[0] == 16  # 2*16 / TP 2

        rows_seen = []
        layers["moeblaze"].experts.register_forward_pre_hook(lambda m, args: rows_seen.append(args[0].shape[0]))
        generator = torch.Generator().manual_seed(9)  # the same sequence on both ranks ...
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
        upstream = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
        shard = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)  # ... of which each holds half
        results = {}
        for label, layer in layers.items():
            layer.train()
            dtype = next(layer.parameters()).dtype
            xx = x[shard].to(dtype).requires_grad_()
            out, _ = layer(xx)
            (out * upstream[shard].to(dtype)).sum().backward()
            results[label] = {"output": out.detach(), "input grad": xx.grad, **named_grads(layer)}

        if expert_parallel == 1:
            assert rows_seen == [SEQ // 2 * BATCH], rows_seen
        want = results["oracle"]
        for label in (name for name in layers if name != "oracle"):
            assert results[label].keys() == want.keys()
            bad = {
                k: rel_error(v, want[k])
                for k, v in results[label].items()
                if v is not None and rel_error(v, want[k]) > REL_TOL[torch.float32]
            }
            assert not bad, f"{label}: {bad}"
    return True


def test_tensor_and_sequence_parallel():
    run_distributed(_tp_worker, 2, 1)


def test_tensor_parallel_with_experts_over_tp_ranks():
    run_distributed(_tp_worker, 2, 2)
