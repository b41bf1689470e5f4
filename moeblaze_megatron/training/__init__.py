"""Training aids around the plugin, never imported by the op or the Megatron adapter.

pretraining: the pieces of the ``scripts/pretrain_gpt.py`` entry point (arguments, model and data
builders, the loss); train_loop: a minimal Megatron training loop that trains several dispatchers
side by side; families: the model families' Megatron flags; attention: an SDPA attention core
for Megatron's local layers; corpus: the built-in byte-level corpus; cpu_shims: Megatron on the
CPU with gloo (tests, the CPU demo); audit: bytes saved for backward; named_grads: MoEBlaze
gradients in SequentialMLP's layout.
"""
