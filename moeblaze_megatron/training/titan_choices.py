"""The choice lists of a torchtitan training run (``titan_loop.TitanRun``, ``titan_models``),
declared here without importing torchtitan, so that command lines can offer them before
torchtitan is importable (on torch 2.11 only after compare_torchtitan's stand-in is in place)."""

from __future__ import annotations

__all__ = ["ACTIVATION_CHECKPOINTS", "ATTENTIONS", "COMPILES", "LOSSES"]

ATTENTIONS = ("flex", "sdpa")
ACTIVATION_CHECKPOINTS = ("none", "selective", "full")
# "chunked": torchtitan's Qwen3 configs' ChunkedLossWrapper (lm_head and the loss applied chunk by
# chunk); "plain": CrossEntropyLoss over the model's whole logits, torchtitan's other loss config.
LOSSES = ("chunked", "plain")
# torch.compile of each transformer block and the loss, as torchtitan's --compile.enable (with
# --compile.components model,loss) applies it: "off", or the --compile.backend to use.
COMPILES = ("off", "inductor", "aot_eager")
