#!/usr/bin/env bash
# Mixtral-like MoE on one GPU: 8 experts, top-2, expert width 3.5x hidden (Mixtral-8x7B's
# shape), 4 layers at width 2048, GQA.
#   DISPATCHER=moeblaze bash examples/mixtral.sh      # or DISPATCHER=alltoall for stock Megatron
# Other knobs (SEQ_LEN, MICRO_BATCH, TRAIN_ITERS, DATA, SAVE/LOAD, EXTRA_ARGS...): examples/common.sh.
MODEL_ARGS=(
    --num-layers 4 --hidden-size 2048 --ffn-hidden-size 7168
    --num-attention-heads 16 --group-query-attention --num-query-groups 4
    --rotary-base 1000000
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 7168
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
