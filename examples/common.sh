# Shared launcher of the example models, sourced by examples/<family>.sh after it sets MODEL_ARGS.
# Runs scripts/pretrain_gpt.py (Megatron's pretrain with the MoEBlaze plugin) under torchrun
# (python -m torch.distributed.run).
#
# Environment (all optional):
#   DISPATCHER     moeblaze (default) | alltoall | allgather | flex    -- the one switch
#   STOCK          the stock dispatchers' experts: auto (default: te where Transformer Engine is
#                  installed, else sequential) | te (TEGroupedMLP, --moe-grouped-gemm, with the
#                  fused permutation and the fused router: the stock form Megatron users run) |
#                  sequential (SequentialMLP, a loop over the experts: Megatron's only experts
#                  without TE). The fused router is the model's router, so moeblaze gets it too
#                  wherever STOCK resolves to te.
#   NPROC          GPUs on this node (torchrun processes), default 1
#   SEQ_LEN        sequence length, default 4096
#   MICRO_BATCH    micro-batch size, default 2; GLOBAL_BATCH default MICRO_BATCH * NPROC
#   TRAIN_ITERS    default 200; LR default 3e-4; LOG_INTERVAL default 10
#   DATA           builtin (default: the Python stdlib corpus, built on first use) | mock |
#                  a Megatron indexed-dataset prefix (then also set the tokenizer in EXTRA_ARGS)
#   ATTENTION      auto (default: Transformer Engine's if installed, else SDPA) | sdpa | local
#   SAVE, LOAD     checkpoint directories (Megatron's --save / --load); SAVE_INTERVAL default 100
#   EXTRA_ARGS     more Megatron flags, appended last (so they override the ones above)
#   DRY_RUN=1      print the command instead of running it
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
# Training needs a GPU. Without one the entry point itself says so and what to run instead: run
# it directly, not under torchrun, so that its message is the last line (no torchrun traceback).
if [[ "${DRY_RUN:-0}" != 1 ]] && ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    exec "$PYTHON" "$REPO/scripts/pretrain_gpt.py"
fi
DISPATCHER=${DISPATCHER:-moeblaze}
NPROC=${NPROC:-1}
SEQ_LEN=${SEQ_LEN:-4096}
MICRO_BATCH=${MICRO_BATCH:-2}
GLOBAL_BATCH=${GLOBAL_BATCH:-$((MICRO_BATCH * NPROC))}
TRAIN_ITERS=${TRAIN_ITERS:-200}
LR=${LR:-3e-4}
LOG_INTERVAL=${LOG_INTERVAL:-10}
DATA=${DATA:-builtin}
ATTENTION=${ATTENTION:-auto}
SAVE_INTERVAL=${SAVE_INTERVAL:-100}

# Every family: a Llama-style block, no dropout, fp32 routing, the built-in corpus's byte-level
# tokenizer (NullTokenizer: ids 0-255 are bytes, 256 ends a document).
COMMON_MODEL_ARGS=(
    --swiglu --normalization RMSNorm --disable-bias-linear
    --position-embedding-type rope --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0 --moe-router-dtype fp32
    --tokenizer-type NullTokenizer --vocab-size 257
)

# Without Transformer Engine Megatron has only its local layers (and TE's fused RoPE is missing).
if "$PYTHON" -c "import transformer_engine" 2>/dev/null; then
    HAVE_TE=1
    IMPL_ARGS=(--transformer-impl transformer_engine)
else
    HAVE_TE=0
    IMPL_ARGS=(
        --transformer-impl local --no-rope-fusion
    )
fi
# Apex, not TE, builds these fused kernels (Megatron imports fused_weight_gradient_mlp_cuda for
# the gradient-accumulation fusion): without Apex they are off, whether or not TE is there.
if "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('fused_weight_gradient_mlp_cuda') is None)" 2>/dev/null; then
    NO_APEX_ARGS=()
else
    NO_APEX_ARGS=(
        --no-persist-layer-norm --no-gradient-accumulation-fusion --no-masked-softmax-fusion
    )
fi

# Megatron's stock MoE with TE as its users run it (STOCK=te): TEGroupedMLP, fused permutation
# (stock only: moeblaze has no permutation), and the fused router (the model's, both dispatchers).
TE_STOCK_EXPERT_ARGS=(
    --moe-grouped-gemm --moe-permute-fusion
)
TE_ROUTER_ARGS=(
    --moe-router-fusion
)
STOCK=${STOCK:-auto}
case "$STOCK" in
    auto) [[ $HAVE_TE == 1 ]] && STOCK=te || STOCK=sequential ;;
    te) [[ $HAVE_TE == 1 ]] || { echo "STOCK=te needs Transformer Engine ($PYTHON cannot import transformer_engine); use STOCK=sequential" >&2; exit 2; } ;;
    sequential) ;;
    *) echo "STOCK must be auto, te or sequential, got '$STOCK'" >&2; exit 2 ;;
esac
MOE_ARGS=()
if [[ $STOCK == te ]]; then
    [[ $DISPATCHER != moeblaze ]] && MOE_ARGS+=("${TE_STOCK_EXPERT_ARGS[@]}")
    MOE_ARGS+=("${TE_ROUTER_ARGS[@]}")
fi

case "$DATA" in
    mock) DATA_ARGS=(--mock-data) ;;
    builtin)
        DATA_PREFIX="$REPO/data/pystdlib_text_document"
        if [[ "${DRY_RUN:-0}" != 1 ]]; then
            "$PYTHON" "$REPO/scripts/prepare_data.py" --output-prefix "$DATA_PREFIX"
        fi
        DATA_ARGS=(--data-path "$DATA_PREFIX" --split 98,1,1) ;;
    *) DATA_ARGS=(--data-path "$DATA" --split 98,1,1) ;;
esac

TRAIN_ARGS=(
    --moe-token-dispatcher-type "$DISPATCHER" --moeblaze-attention "$ATTENTION"
    --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$(awk "BEGIN{print $LR/10}")"
    --lr-decay-style cosine --lr-warmup-iters "$((TRAIN_ITERS / 10))" --weight-decay 0.1
    --clip-grad 1.0 --bf16 --no-create-attention-mask-in-dataloader
    --log-interval "$LOG_INTERVAL" --eval-interval "$TRAIN_ITERS" --eval-iters 10
    --ckpt-format torch_dist
)
[[ -n "${SAVE:-}" ]] && TRAIN_ARGS+=(--save "$SAVE" --save-interval "$SAVE_INTERVAL")
[[ -n "${LOAD:-}" ]] && TRAIN_ARGS+=(--load "$LOAD")
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

COMMAND=(
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$REPO/scripts/pretrain_gpt.py"
    "${MODEL_ARGS[@]}" "${COMMON_MODEL_ARGS[@]}" "${IMPL_ARGS[@]}" ${NO_APEX_ARGS[@]+"${NO_APEX_ARGS[@]}"}
    ${MOE_ARGS[@]+"${MOE_ARGS[@]}"} "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" ${EXTRA[@]+"${EXTRA[@]}"}
)
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${COMMAND[@]}"
    echo
else
    exec "${COMMAND[@]}"
fi
