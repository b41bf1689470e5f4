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
# Each step has its own time limit (seconds, overridable: NAME_S). Not every step fits one
# 10-minute call together (on a cold machine tests/gpu takes 5-6 minutes, the layer benchmark
# about a minute per config with four implementations): STEPS picks some of them (default:
# "tests megatron routing layer silu"; TESTS_PATHS narrows the tests (default tests/gpu); "ring"
# times one hop of the expert-parallel ring at the memory model's shapes (bench_ring_hop); "tune"
# times the six GEMMs config by config, TUNE_ARGS adds tune_kernels.py flags; LAYER_CONFIGS,
# LAYER_ACTS, LAYER_IMPLS and LAYER_FLAGS (default --profile) shape the layer step; "power" runs
# scripts/power_probe.py --kernels on POWER_CONFIGS and POWER_IMPLS). Every step's whole output
# is kept as $out/STEP.log. Results go to $OUT (default benchmarks/results/latest).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/latest}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
steps=" ${STEPS:-tests megatron routing layer silu} "
for name in $steps; do
  case $name in
    tests|megatron|routing|ring|tune|power|layer|silu) ;;
    *) echo "gpu_suite: STEPS names '$name'; expected some of: tests megatron routing ring tune power layer silu"; exit 1 ;;
  esac
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gpu_suite: installing the carried wheels failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/.peers${PYTHONPATH:+:$PYTHONPATH}
# step NAME LIMIT LINES COMMAND...: run COMMAND if STEPS names it, under a time limit; its output
# goes whole to $out/NAME.log and, warnings left out, its last LINES lines to the console.
step() {
  local name=$1 limit=$2 lines=$3; shift 3
  [[ $steps == *" $name "* ]] || return 0
  echo "== [$(date +%T)] $*"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | grep -v -i warn | tail -n "$lines"
  echo "== $name rc=${PIPESTATUS[0]} [$(date +%T)]"
}

# A machine still warm from the previous call keeps /tmp: MegaBlocks is built once.
if [ -x .whl/build-megablocks.sh ] && [ ! -d /tmp/mb/megablocks ] \
    && [[ $steps == *" layer "* || $steps == *" silu "* || $steps == *" power "* ]]; then
  (bash .whl/build-megablocks.sh > /tmp/megablocks_build.log 2>&1; echo "megablocks build rc=$?" >> /tmp/megablocks_build.log) &
  build=$!
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv,noheader
# shellcheck disable=SC2086  # TESTS_PATHS is a list of paths
step tests "${TESTS_S:-360}" 6 python3 -m pytest ${TESTS_PATHS:-tests/gpu} -q -x -p no:cacheprovider
step megatron "${MEGATRON_S:-120}" 32 python3 scripts/gpu_megatron_check.py --out "$out/gpu_megatron_check.json"
step routing "${ROUTING_S:-60}" 24 python3 scripts/bench_routing.py --quick --out "$out/bench_routing_quick.json"
step ring "${RING_S:-420}" 80 python3 scripts/bench_ring_hop.py --out "$out"
# shellcheck disable=SC2086  # TUNE_ARGS is a list of flags
step tune "${TUNE_S:-200}" 40 python3 scripts/tune_kernels.py --out "$out" --time-limit $(( ${TUNE_S:-200} - 40 )) ${TUNE_ARGS:-}
if [ -n "${build:-}" ]; then
  wait "$build"; tail -n 2 /tmp/megablocks_build.log
fi
[ -d /tmp/mb/megablocks ] && export PYTHONPATH=/tmp/mb:$PYTHONPATH
step power "${POWER_S:-200}" 120 python3 scripts/power_probe.py --out "$out" --kernels --seconds "${POWER_SECONDS:-3}" \
  --configs "${POWER_CONFIGS:-conf4,7b}" --impls "${POWER_IMPLS:-moeblaze,grouped_mm,megablocks}"
# shellcheck disable=SC2086  # LAYER_FLAGS is a list of flags
step layer "${LAYER_S:-260}" 200 python3 scripts/bench_layer.py --out "$out" --configs "${LAYER_CONFIGS:-qwen3,7b,conf4,dsv3}" \
  --acts "${LAYER_ACTS:-swiglu}" --reps 5 --impls "${LAYER_IMPLS:-moeblaze,grouped_mm,megatron_sequential,megablocks,liger,scattermoe}" \
  ${LAYER_FLAGS---profile}
step silu "${SILU_S:-30}" 12 python3 scripts/bench_layer.py --out "$out" --tag bench_layer_silu --configs conf4 --acts silu \
  --reps 5 --impls moeblaze,grouped_mm,megatron_sequential,megablocks,scattermoe
# The device tool brings back at most 8 files: one archive of everything, and the JSON records.
tar czf /tmp/results.tar.gz -C "$out" . && mv /tmp/results.tar.gz "$out/" && find "$out" -type f ! -name '*.json' ! -name results.tar.gz -delete
echo "gpu_suite: done; results in $out"
