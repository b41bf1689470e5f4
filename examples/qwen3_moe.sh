#!/usr/bin/env bash
# Qwen3-MoE-like (Qwen3-30B-A3B's MoE) on one GPU: 128 experts, top-8, expert width 768,
# QK-norm, 32 heads of 128 over 4 KV groups, at its real width 2048 with 4 of its 48 layers.
#   DISPATCHER=moeblaze bash examples/qwen3_moe.sh    # or DISPATCHER=alltoall for stock Megatron
# Other knobs (SEQ_LEN, MICRO_BATCH, TRAIN_ITERS, DATA, SAVE/LOAD, EXTRA_ARGS...): examples/common.sh.
MODEL_ARGS=(
    --num-layers 4 --hidden-size 2048 --ffn-hidden-size 6144
    --num-attention-heads 32 --kv-channels 128 --group-query-attention
    --num-query-groups 4 --qk-layernorm --rotary-base 1000000
    --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
