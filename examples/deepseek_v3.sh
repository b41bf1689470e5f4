#!/usr/bin/env bash
# DeepSeek-V3-like MoE on one GPU: fine-grained experts (256, top-8, width 512), one shared
# expert, sigmoid router with expert bias (aux-loss-free balancing) and group-limited routing
# (8 groups, 4 chosen), top-k weights scaled by 2.5, a dense first layer; 4 layers at width 2048
# with GQA attention (not MLA).
#   DISPATCHER=moeblaze bash examples/deepseek_v3.sh  # or DISPATCHER=alltoall for stock Megatron
# Other knobs (SEQ_LEN, MICRO_BATCH, TRAIN_ITERS, DATA, SAVE/LOAD, EXTRA_ARGS...): examples/common.sh.
MODEL_ARGS=(
    --num-layers 4 --hidden-size 2048 --ffn-hidden-size 5632
    --num-attention-heads 16 --group-query-attention --num-query-groups 4
    --moe-layer-freq '([0]*1+[1]*3)'
    --num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 512
    --moe-shared-expert-intermediate-size 512
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-topk-scaling-factor 2.5
    --moe-router-num-groups 8 --moe-router-group-topk 4
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
