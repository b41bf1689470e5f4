#!/usr/bin/env bash
# Every GPU check and measurement of the project in one call on one H200 (the device machine has
# torch, Triton and matplotlib, no network, no megatron-core). From the repository root, once:
#
#   bash ../shared/tools/device-wheels.sh liger-kernel==0.8.5          # wheels into .whl/
#   PYTHON=.venv/bin/python bash ../shared/tools/megablocks-peer.sh    # MegaBlocks sources
#   (optional peer: ScatterMoE's scattermoe/ package copied into .peers/, git-ignored)
#
# then on the GPU machine, carrying .whl and .peers:   bash scripts/gpu_suite.sh
# MegaBlocks builds in the background (about 3 minutes of CPU) while the GPU tests, the Megatron
# check and the routing benchmark run; then the layer benchmark with every peer that imports.
# Each step has its own time limit (seconds, overridable) so the whole fits one 10-minute call.
# Results go to $OUT (default benchmarks/results/latest).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/latest}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gpu_suite: installing the carried wheels failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/.peers${PYTHONPATH:+:$PYTHONPATH}
step() { local limit=$1; shift; echo "== [$(date +%T)] $*"; timeout "$limit" "$@"; echo "== rc=$? [$(date +%T)]"; }

if [ -x .whl/build-megablocks.sh ]; then
  (bash .whl/build-megablocks.sh > /tmp/megablocks_build.log 2>&1; echo "megablocks build rc=$?" >> /tmp/megablocks_build.log) &
  build=$!
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv,noheader
step "${TESTS_S:-90}" python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -n 6
step "${MEGATRON_S:-120}" python3 scripts/gpu_megatron_check.py --out "$out/gpu_megatron_check.json" 2>&1 \
  | grep -v -i warn | tail -n 32
step "${ROUTING_S:-45}" python3 scripts/bench_routing.py --quick --out "$out/bench_routing_quick.json" 2>&1 | tail -n 24
if [ -n "${build:-}" ]; then
  wait "$build"; tail -n 2 /tmp/megablocks_build.log
  export PYTHONPATH=/tmp/mb:$PYTHONPATH
fi
step "${LAYER_S:-260}" python3 scripts/bench_layer.py --out "$out" --configs "${LAYER_CONFIGS:-qwen3,7b,conf4,dsv3}" \
  --acts swiglu --reps 5 --impls moeblaze,grouped_mm,megatron_sequential,megablocks,liger,scattermoe --profile 2>&1 \
  | grep -v -i warn
step "${SILU_S:-30}" python3 scripts/bench_layer.py --out "$out" --tag bench_layer_silu --configs conf4 --acts silu \
  --reps 5 --impls moeblaze,grouped_mm,megatron_sequential,megablocks,scattermoe 2>&1 | grep -v -i warn | tail -n 12
# The device tool brings back at most 8 files: one archive of everything, and the JSON records.
tar czf /tmp/results.tar.gz -C "$out" . && mv /tmp/results.tar.gz "$out/" && find "$out" -type f ! -name '*.json' ! -name results.tar.gz -delete
echo "gpu_suite: done; results in $out"
