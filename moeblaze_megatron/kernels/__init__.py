"""Triton kernels and their launchers; nothing here imports the rest of the package.

plan_three_step, plan_sort: the routing-plan builds; gather_gemm (and its warp-specialized twin
gather_gemm_ws), weight_grad: the expert GEMMs; fp8 (with fp8_formats): the same GEMMs under the
blockwise FP8 recipe, and the row quantization;
combine: the per-token reduction; configs: tiles, pruning, what TMA can take; launch: direct
launches; numerics: the interpreter's bf16 workarounds; settings: environment settings, read once; tuning:
fixed-config launches and the autotuner's picks (benchmarks and tests only).
"""
