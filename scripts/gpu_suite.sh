#!/usr/bin/env bash
# Every GPU check and measurement of the project in one call on one H200 (the device machine has
# torch, Triton and matplotlib, no network, no megatron-core). From the repository root:
#
#   bash ../shared/tools/device-wheels.sh                 # megatron-core wheel into .whl/ (once)
#   PYTHON=.venv/bin/python bash ../shared/tools/megablocks-peer.sh   # MegaBlocks sources (once)
#   (liger-kernel wheel into .whl/, ScatterMoE's package into .peers/: optional peers)
#   then on the GPU machine, carrying .whl and .peers:   bash scripts/gpu_suite.sh
#
# Steps, each under its own time limit so the whole fits one 10-minute call: MegaBlocks builds in
# the background (about 3 minutes of CPU) while the GPU tests and the Megatron check run; then the
# layer benchmark, with every peer that imports. Results go to $OUT (default
# benchmarks/results/latest), packed into one results.tar.gz besides.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/latest}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gpu_suite: installing the carried wheels failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/.peers${PYTHONPATH:+:$PYTHONPATH}
step() { local limit=$1; shift; echo "== [$(date +%T)] $*"; timeout "$limit" "$@"; echo "== rc=$? ($*)"; }

if [ -x .whl/build-megablocks.sh ]; then
  (bash .whl/build-megablocks.sh > "$out/megablocks_build.log" 2>&1; echo "megablocks build rc=$?" >> "$out/megablocks_build.log") &
  build=$!
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv
step 120 python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -n 8
step ${MEGATRON_CHECK_S:-120} python3 scripts/gpu_megatron_check.py --out "$out" 2>&1 | grep -v -i warn | tail -n 30
if [ -n "${build:-}" ]; then
  wait "$build"; tail -n 2 "$out/megablocks_build.log"
  export PYTHONPATH=/tmp/mb:$PYTHONPATH
fi
step ${BENCH_LAYER_S:-360} python3 scripts/bench_layer.py --out "$out" ${BENCH_LAYER_ARGS:-} 2>&1 | grep -v -i warn
tar czf "$out/results.tar.gz" -C "$out" --exclude results.tar.gz . 2>/dev/null
echo "gpu_suite: done; results in $out"
