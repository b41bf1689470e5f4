"""Shared code of the benchmark and check scripts: each script in scripts/ parses its command line
and calls in here. ``python scripts/x.py`` puts scripts/ on sys.path, so ``import benchlib``
works with no path edits; the package itself comes from ``pip install -e .`` (or PYTHONPATH).

shapes               the layer shapes (CONFIGS, ALIASES), one layer's random inputs, FLOPs, memory floor
baselines            every implementation of one MoE layer (moeblaze and its peers), IMPL_CLASSES
accuracy             rel_err, one implementation against the float64 reference
timing               clocks: CUDA events (idle or queued behind a spin), dense matmul rate
nvml                 the GPU's power, clock and energy counter through NVML (a sampler, a window over steps)
profiling            CUDA time per kernel, idle gaps, cProfile, matrix instructions, compile times
layer_bench          one layer's times and memory per implementation (bench_layer)
layer_report         bench_layer's markdown table and chart
combine_bench        the combine kernel's variants against the torch ops they replace (bench_combine)
kernel_tuning        every expert-GEMM launch timed config by config (tune_kernels)
routing_bench        the routing plan's build time against stock index computations (bench_routing)
megatron_models      a Megatron world with the plugin, and the MoE layer and GPTModel built from its specs
megatron_checks      MoEBlaze against stock and a float32 oracle, layer and GPTModel, step times (gpu_megatron_check)
te_layouts           state-dict names of the TE layer spec against the local one, sharded checkpoint layouts
te_checks            the same checks under the Transformer Engine layer spec (gpu_megatron_check --te)
ep_bench             expert parallelism under torchrun (bench_expert_parallel)
ep_memory            the per-rank memory and ring-overlap model of one MoE layer (ep_memory_model)
ring_hop             one hop of the expert-parallel ring measured on one GPU (bench_ring_hop)
memory_search        the largest micro-batch or sequence that fits a memory budget
comparison           what both training comparisons share: progress, step records, ratios, the loss check, the plot
dispatcher_compare   stock Megatron against MoEBlaze training runs, argument checks, stock variants, resume
                     check (compare_dispatchers)
dispatcher_report    compare_dispatchers' report.md
titan_compare        stock torchtitan against the override, one GPU or the CPU (compare_torchtitan)
pretrain_hooks       the hooks Megatron's pretrain() calls for a GPT model (pretrain_gpt)

Nothing is imported here: each module is imported on its own (routing_bench must stay free of
the package until the caller has chosen TRITON_INTERPRET).
"""
