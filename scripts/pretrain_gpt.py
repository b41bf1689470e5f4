#!/usr/bin/env python3
"""Megatron GPT pretraining with the MoEBlaze dispatcher available.

    torchrun --nproc-per-node 1 scripts/pretrain_gpt.py <Megatron GPT flags> \\
        --moe-token-dispatcher-type moeblaze [--moeblaze-recompute fc1] [--moeblaze-attention sdpa]

Megatron-Core's wheel carries ``megatron.training`` (``pretrain``, the argument parser) but not
Megatron-LM's ``pretrain_gpt.py``; this is that entry point for the wheel, with the plugin
installed (its hooks: benchlib.pretrain_hooks). It takes Megatron's own flags (model,
parallelism, optimizer, --data-path / --mock-data, --save / --load, logging) plus the plugin's
``--moeblaze-*`` flags and ``--moeblaze-attention`` (the attention core: SDPA, Megatron's local
attention, or Transformer Engine's where installed). Any other dispatcher (allgather, alltoall,
flex) runs exactly as in Megatron. Training needs a CUDA GPU: without one the script says so
before Megatron starts.
"""

from __future__ import annotations

import sys

NEEDS_CUDA = """scripts/pretrain_gpt.py: Megatron pretraining needs a CUDA GPU, and this machine has none.
On a CPU:
  python examples/demo_moe_mlp.py          # the op alone, checked against a float64 loop
  python scripts/compare_dispatchers.py    # stock and MoEBlaze dispatchers train a tiny model side by side"""


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    import torch

    if not torch.cuda.is_available() and not {"-h", "--help"} & set(argv):
        sys.exit(NEEDS_CUDA)
    from benchlib.pretrain_hooks import pretrain_gpt

    pretrain_gpt(argv)


if __name__ == "__main__":
    main()
