"""Shared code of the benchmark and check scripts: each script in scripts/ parses its command line
and calls in here. ``python scripts/x.py`` puts scripts/ on sys.path, so ``import benchlib``
works with no path edits; the package itself comes from ``pip install -e .`` (or PYTHONPATH).

shapes               the layer shapes (CONFIGS, ALIASES), one layer's random inputs, FLOPs, memory floor
baselines            every implementation of one MoE layer (moeblaze and its peers), IMPL_CLASSES
accuracy             rel_err, one implementation against the float64 reference
timing               clocks: CUDA events (idle or queued behind a spin), dense matmul rate
layer_bench          one layer's times and memory per implementation, the bench_layer run
layer_report         bench_layer's markdown table and chart
profiling            CUDA time per kernel, idle gaps, cProfile, matrix instructions, compile times
combine_bench        the combine kernel's variants against the torch ops they replace
kernel_tuning        every expert-GEMM launch timed config by config (tune_kernels)
nvml                 the GPU's power, clock and energy counter through NVML (a sampler, a window over steps)
routing_bench        the routing plan's build time against stock index computations (bench_routing)
megatron_checks      Megatron world, layer and GPTModel builders, equivalence against fp32, step times
ep_bench             expert parallelism under torchrun (bench_expert_parallel)
memory_search        the largest micro-batch or sequence that fits a memory budget
dispatcher_compare   stock against MoEBlaze training runs, loss check, resume check (compare_dispatchers)
titan_compare        stock torchtitan against the override, one GPU or the CPU (compare_torchtitan)
pretrain_hooks       the hooks Megatron's pretrain() calls for a GPT model (pretrain_gpt)

Nothing is imported here: each module is imported on its own (routing_bench must stay free of
the package until the caller has chosen TRITON_INTERPRET).
"""
