"""A Megatron ``core_attention`` module on ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` materializes the [b, np, sq, sk] score matrix; in a
full-model run that, not the MoE layers, would dominate memory and time. ``SDPAttention`` is a
drop-in for the ``core_attention`` submodule of Megatron's layer specs (same constructor, same
[s, b, np, hn] inputs and [sq, b, np * hn] output) that lets torch pick its flash or
memory-efficient kernels, so stock and MoEBlaze runs compare on the same, fast attention.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

# Choices of the entry points' --moeblaze-attention flag. 'auto': Transformer Engine's fused
# attention where the spec already uses TE, SDPA otherwise; 'local': Megatron's DotProductAttention.
ATTENTION_CHOICES = ("auto", "sdpa", "local")

_CAUSAL_TYPES = (AttnMaskType.causal,)
_MASKED_TYPES = (AttnMaskType.padding, AttnMaskType.arbitrary)


class SDPAttention(MegatronModule):
    """Scaled dot-product attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Mask semantics follow Transformer Engine's: a causal mask type implies the causal mask and
    ignores ``attention_mask`` (so the flash kernel can run); ``padding``/``arbitrary`` use
    ``attention_mask`` (bool, True = masked out, Megatron's convention); ``no_mask`` uses none.
    A query row whose keys are all masked gives zeros (Megatron's core gives the mean of the values).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                f"SDPAttention needs context_parallel_size == 1, got {config.context_parallel_size}; "
                "use Transformer Engine's attention for context parallelism"
            )
        if config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention supports softmax_type 'vanilla' only, got {config.softmax_type!r}")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError(f"SDPAttention does not support sliding-window attention (window_size={config.window_size})")
        if attn_mask_type not in _CAUSAL_TYPES + _MASKED_TYPES + (AttnMaskType.no_mask,):
            raise ValueError(f"SDPAttention does not support attn_mask_type {attn_mask_type.name}")

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies the
        # fp32 scores back by it: the same logits, so SDPA takes the plain scale.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn(v)] -> context [sq, b, np * hn(v)]."""
        if packed_seq_params is not None:
            raise ValueError("SDPAttention does not support packed sequences; use Transformer Engine's attention")
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        is_causal = mask_type in _CAUSAL_TYPES
        sdpa_mask = None
        if mask_type in _MASKED_TYPES and attention_mask is not None:
            sdpa_mask = ~attention_mask
        if is_causal and query.shape[0] != key.shape[0]:
            raise ValueError(
                f"a causal mask needs as many queries as keys, got {query.shape[0]} and {key.shape[0]}"
            )

        # [s, b, heads, hn] -> [b, heads, s, hn]: views; SDPA only needs a unit last-dim stride.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        # Heads are split over tensor-parallel ranks: draw dropout from the model-parallel RNG
        # stream, as Megatron's attention does, so that ranks drop different elements.
        forked = dropout_p > 0.0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if forked else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=sdpa_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1],
            )
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], -1)


def with_core_attention(spec, core_attention):
    """A copy of a GPT layer spec or decoder block spec with every layer's core_attention replaced.

    Accepts what Megatron's spec builders return: a TransformerLayer ``ModuleSpec``, a list of
    them, or ``TransformerBlockSubmodules``. The input is not modified (Megatron shares submodule
    objects between layer specs).
    """
    spec = copy.deepcopy(spec)
    if isinstance(spec, TransformerBlockSubmodules):
        layers = spec.layer_specs
    elif isinstance(spec, list):
        layers = spec
    else:
        layers = [spec]
    for layer in layers:
        attention = getattr(getattr(layer, "submodules", None), "self_attention", None)
        if attention is None or not hasattr(getattr(attention, "submodules", None), "core_attention"):
            raise TypeError(f"expected a transformer layer spec with self_attention.submodules.core_attention, got {layer!r}")
        attention.submodules.core_attention = core_attention
    return spec
