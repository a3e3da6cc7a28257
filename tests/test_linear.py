"""Matrix products on oneDNN with packed weights (models/linear.py): the numbers of the
definition, the packed path really taken by a loaded model, and the same logits without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.baselines.naive import CausalAttention
from minivllm.models.linear import Linear, linear, pack_weight, uses_onednn
from minivllm.models.loader import load_model

# Tolerances against a float64 product: float32 accumulates in float32; bfloat16 accumulates
# in float32 and rounds the result to 8 significant bits.
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 1e-4)}


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 70),
    in_features=st.integers(1, 80),
    out_features=st.integers(1, 90),
    with_bias=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_linear_is_x_times_weight_transposed_plus_bias(
    rows, in_features, out_features, with_bias, dtype, seed
):
    generator = torch.Generator().manual_seed(seed)
    x, weight, bias = (
        torch.randn(*shape, generator=generator).to(dtype)
        for shape in ((rows, in_features), (out_features, in_features), (out_features,))
    )
    bias = bias if with_bias else None
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    rtol, atol = TOLERANCE[dtype]
    for packed in (None, pack_weight(weight)):
        result = linear(x, weight, bias, packed_weight=packed)
        assert result.dtype == dtype and result.shape == (rows, out_features)
        torch.testing.assert_close(result.double(), exact, rtol=rtol, atol=atol)


def test_float16_and_other_devices_keep_pytorchs_product():
    x, weight = torch.randn(3, 8, dtype=torch.float16), torch.randn(5, 8, dtype=torch.float16)
    assert not uses_onednn(x) and pack_weight(weight) is None
    assert torch.equal(linear(x, weight), F.linear(x, weight))


@pytest.mark.skipif(not uses_onednn(torch.zeros(1)), reason="this PyTorch build has no oneDNN")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_loaded_model_runs_on_packed_weights_with_the_same_logits(tiny_model_dirs, family):
    """load_model packs every linear layer and the LM head (the embedding when tied) and keeps
    one copy: a packed layer's `weight` is a placeholder of the same shape and dtype over one
    number. The logits are transformers' (plain weights, PyTorch's product), to float32
    rounding."""
    from transformers import AutoModelForCausalLM

    model = load_model(tiny_model_dirs[family])
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None for m in linears)
    assert model.logits_layer.packed_weight is not None
    assert (model.model.embed_tokens.packed_weight is not None) == (model.lm_head is None)
    packed_only = linears + ([] if model.lm_head is None else [model.lm_head])
    for module in packed_only:
        assert module.weight.untyped_storage().nbytes() == module.weight.element_size()
        assert module.weight.stride() == (0, 0) and module.weight.isnan().all()
    # The table a lookup reads stays whole.
    embedding = model.model.embed_tokens.weight
    assert embedding.untyped_storage().nbytes() == embedding.numel() * embedding.element_size()

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[family]).eval()
    tokens = torch.arange(1, 12)
    with torch.inference_mode():
        hidden = model(tokens, torch.arange(len(tokens)), CausalAttention([0, len(tokens)]))
        packed = model.compute_logits(hidden)
        plain = hf_model(tokens[None]).logits[0]
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)
