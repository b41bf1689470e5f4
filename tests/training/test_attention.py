"""SDPAttention against Megatron's own DotProductAttention, on the CPU.

Same module constructor, same inputs: outputs and gradients of query, key and value must agree
(float64: only the summation order differs; float32 and bfloat16: against a float64 evaluation
of Megatron's module, at the dtype's tolerance), for multi-head, grouped-query and multi-query
attention, causal, padding and no masks, and inside a whole GPTModel.
"""

from __future__ import annotations

import pytest
import torch

from moeblaze_megatron.training.attention import SDPAttention, with_core_attention
from moeblaze_megatron.training.cpu_shims import enable_cpu_megatron
from moeblaze_megatron.training.train_loop import CudaFactoriesOnHost, single_process

# Relative error ||got - want|| / ||want||. float64: summation order only. float32: a few
# roundings (u = 6e-8) through two matmuls of length <= 64 and a softmax: ~1e-6 at most.
# bfloat16: q, k, v are rounded to bf16 before both paths see them, and Megatron's path rounds
# its scores and probabilities to bf16 (u = 2**-9) between the two matmuls; 8 u bounds a few such
# roundings while a wrong mask, head mapping or scale gives errors of order 1.
REL_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 8 * 2.0**-9}


@pytest.fixture(scope="module", autouse=True)
def cpu_world():
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    # Megatron's causal-mask helper allocates with device="cuda": create it on the host.
    with enable_cpu_megatron(), CudaFactoriesOnHost(), single_process(torch.device("cpu")):
        model_parallel_cuda_manual_seed(123)
        yield


def rel_error(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    return ((got - want).norm() / want.norm()).item()


def attention_config(heads, groups, head_dim, dtype=torch.float32, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=head_dim, attention_dropout=0.0, hidden_dropout=0.0, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, masked_softmax_fusion=False, attention_softmax_in_fp32=True,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build(module_class, config, mask_type):
    return module_class(config=config, layer_number=1, attn_mask_type=mask_type, attention_type="self")


def qkv(seq, batch, heads, groups, head_dim, dtype, generator):
    """query [s, b, np, hn], key/value [s, b, ng, hn]: Megatron's layout."""
    shapes = ((seq, batch, heads, head_dim), (seq, batch, groups, head_dim), (seq, batch, groups, head_dim))
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_() for shape in shapes]


def padding_mask(batch, seq, generator):
    """bool [b, 1, s, s], True = masked out (Megatron's convention); every row keeps its diagonal."""
    mask = torch.rand(batch, 1, seq, seq, generator=generator) < 0.4
    mask[..., torch.arange(seq), torch.arange(seq)] = False
    return mask


def run(module, tensors, mask, grad_out):
    out = module(*tensors, mask)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in tensors]


def fresh(tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


MASK_CASES = ["causal", "causal_with_explicit_mask", "padding", "no_mask"]
HEAD_CASES = [(4, 4), (4, 2), (6, 1)]  # multi-head, grouped-query, multi-query


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,groups", HEAD_CASES, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask_case", MASK_CASES)
def test_matches_megatron_dot_product_attention(dtype, heads, groups, mask_case):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    generator = torch.Generator().manual_seed(hash((heads, groups, mask_case)) % 2**31)
    seq, batch, head_dim = 37, 3, 16  # 37: no tile or power-of-two size
    mask_type = {"padding": AttnMaskType.padding, "no_mask": AttnMaskType.no_mask}.get(mask_case, AttnMaskType.causal)
    mask = None
    if mask_case == "padding":
        mask = padding_mask(batch, seq, generator)
    elif mask_case == "causal_with_explicit_mask":
        # What Megatron's GPT dataset builds: SDPA implies it, Megatron's core applies it.
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).expand(batch, 1, seq, seq)
    tensors = qkv(seq, batch, heads, groups, head_dim, dtype, generator)
    grad_out = torch.randn(seq, batch, heads * head_dim, generator=generator, dtype=torch.float64)

    # The oracle: Megatron's module evaluated in float64.
    want_out, want_grads = run(build(DotProductAttention, attention_config(heads, groups, head_dim, torch.float64), mask_type),
                               fresh(tensors, torch.float64), mask, grad_out)
    got_out, got_grads = run(build(SDPAttention, attention_config(heads, groups, head_dim, dtype), mask_type),
                             fresh(tensors), mask, grad_out.to(dtype))
    assert got_out.dtype == dtype and got_out.shape == (seq, batch, heads * head_dim)
    tol = REL_TOL[dtype]
    assert rel_error(got_out, want_out) < tol
    for name, got, want in zip(("query", "key", "value"), got_grads, want_grads):
        assert rel_error(got, want) < tol, f"d{name}"
    if dtype != torch.float64:
        # Megatron's own module in this dtype is held to the same bar: the tolerance is the dtype's.
        local_out, _ = run(build(DotProductAttention, attention_config(heads, groups, head_dim, dtype), mask_type),
                           fresh(tensors), mask, grad_out.to(dtype))
        assert rel_error(local_out, want_out) < tol


def test_causal_mask_is_applied():
    """Changing a later key or value changes no earlier output (the causal mask is real)."""
    from megatron.core.transformer.enums import AttnMaskType

    generator = torch.Generator().manual_seed(7)
    module = build(SDPAttention, attention_config(4, 2, 8), AttnMaskType.causal)
    q, k, v = (t.detach() for t in qkv(10, 2, 4, 2, 8, torch.float32, generator))
    out = module(q, k, v, None)
    k2, v2 = k.clone(), v.clone()
    k2[6:] += 1.0
    v2[6:] -= 1.0
    out2 = module(q, k2, v2, None)
    assert torch.equal(out[:6], out2[:6])
    assert not torch.allclose(out[6:], out2[6:])


def test_dropout_uses_megatron_rng_tracker():
    """Dropout draws from Megatron's model-parallel RNG stream (as Megatron's attention does):
    the default generator is untouched, reseeding the tracker reproduces the mask, successive
    calls differ, and eval mode drops nothing."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnMaskType

    generator = torch.Generator().manual_seed(11)
    q, k, v = (t.detach() for t in qkv(16, 2, 4, 4, 8, torch.float32, generator))
    dropped = build(SDPAttention, attention_config(4, 4, 8, attention_dropout=0.5), AttnMaskType.causal)
    plain = build(SDPAttention, attention_config(4, 4, 8), AttnMaskType.causal)

    model_parallel_cuda_manual_seed(5)
    default_state = torch.get_rng_state()
    first = dropped(q, k, v, None)
    assert torch.equal(torch.get_rng_state(), default_state)
    second = dropped(q, k, v, None)
    assert not torch.equal(first, second)
    model_parallel_cuda_manual_seed(5)
    assert torch.equal(dropped(q, k, v, None), first)
    assert not torch.allclose(first, plain(q, k, v, None))
    dropped.eval()
    torch.testing.assert_close(dropped(q, k, v, None), plain(q, k, v, None), rtol=0, atol=0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(softmax_type="off-by-one"), "softmax_type"),
        (dict(window_size=(4, 0)), "sliding-window"),
    ],
    ids=["softmax_offset", "sliding_window"],
)
def test_refuses_unsupported_config(overrides, message):
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(ValueError, match=message):
        build(SDPAttention, attention_config(4, 4, 8, **overrides), AttnMaskType.causal)


def test_refuses_packed_sequences_and_bias():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    module = build(SDPAttention, attention_config(4, 4, 8), AttnMaskType.causal)
    q, k, v = (t.detach() for t in qkv(8, 1, 4, 4, 8, torch.float32, torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="packed sequences"):
        module(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(ValueError, match="attention_bias"):
        module(q, k, v, None, attention_bias=torch.zeros(1))


def test_with_core_attention_replaces_every_layer_and_copies():
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    config = attention_config(4, 2, 8, num_layers=3, ffn_hidden_size=64, num_moe_experts=4, moe_ffn_hidden_size=16,
                              moe_layer_freq=[0, 1, 1], gated_linear_unit=True, activation_func=F.silu,
                              add_bias_linear=False)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    swapped = with_core_attention(block, SDPAttention)
    assert len(swapped.layer_specs) == 3
    for layer, original in zip(swapped.layer_specs, block.layer_specs):
        assert layer.submodules.self_attention.submodules.core_attention is SDPAttention
        assert original.submodules.self_attention.submodules.core_attention is DotProductAttention
    single = with_core_attention(get_gpt_layer_local_spec(), SDPAttention)
    assert single.submodules.self_attention.submodules.core_attention is SDPAttention
    with pytest.raises(TypeError, match="core_attention"):
        with_core_attention(block.layer_norm, SDPAttention)


def test_gpt_model_with_sdpa_matches_local_attention():
    """A whole GPTModel (GQA, RoPE): the SDPA core changes neither the loss nor any gradient."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    config = attention_config(4, 2, 8, num_layers=2, ffn_hidden_size=64, gated_linear_unit=True,
                              activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
                              use_cpu_initialization=True)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 100, (2, 24), generator=generator)
    position_ids = torch.arange(24).expand(2, -1)
    results = []
    for core in (None, SDPAttention):
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        if core is not None:
            spec = with_core_attention(spec, core)
        model_parallel_cuda_manual_seed(42)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=24,
                         position_embedding_type="rope")
        loss = model(tokens, position_ids, None, labels=tokens.roll(-1, dims=1)).float().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_local, grads_local), (loss_sdpa, grads_sdpa) = results
    assert abs(loss_sdpa.item() - loss_local.item()) < 1e-5 * abs(loss_local.item())
    assert grads_local.keys() == grads_sdpa.keys()
    for name in grads_local:
        assert rel_error(grads_sdpa[name], grads_local[name]) < REL_TOL[torch.float32], name
