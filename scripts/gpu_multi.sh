#!/usr/bin/env bash
# Expert parallelism on one multi-GPU machine in one call: scripts/bench_expert_parallel.py under
# torchrun at EP = 2, 4 and 8 (one process per GPU, EP = world size), as many as the GPUs allow.
# The device machine has torch and Triton but no megatron-core: from the repository root, once,
#
#   bash ../shared/tools/device-wheels.sh        # megatron-core's wheel (and the others) into .whl/
#
# then on the GPU machine, carrying .whl:   bash scripts/gpu_multi.sh
# Settings (environment): EPS (default "2 4 8"; those above the GPU count are skipped), TOTAL_S
# (seconds for all runs, default 560: one 10-minute call), EP_S (seconds per run, default TOTAL_S
# shared equally), SEARCH_S (seconds of the longest-sequence search per dispatcher, default EP_S/6;
# 0 skips it), EXTRA (more bench_expert_parallel.py flags). A run stopped by its limit keeps, in
# its JSON, the parts it finished.
# Results go to $OUT (default benchmarks/results/expert_parallel): ep{N}.json and ep{N}.log.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/expert_parallel}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# NVLink multicast can put the shared host's GPUs out of service: off in NCCL, PyTorch and NVSHMEM
# (bench_expert_parallel.py sets the same defaults; exported here for every process torchrun starts).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Expert parallelism needs two GPUs at least: say so before anything is installed or launched.
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -lt 2 ]; then
  echo "gpu_multi: expert parallelism on GPUs needs 2 or more, and this machine has $gpus; on the CPU:" \
    "torchrun --nproc-per-node 2 scripts/bench_expert_parallel.py --device cpu --shape tiny --out DIR"
  exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gpu_multi: installing the carried wheels failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi --query-gpu=index,name,clocks.sm,memory.used --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -n $((gpus + 1))
eps=""
for ep in ${EPS:-2 4 8}; do
  if [ "$ep" -gt "$gpus" ]; then echo "== EP=$ep skipped: $gpus GPUs"; else eps="$eps $ep"; fi
done
[ -n "$eps" ] || { echo "gpu_multi: no EP in '${EPS:-2 4 8}' fits $gpus GPUs"; exit 1; }
runs=$(echo $eps | wc -w)
ep_s=${EP_S:-$(( ${TOTAL_S:-560} / runs ))}
search_s=${SEARCH_S:-$(( ep_s / 6 ))}
status=0
for ep in $eps; do
  echo "== [$(date +%T)] EP=$ep"
  # shellcheck disable=SC2086  # EXTRA is a list of flags
  timeout "$ep_s" python3 -m torch.distributed.run --standalone --nproc-per-node "$ep" \
    scripts/bench_expert_parallel.py --out "$out" --search-seconds "$search_s" ${EXTRA:-} 2>&1 \
    | grep -v -i warn | tee "$out/ep$ep.log"
  rc=${PIPESTATUS[0]}
  echo "== rc=$rc [$(date +%T)]"
  [ "$rc" -eq 0 ] || status=1
done
echo "gpu_multi: done; results in $out"
exit $status
