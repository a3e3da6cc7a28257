"""Chapter 12 checks: weight-only quantization computes the model its quantized weights define.

The schemes are checked against their definitions (every weight within half a step of its
level, the levels each row or group spans), each kernel's product against the product with its
dequantized weight, the Q4_1 reader against the gguf library's own dequantization of the
embedded model's file, and the engines: a quantized engine's greedy tokens are transformers'
greedy tokens on the model whose weights are the dequantized ones.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ENGINE_TEST_FAMILY, EOS_TOKEN_ID, hf_generate
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.models import quantization as q
from minivllm.models.loader import embedded_gguf_path, load_model

DTYPES = (torch.float32, torch.bfloat16)


@st.composite
def weights(draw, group_sizes=(32, 64)):
    """A weight [N, K] whose rows hold whole groups, with rows of very different ranges (and
    sometimes a constant group), and its group size."""
    group_size = draw(st.sampled_from(group_sizes))
    rows = draw(st.sampled_from([1, 5, 16, 32, 48]))
    columns = group_size * draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator)
    weight *= torch.logspace(-3, 1, rows)[torch.randperm(rows, generator=generator)][:, None]
    if draw(st.booleans()):
        weight[0, :group_size] = draw(st.floats(-2, 2))  # a constant group
    return weight, group_size


@settings(max_examples=40, deadline=None)
@given(case=weights())
def test_int8_levels_are_the_rows_range_in_127_steps(case):
    weight, _ = case
    values, scale = q.quantize_int8(weight)
    assert values.dtype == torch.int8 and values.abs().max() <= 127
    # Each row's largest magnitude maps to +-127: the scale is per row, not per tensor.
    largest = weight.abs().amax(dim=1)
    torch.testing.assert_close(scale[largest > 0], largest[largest > 0] / 127)
    error = (q.dequantize_int8(values, scale) - weight).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-5)).all()


@settings(max_examples=40, deadline=None)
@given(case=weights())
def test_int4_levels_span_each_groups_range_in_15_steps(case):
    weight, group_size = case
    values, scale, minimum = q.quantize_int4(weight, group_size)
    rows, columns = weight.shape
    groups = weight.reshape(rows, columns // group_size, group_size)
    assert values.dtype == torch.uint8 and values.max() <= 15
    torch.testing.assert_close(minimum, groups.amin(dim=-1))
    spread = groups.amax(dim=-1) - groups.amin(dim=-1)
    torch.testing.assert_close(scale[spread > 0], spread[spread > 0] / 15)
    back = q.dequantize_int4(values, scale, minimum, group_size)
    error = (back - weight).reshape(groups.shape).abs()
    assert (error <= scale[..., None] / 2 * (1 + 1e-5) + 1e-6).all()
    # The ends of every group's range are levels: its minimum and maximum come back exactly.
    torch.testing.assert_close(back.reshape(groups.shape).amax(-1), groups.amax(-1))


@settings(max_examples=30, deadline=None)
@given(
    case=weights(),
    num_rows=st.sampled_from([1, 3, 17]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 100),
)
def test_quantized_products_are_products_with_the_dequantized_weight(case, num_rows, dtype, seed):
    """Each kernel (CPU int8, CPU int4) against x @ dequantized_weight.T in float64, within
    the rounding of the activations' dtype."""
    weight, group_size = case
    x = torch.randn(num_rows, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    x = x.to(dtype)
    int8 = q.Int8Weight.from_float(weight.to(dtype))
    int4 = q.Int4Weight.from_float(weight.to(dtype), group_size)
    rows_fit = weight.shape[0] % 16 == 0  # the CPU kernel's packing tiles rows by 16
    assert int4.kernel == (
        "aten._weight_int4pack_mm_for_cpu" if rows_fit else "dequantize + F.linear (reference)"
    )
    expected8 = x.double() @ q.dequantize_int8(*q.quantize_int8(weight.to(dtype))).double().T
    expected4 = (
        x.double()
        @ q.dequantize_int4(*q.quantize_int4(weight.to(dtype), group_size), group_size).double().T
    )
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for weight_object, expected in ((int8, expected8), (int4, expected4)):
        out = weight_object.matmul(x)
        assert out.dtype == dtype and out.shape == (num_rows, weight.shape[0])
        scale = expected.abs().max().item() + 1
        torch.testing.assert_close(out.double() / scale, expected / scale, **tolerance)


def test_int4_reference_path_where_no_kernel_fits():
    """A layout the kernels do not take (float16 on CUDA, or any device without one) falls
    back to multiplying by the dequantized weight; it is named as such."""
    layout = q.int4_layout(torch.Size([64, 128]), 32, torch.float16, torch.device("cuda"))
    assert layout.kernel == "reference"
    assert q.int4_layout(torch.Size([64, 128]), 32, torch.bfloat16, "cuda").kernel == "cuda"
    assert q.int4_layout(torch.Size([60, 128]), 32, torch.bfloat16, "cuda").kernel == "reference"


def test_the_q4_1_reader_gives_the_files_own_weights(embedded_dir):
    """Unpacked blocks, dequantized by the scheme's formula, equal the gguf library's
    dequantization of the same tensors; after undoing llama.cpp's row permutation, they equal
    the converted checkpoint's float weights (which transformers dequantized)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    reader = GGUFReader(str(embedded_gguf_path()))
    for tensor in reader.tensors[:12]:
        if tensor.tensor_type.name != "Q4_1":
            continue
        values, scale, minimum = q.unpack_q4_1(torch.from_numpy(tensor.data.copy()))
        expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        assert torch.equal(q.dequantize_int4(values, scale, minimum, 32), expected), tensor.name
    file_weights = q.read_q4_1_linear_weights(embedded_gguf_path(), num_heads=9, num_kv_heads=3)
    assert len(file_weights) == 30 * 7  # 30 layers of q, k, v, o, gate, up, down
    with safe_open(str(embedded_dir / "model.safetensors"), "pt") as checkpoint:
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                     "model.layers.29.mlp.down_proj.weight"):  # fmt: skip
            dequantized = q.dequantize_int4(*file_weights[name], 32)
            assert torch.equal(dequantized, checkpoint.get_tensor(name)), name


def dequantized_hf_model(path, method: str):
    """transformers' model of `path` with every weight our quantizer would store replaced by
    its dequantized value: the model a quantized engine must compute."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() != 2:
                continue  # norms stay float
            is_table = "embed_tokens" in name or "lm_head" in name
            if is_table or method == "int8":
                parameter.copy_(q.dequantize_int8(*q.quantize_int8(parameter)))
            else:
                parameter.copy_(q.dequantize_int4(*q.quantize_int4(parameter, 32), 32))
    return model


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_engine_computes_the_dequantized_model(tiny_model_dirs, chat_prompts, method):
    """Greedy tokens of LLM(quantization=...) equal transformers' greedy tokens on the model
    whose weights are the dequantized ones (linear layers in the scheme, the embedding in
    int8), batched, with chunked prefill."""
    path = tiny_model_dirs[ENGINE_TEST_FAMILY]
    reference = dequantized_hf_model(path, method)
    llm = LLM(
        model=str(path), quantization=method, max_num_batched_tokens=32, max_num_seqs=4,
        kv_cache_memory_bytes=2**22,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[EOS_TOKEN_ID])
    outputs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params)
    for prompt, output in zip(chat_prompts, outputs):
        expected = hf_generate(reference, prompt, 12, EOS_TOKEN_ID)
        assert list(output.outputs[0].token_ids) == expected


def test_a_quantized_model_keeps_one_copy_of_each_weight(tiny_model_dirs):
    """No linear layer keeps its float weight (nor oneDNN's packed copy) beside the quantized
    one; the embedding table is int8 and serves as the LM head (tied)."""
    model = load_model(tiny_model_dirs[ENGINE_TEST_FAMILY], quantization="int4")
    from minivllm.models.linear import Linear

    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(m.weight is None and m.packed_weight is None for m in layers)
    assert all(isinstance(m.quantized, q.Int4Weight) for m in layers)
    table = model.model.embed_tokens
    assert table.weight is None and isinstance(table.quantized, q.Int8Weight)
    assert all(p.dim() == 1 for p in model.parameters())  # what is left: the norms


def test_gguf_runs_the_embedded_files_own_blocks(embedded_dir):
    """quantization="gguf" on the embedded model: every linear layer holds the file's Q4_1
    blocks (dequantized, the converted checkpoint's weights exactly), in groups of 32."""
    from safetensors import safe_open

    model = load_model(embedded_dir, quantization="gguf")
    attention = model.model.layers[0].self_attn
    mlp = model.model.layers[5].mlp
    with safe_open(str(embedded_dir / "model.safetensors"), "pt") as checkpoint:
        down = checkpoint.get_tensor("model.layers.5.mlp.down_proj.weight")
        qkv = torch.cat([checkpoint.get_tensor(f"model.layers.0.self_attn.{n}_proj.weight")
                         for n in ("q", "k", "v")])  # fmt: skip
    for layer, weight in ((mlp.down_proj, down), (attention.qkv_proj, qkv)):
        assert layer.quantized.group_size == 32
        x = torch.eye(weight.shape[1])  # the product with the identity: the weight itself
        torch.testing.assert_close(layer.quantized.matmul(x).T, weight, rtol=0, atol=2e-6)


def test_an_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        LLM(quantization="int3")
