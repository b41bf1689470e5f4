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
# times the six GEMMs config by config, TUNE_ARGS adds tune_kernels.py flags; "ncu" profiles one
# launch with Nsight Compute (NCU_KERNEL, NCU_OPS, NCU_SHAPE: see the step); LAYER_CONFIGS,
# LAYER_ACTS, LAYER_IMPLS and LAYER_FLAGS (default --profile) shape the layer step; "titan" trains stock torchtitan
# 0.3.0 and the override side by side, scripts/compare_torchtitan.py with TITAN_FLAGS, ~5 minutes,
# torchtitan's wheels in .whl; "ws_ab" takes the layer with dH's activation backward in the
# warp-specialized kernel, MOEBLAZE_WARP_SPECIALIZE=1, against the default, WS_AB_ROUNDS (3)
# alternating rounds of bench_layer on WS_AB_CONFIGS (conf4), WS_AB_ACTS (swiglu,silu), moeblaze
# alone, float64 checks in the first round only); "recipe" runs tests/gpu/test_megatron_recipe_gpu.py (no
# host synchronization in the MoE layer, torch.cuda.graph capture replaying eager's bits, Megatron's
# local CUDA graphs over the whole layer, the MoE layer and the router scopes, the shared-expert
# overlap's timeline; figures in recipe_gpu.json); "revisions" runs scripts/compare_revisions.py between
# REVISIONS_OLD (default .old_rev: another revision's files, e.g. `git archive REV moeblaze_megatron |
# tar x -C .old_rev`, git-ignored, carried) and this checkout on REVISIONS_CONFIGS; "fp8" runs
# tests/gpu/test_fp8_gpu.py (the FP8 kernels against the quantized math's reference, determinism, the
# bf16 floor, no host synchronization) and times moeblaze_fp8 against moeblaze on FP8_CONFIGS (every
# config by default), float64 checks first; "sweep" times SWEEP_IMPLS (moeblaze,sonicmoe,grouped_mm)
# over rows per expert (SWEEP_ROWS, 64 to 8192) at the widths of SWEEP_BASES (qwen3 7b), moeblaze
# profiled per kernel. SonicMoE is a peer wherever .whl/sonic_site.tar.xz travels
# (../shared/tools/sonic-peer.sh; carry that file alone). Every step's whole output
# is kept as $out/STEP.log. Results go to $OUT (default benchmarks/results/latest).
#
# Transformer Engine steps (TE must already be in /tmp/site: ../shared/tools/te-device.sh's
# five calls, the last one running `bash .te/install.sh && STEPS=te_check bash scripts/gpu_suite.sh`):
#   te_check    scripts/gpu_megatron_check.py --te: MoEBlaze under the TE layer spec against stock
#               alltoall + TEGroupedMLP (+ fused permutation and router), layer and GPTModel against a
#               float32 local-spec oracle, torch_dist checkpoints both ways, step times (~3 min)
#   te_layer    scripts/bench_layer.py, moeblaze against the te_grouped peer, in bf16 and under the
#               blockwise FP8 recipe (TE_LAYER_CONFIGS, default every config; TE_LAYER_IMPLS, default
#               moeblaze,moeblaze_fp8,te_grouped,te_grouped_fp8; 1 s timed after 0.5 s)
#   te_select   per family of TE_FAMILIES (default "qwen3_moe deepseek_v3"): the stock variants
#               (TE_VARIANTS, default te,te_unfused_router,te_op_fuser and te_shared_overlap where the
#               family has a shared expert) timed TE_VARIANT_STEPS (8) steps each; the fastest is kept in
#               $TE_STATE_DIR/<family>.variant (default /tmp/moeblaze_te) for te_compare on the same
#               warm machine
#   te_compare  per family: compare_dispatchers.py --baseline alltoall_te with that variant (TE_VARIANT
#               overrides; default te), TE_STEPS (500) steps, the control repeating moeblaze
#               (TE_CONTROL), micro-batch search of TE_SEARCH_S (45) s per dispatcher, TE_COMPARE_FLAGS
#               appended; 5.5-6.5 minutes per family on the H200: one per call. The resume check (a TE stock
#               checkpoint resumed under both dispatchers through Megatron's save/load_checkpoint,
#               tiny model, ~1 minute) runs for TE_RESUME_FAMILY only (default none: te_check already
#               moves torch_dist checkpoints both ways)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/latest}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
steps=" ${STEPS:-tests megatron routing layer silu} "
for name in $steps; do
  case $name in
    tests|megatron|recipe|revisions|fp8|routing|ring|tune|ncu|layer|sweep|silu|ws_ab|titan|te_check|te_layer|te_select|te_compare) ;;
    *) echo "gpu_suite: STEPS names '$name'; expected some of: tests megatron recipe revisions fp8 routing ring tune ncu layer sweep" \
         "silu ws_ab titan" \
         "te_check te_layer te_select te_compare"; exit 1 ;;
  esac
done
# The wheels travel with the call (.whl), or an earlier call on this warm machine left them in /tmp/site.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_suite: installing the carried wheels failed"; exit 1; }
elif ! PYTHONPATH=/tmp/site python3 -c "import megatron.core" 2>/dev/null; then
  echo "gpu_suite: no wheels in .whl/ and no megatron-core in /tmp/site: carry .whl (bash ../shared/tools/device-wheels.sh)"
  exit 1
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/.peers${PYTHONPATH:+:$PYTHONPATH}
# SonicMoE and its CUTLASS DSL, xz-packed to fit a call (sonic-peer.sh's header): unpacked once per machine.
if [ -f .whl/sonic_site.tar.xz ] && [ ! -d /tmp/s/site ]; then
  mkdir -p /tmp/s && xz -dc .whl/sonic_site.tar.xz | tar -x -C /tmp/s || echo "gpu_suite: unpacking SonicMoE failed"
fi
[ -d /tmp/s/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/s/site:/tmp/s/site/nvidia_cutlass_dsl/python_packages
if [[ $steps == *" te_"* ]] && ! python3 -c "import transformer_engine.pytorch" 2>/dev/null; then
  echo "gpu_suite: the te_* steps need Transformer Engine in /tmp/site: run ../shared/tools/te-device.sh's five calls first"
  exit 1
fi
# run_step NAME LOG LIMIT LINES COMMAND...: run COMMAND if STEPS names NAME, under a time limit; its
# output goes whole to $out/LOG.log and, warnings left out, its last LINES lines to the console.
run_step() {
  local name=$1 log=$2 limit=$3 lines=$4; shift 4
  [[ $steps == *" $name "* ]] || return 0
  echo "== [$(date +%T)] $*"
  timeout "$limit" "$@" 2>&1 | tee "$out/$log.log" | grep -v -i warn | tail -n "$lines"
  echo "== $log rc=${PIPESTATUS[0]} [$(date +%T)]"
}
# step NAME LIMIT LINES COMMAND...: run_step with the log named after the step.
step() {
  local name=$1; shift
  run_step "$name" "$name" "$@"
}

# A machine still warm from the previous call keeps /tmp: MegaBlocks is built once.
if [ -x .whl/build-megablocks.sh ] && [ ! -d /tmp/mb/megablocks ] \
    && [[ $steps == *" layer "* || $steps == *" silu "* ]]; then
  (bash .whl/build-megablocks.sh > /tmp/megablocks_build.log 2>&1; echo "megablocks build rc=$?" >> /tmp/megablocks_build.log) &
  build=$!
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv,noheader
# shellcheck disable=SC2086  # TESTS_PATHS is a list of paths
step tests "${TESTS_S:-360}" 6 python3 -m pytest ${TESTS_PATHS:-tests/gpu} -q -x -p no:cacheprovider
step megatron "${MEGATRON_S:-120}" 32 python3 scripts/gpu_megatron_check.py --out "$out/gpu_megatron_check.json"
MOEBLAZE_RECIPE_JSON="$out/recipe_gpu.json" step recipe "${RECIPE_S:-240}" 30 python3 -m pytest \
  tests/gpu/test_megatron_recipe_gpu.py -q -p no:cacheprovider -rA
step revisions "${REVISIONS_S:-240}" 12 python3 scripts/compare_revisions.py --old "${REVISIONS_OLD:-.old_rev}" --new . \
  --configs "${REVISIONS_CONFIGS:-7b,qwen3}" --out "$out/compare_revisions.json"
run_step fp8 fp8_tests "${FP8_TESTS_S:-240}" 12 python3 -m pytest tests/gpu/test_fp8_gpu.py -q -p no:cacheprovider -rA
fp8_configs=()
[ -n "${FP8_CONFIGS:-}" ] && fp8_configs=(--configs "$FP8_CONFIGS")
run_step fp8 fp8_layer "${FP8_LAYER_S:-300}" 40 python3 scripts/bench_layer.py --out "$out" --tag bench_layer_fp8 \
  ${fp8_configs[@]+"${fp8_configs[@]}"} --acts swiglu --reps 5 --seconds 1 --warmup-seconds 0.5 --impls moeblaze,moeblaze_fp8
# shellcheck disable=SC2086  # TITAN_FLAGS is a list of flags
step titan "${TITAN_S:-330}" 16 python3 scripts/compare_torchtitan.py --out "$out/compare_torchtitan" ${TITAN_FLAGS:-}
step routing "${ROUTING_S:-60}" 24 python3 scripts/bench_routing.py --quick --out "$out/bench_routing_quick.json"
step ring "${RING_S:-420}" 80 python3 scripts/bench_ring_hop.py --out "$out"
# shellcheck disable=SC2086  # TUNE_ARGS is a list of flags
step tune "${TUNE_S:-200}" 40 python3 scripts/tune_kernels.py --out "$out" --time-limit $(( ${TUNE_S:-200} - 40 )) ${TUNE_ARGS:-}
# Nsight Compute on one launch of the kernels NCU_KERNEL names (a regex, default the warp-specialized
# gather GEMM) while tune_kernels.py times NCU_OPS (dh_ws) at NCU_SHAPE (conf4): warp states and
# per-instruction stall samples, kept as ncu_details.csv and ncu_source.csv (SASS) in $out. The
# launch profiled is the one after the first NCU_SKIP (1) that match: the tuning script launches
# references of its own first (weight_grad: dW1's, then dW2's, then the op's own).
ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
step ncu "${NCU_S:-300}" 12 "${ncu_bin:-ncu}" -f -k "regex:${NCU_KERNEL:-gather_gemm_ws}" -s "${NCU_SKIP:-1}" -c 1 --section SpeedOfLight \
  --section WarpStateStats --section SourceCounters --section SchedulerStats --section MemoryWorkloadAnalysis \
  --section LaunchStats -o "${TMPDIR:-/tmp}/ncu_profile" python3 scripts/tune_kernels.py --shapes "${NCU_SHAPE:-conf4}" \
  --ops "${NCU_OPS:-dh_ws}" --configs none --reps 2 --out /tmp/ncu_tune
if [[ $steps == *" ncu "* ]] && [ -f "${TMPDIR:-/tmp}/ncu_profile.ncu-rep" ]; then
  "$ncu_bin" -i "${TMPDIR:-/tmp}/ncu_profile.ncu-rep" --page details --csv > "$out/ncu_details.csv"
  "$ncu_bin" -i "${TMPDIR:-/tmp}/ncu_profile.ncu-rep" --page source --csv --print-source sass > "$out/ncu_source.csv"
fi
if [ -n "${build:-}" ]; then
  wait "$build"; tail -n 2 /tmp/megablocks_build.log
fi
[ -d /tmp/mb/megablocks ] && export PYTHONPATH=/tmp/mb:$PYTHONPATH
# shellcheck disable=SC2086  # LAYER_FLAGS is a list of flags
step layer "${LAYER_S:-260}" 200 python3 scripts/bench_layer.py --out "$out" --configs "${LAYER_CONFIGS:-qwen3,7b,conf4,dsv3}" \
  --acts "${LAYER_ACTS:-swiglu}" --reps 5 --impls "${LAYER_IMPLS:-moeblaze,grouped_mm,megatron_sequential,megablocks,liger,scattermoe}" \
  ${LAYER_FLAGS---profile}
sweep_configs=""
for base in ${SWEEP_BASES:-qwen3 7b}; do
  for rows in ${SWEEP_ROWS:-64 128 256 512 1024 2048 4096 8192}; do sweep_configs+="${sweep_configs:+,}$base@r$rows"; done
done
step sweep "${SWEEP_S:-420}" 40 python3 scripts/bench_layer.py --out "$out" --tag bench_layer_sweep --configs "$sweep_configs" \
  --acts swiglu --reps 5 --seconds 1 --warmup-seconds 0.5 --impls "${SWEEP_IMPLS:-moeblaze,sonicmoe,grouped_mm}" --profile
step silu "${SILU_S:-30}" 12 python3 scripts/bench_layer.py --out "$out" --tag bench_layer_silu --configs conf4 --acts silu \
  --reps 5 --impls moeblaze,grouped_mm,megatron_sequential,megablocks,scattermoe
for round in $(seq 1 "${WS_AB_ROUNDS:-3}"); do
  check=()
  [ "$round" -gt 1 ] && check=(--no-check)
  for knob in fwd 1; do
    MOEBLAZE_WARP_SPECIALIZE=$knob run_step ws_ab "ws_ab_${knob}_$round" "${WS_AB_S:-90}" 6 python3 scripts/bench_layer.py \
      --out "$out" --tag "bench_layer_ws_${knob}_$round" --configs "${WS_AB_CONFIGS:-conf4}" --acts "${WS_AB_ACTS:-swiglu,silu}" \
      --reps 5 --impls moeblaze ${check[@]+"${check[@]}"}
  done
done

# Transformer Engine: see the header.
step te_check "${TE_CHECK_S:-300}" 40 python3 scripts/gpu_megatron_check.py --te --out "$out/gpu_megatron_check_te.json"
te_layer_configs=()
[ -n "${TE_LAYER_CONFIGS:-}" ] && te_layer_configs=(--configs "$TE_LAYER_CONFIGS")
step te_layer "${TE_LAYER_S:-280}" 40 python3 scripts/bench_layer.py --out "$out" --tag bench_layer_te \
  ${te_layer_configs[@]+"${te_layer_configs[@]}"} --acts swiglu --reps 5 --seconds 1 --warmup-seconds 0.5 \
  --impls "${TE_LAYER_IMPLS:-moeblaze,moeblaze_fp8,te_grouped,te_grouped_fp8}"
te_state=${TE_STATE_DIR:-/tmp/moeblaze_te}
[[ $steps == *" te_"* ]] && mkdir -p "$te_state"
for family in ${TE_FAMILIES:-qwen3_moe deepseek_v3}; do
  variants=${TE_VARIANTS:-te,te_unfused_router,te_op_fuser}
  [[ -z ${TE_VARIANTS:-} && $family == deepseek_v3 ]] && variants+=",te_shared_overlap"
  run_step te_select "te_select_$family" "${TE_SELECT_S:-140}" 12 python3 scripts/compare_dispatchers.py \
    --family "$family" --baseline alltoall_te --stock-variants "$variants" --select-only \
    --variant-steps "${TE_VARIANT_STEPS:-8}" --out "$out/te_select_$family"
  if [ -f "$out/te_select_$family/variants.json" ]; then
    cp "$out/te_select_$family/variants.json" "$out/te_select_$family.json"
    python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['stock_selection']['chosen'])" \
      "$out/te_select_$family.json" > "$te_state/$family.variant"
  fi
  variant=${TE_VARIANT:-$(cat "$te_state/$family.variant" 2>/dev/null)}
  variant=${variant:-te}
  [[ $steps == *" te_compare "* ]] && echo "gpu_suite: $family against the TE stock variant '$variant'"
  # The resume check trains the tiny model whatever the family: once is enough.
  resume=()
  [[ $family != "${TE_RESUME_FAMILY:-}" ]] && resume=(--no-resume-check)
  # shellcheck disable=SC2086  # TE_COMPARE_FLAGS is a list of flags
  run_step te_compare "te_compare_$family" "${TE_COMPARE_S:-570}" 30 python3 scripts/compare_dispatchers.py \
    --family "$family" --baseline alltoall_te --stock-variants "$variant" --steps "${TE_STEPS:-500}" --warmup 10 \
    --control "${TE_CONTROL:-candidate}" --search micro-batch --search-time-limit "${TE_SEARCH_S:-45}" \
    ${resume[@]+"${resume[@]}"} --out "$out/te_compare_$family" ${TE_COMPARE_FLAGS:-}
  [ -f "$out/te_compare_$family/compare.json" ] && cp "$out/te_compare_$family/compare.json" "$out/te_compare_$family.json"
done

# The device tool brings back at most 8 files: one archive of everything, and the top-level JSON records.
tar czf /tmp/results.tar.gz -C "$out" . && mv /tmp/results.tar.gz "$out/"
find "$out" -mindepth 2 -type f -delete && find "$out" -mindepth 1 -type d -empty -delete
find "$out" -type f ! -name '*.json' ! -name results.tar.gz -delete
echo "gpu_suite: done; results in $out"
