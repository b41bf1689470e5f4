#!/usr/bin/env bash
# Megatron's --save / --load with scripts/pretrain_gpt.py, across dispatchers (needs a GPU):
#   1. the stock dispatcher trains 20 iterations without interruption;
#   2. the stock dispatcher trains again, saves at iteration 10 and exits (--exit-interval 10);
#   3. that checkpoint is loaded under each dispatcher and trained to iteration 20.
# Iterations 11-20 must log the uninterrupted run's losses to within 4 bf16 roundoffs
# (4 * 2^-8 ~ 1.6%, relative): bf16 training on a GPU is not bitwise reproducible even under one
# dispatcher (atomic adds in the stock unpermute), while a resume that lost the data position,
# the weights or the learning-rate schedule misses by far more. (The CPU tests check the same
# resume bitwise.)
# A small Qwen3-MoE-like model (2 layers, 16 experts) keeps it to a few minutes.
#   bash examples/resume_check.sh          # BASELINE=alltoall by default
# With Transformer Engine the stock runs use TEGroupedMLP (STOCK=te, examples/common.sh), so the
# checkpoint moves from TEGroupedMLP to MoEBlaze; STOCK=sequential keeps SequentialMLP.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
BASELINE=${BASELINE:-alltoall}
# Without a GPU the entry point's own message, and nothing after it.
if ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    exec "$PYTHON" "$HERE/../scripts/pretrain_gpt.py"
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

export SEQ_LEN=512 MICRO_BATCH=4 TRAIN_ITERS=20 LOG_INTERVAL=1 SAVE_INTERVAL=10 DATA=${DATA:-builtin}
SMALL="--num-layers 2 --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 4 --kv-channels 64"
SMALL+=" --num-query-groups 2 --num-experts 16 --moe-ffn-hidden-size 128 --eval-iters 0"

run() {  # run NAME DISPATCHER [more env assignments...]: log to $WORK/NAME.log
    local name=$1 dispatcher=$2
    shift 2
    echo "== $name ($dispatcher)"
    env DISPATCHER="$dispatcher" "$@" bash "$HERE/qwen3_moe.sh" >"$WORK/$name.log" 2>&1 \
        || { tail -n 40 "$WORK/$name.log"; echo "FAILED: $name"; exit 1; }
}
run uninterrupted "$BASELINE" EXTRA_ARGS="$SMALL"
run first_half "$BASELINE" SAVE="$WORK/ckpt" EXTRA_ARGS="$SMALL --exit-interval 10"
run resumed_stock "$BASELINE" LOAD="$WORK/ckpt" EXTRA_ARGS="$SMALL"
run resumed_moeblaze moeblaze LOAD="$WORK/ckpt" EXTRA_ARGS="$SMALL"

"$PYTHON" - "$WORK" "$BASELINE" <<'PY'
import re, sys
work, baseline = sys.argv[1], sys.argv[2]
pattern = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")
def losses(name):
    with open(f"{work}/{name}.log") as f:
        return {int(m[1]): float(m[2]) for m in pattern.finditer(f.read())}
reference = losses("uninterrupted")
failed = False
tolerance = 4 * 2**-8
for name, dispatcher in (("resumed_stock", baseline), ("resumed_moeblaze", "moeblaze")):
    got = losses(name)
    steps = [i for i in range(11, 21) if i in reference]
    if sorted(got) != steps or len(steps) != 10:
        print(f"{name}: expected iterations 11-20 after --load, logged {sorted(got)}")
        failed = True
        continue
    worst = max(abs(got[i] - reference[i]) / abs(reference[i]) for i in steps)
    ok = worst <= tolerance
    failed |= not ok
    print(f"{dispatcher} resumed from the {baseline} checkpoint: worst relative loss difference "
          f"{worst:.2e} over iterations 11-20 (tolerance {tolerance:.1e}): {'ok' if ok else 'FAILED'}")
    for i in steps:
        print(f"  iteration {i:2d}: uninterrupted {reference[i]:.6f}  resumed {got[i]:.6f}")
sys.exit(1 if failed else 0)
PY
