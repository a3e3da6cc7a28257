"""Chapter 12 checks: weight-only quantization computes the model its quantized weights define.

The schemes are checked against their definitions (every weight within half a step of its
level, the levels each row or group spans), each kernel's product against the product with its
dequantized weight, the Q4_1 reader against the gguf library's own dequantization of the
embedded model's file, and the engines: a quantized engine's greedy tokens are transformers'
greedy tokens on the model whose weights are the dequantized ones. Then an engine's memory: a
CPU pool is resident only where written, and the metrics say how much that is.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import sys
import weakref
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import ENGINE_TEST_FAMILY, EOS_TOKEN_ID, hf_generate
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from minivllm import LLM, SamplingParams, cpu_kernels
from minivllm.models import quantization as q
from minivllm.models.loader import embedded_gguf_path, load_model

DTYPES = (torch.float32, torch.bfloat16)


# Which CPU products the layers get: minivllm's own (the default, where they build) or PyTorch's
# (where they cannot be built; CUDA's kernels are PyTorch's too).
CPU_KERNELS = ("own", "pytorch")


@contextmanager
def cpu_kernels_of(which: str):
    """Layers and engines made inside use `which` of CPU_KERNELS."""
    if which == "own":
        assert cpu_kernels.load_kernels() is not None, "the C++ CPU kernels did not build"
        yield
        return
    with mock.patch.object(cpu_kernels, "load_kernels", lambda: None):
        yield


# Constants far outside trained weights' ranges: subnormal, below the smallest normal scale,
# and near float32's largest value.
EXTREME_CONSTANTS = (1e-45, -3e-40, 1e-37, 3e38, -3e38)


@st.composite
def weights(draw, group_sizes=(32, 64), extremes: bool = False):
    """A weight [N, K] whose rows hold whole groups, with rows of very different ranges (and
    sometimes a constant group, with `extremes` sometimes of a subnormal or huge value), and
    its group size."""
    group_size = draw(st.sampled_from(group_sizes))
    rows = draw(st.sampled_from([1, 5, 16, 32, 48]))
    columns = group_size * draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator)
    weight *= torch.logspace(-3, 1, rows)[torch.randperm(rows, generator=generator)][:, None]
    if draw(st.booleans()):
        constant = st.floats(-2, 2, width=32)
        if extremes:
            constant = constant | st.sampled_from(EXTREME_CONSTANTS)
        weight[0, :group_size] = draw(constant)  # a constant group
    return weight, group_size


TINY_AND_HUGE_ROWS = torch.tensor([[1e-37] * 32, [-3e-40] * 32, [3e38] + [1.0] * 31])


@settings(max_examples=40, deadline=None)
@given(case=weights(extremes=True))
@example(case=(TINY_AND_HUGE_ROWS, 32))
def test_int8_levels_are_the_rows_range_in_127_steps(case):
    weight, _ = case
    values, scale = q.quantize_int8(weight)
    assert values.dtype == torch.int8 and values.abs().max() <= 127
    # Each row's largest magnitude maps to +-127: the scale is per row, not per tensor. A row
    # too small for a normal float32 scale is stored as zeros (scale 1).
    by_definition = weight.abs().amax(dim=1) / 127
    normal = by_definition >= torch.finfo(torch.float32).tiny
    torch.testing.assert_close(scale[normal], by_definition[normal])
    assert (scale[~normal] == 1).all() and (values[~normal] == 0).all()
    error = (q.dequantize_int8(values, scale) - weight).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-5)).all()


@settings(max_examples=40, deadline=None)
@given(case=weights(extremes=True))
@example(case=(TINY_AND_HUGE_ROWS, 32))
def test_int4_levels_span_each_groups_range_in_15_steps(case):
    weight, group_size = case
    values, scale, minimum = q.quantize_int4(weight, group_size)
    rows, columns = weight.shape
    groups = weight.reshape(rows, columns // group_size, group_size)
    assert values.dtype == torch.uint8 and values.max() <= 15
    torch.testing.assert_close(minimum, groups.amin(dim=-1))
    by_definition = (groups.amax(dim=-1) - groups.amin(dim=-1)) / 15
    normal = by_definition >= torch.finfo(torch.float32).tiny
    torch.testing.assert_close(scale[normal], by_definition[normal])
    # A group too narrow for a normal scale (a constant one) keeps its minimum, q = 0.
    assert (scale[~normal] == 1).all()
    assert (values.reshape(groups.shape)[~normal] == 0).all()
    back = q.dequantize_int4(values, scale, minimum, group_size)
    error = (back - weight).reshape(groups.shape).abs()
    assert (error <= scale[..., None] / 2 * (1 + 1e-5) + 1e-6).all()
    # The ends of every group's range are levels: its minimum and maximum come back exactly.
    torch.testing.assert_close(back.reshape(groups.shape).amax(-1), groups.amax(-1))


@settings(max_examples=40, deadline=None)
@given(
    case=weights(),
    num_rows=st.sampled_from([1, 3, 17]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 100),
    kernels=st.sampled_from(CPU_KERNELS),
)
def test_quantized_products_are_products_with_the_dequantized_weight(
    case, num_rows, dtype, seed, kernels
):
    """Each product on the CPU (int8 and int4; minivllm's kernels in both dtypes, PyTorch's in
    bfloat16, the reference in float32) against x @ dequantized_weight.T in float64, within the
    rounding of the activations' dtype."""
    weight, group_size = case
    x = torch.randn(num_rows, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    x = x.to(dtype)
    with cpu_kernels_of(kernels):
        int8 = q.Int8Weight.from_float(weight.to(dtype))
        int4 = q.Int4Weight.from_float(weight.to(dtype), group_size)
    # minivllm's kernels take any shape of whole 32-weight groups, in both dtypes; without
    # them, PyTorch's serves bfloat16 (its packing tiles rows by 16).
    if kernels == "own":
        assert int4.kernel == "minivllm_cpu.int4_gemv"
    elif weight.shape[0] % 16 == 0 and dtype == torch.bfloat16:
        assert int4.kernel == "aten._weight_int4pack_mm_for_cpu"
    else:
        assert int4.kernel == "dequantize + F.linear (reference)"
    if kernels == "own":
        assert int8.kernel == "minivllm_cpu.int8_gemv"
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
    """A layout the kernels do not take (float16 on CUDA or the CPU, groups that are not whole
    32-weight blocks for minivllm's kernels, float32 or a shape the packing does not tile for
    PyTorch's) falls back to multiplying by the dequantized weight; it is named as such."""

    def kernel(rows: int, group: int, dtype: torch.dtype, device: str) -> str:
        return q.int4_layout(torch.Size([rows, 128]), group, dtype, device).kernel

    for which in CPU_KERNELS:  # CUDA's kernels are PyTorch's either way
        with cpu_kernels_of(which):
            assert kernel(64, 32, torch.float16, "cuda") == "reference"
            assert kernel(64, 32, torch.bfloat16, "cuda") == "cuda"
            assert kernel(60, 32, torch.bfloat16, "cuda") == "reference"
            assert kernel(64, 32, torch.float16, "cpu") == "reference"
    with cpu_kernels_of("own"):
        assert kernel(64, 32, torch.float32, "cpu") == "minivllm"
        assert kernel(64, 32, torch.bfloat16, "cpu") == "minivllm"
        assert kernel(64, 16, torch.bfloat16, "cpu") == "cpu"  # half blocks: PyTorch's
        assert kernel(60, 64, torch.bfloat16, "cpu") == "minivllm"
        assert kernel(60, 16, torch.bfloat16, "cpu") == "reference"
    with cpu_kernels_of("pytorch"):
        assert kernel(64, 32, torch.float32, "cpu") == "reference"
        assert kernel(64, 32, torch.bfloat16, "cpu") == "cpu"
        assert kernel(60, 32, torch.bfloat16, "cpu") == "reference"


@pytest.mark.parametrize(
    "columns, tiles", [(256, 8), (128, 8), (64, 4), (96, 2), (32, 2), (48, None), (40, None)]
)
def test_tinygemms_packing_tiles_k_by_the_most_inner_tiles_that_divide_it(columns, tiles):
    """On CUDA, K is packed in tiles of 16 x inner_k_tiles, the largest of 8, 4 and 2 that
    divides K; a K none divides takes the reference product. (A layout is decided without a
    GPU.)"""
    layout = q.int4_layout(torch.Size([64, columns]), 32, torch.bfloat16, "cuda")
    if tiles is None:
        assert layout == q.Int4Layout("reference")
    else:
        assert layout == q.Int4Layout("cuda", tiles)


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


# --- GGUF files, written the way llama.cpp's converter writes them -----------------------------

HF_TO_GGUF_NAMES = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
}  # fmt: skip


def llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): Hugging Face's q/k row order
    -> the GGUF file's."""
    shaped = rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:])
    return shaped.swapaxes(1, 2).reshape(rows.shape)


def write_q4_1_gguf(model_dir: Path, architecture: str) -> None:
    """A GGUF file beside the checkpoint holding its linear layers in Q4_1, as llama.cpp's
    converter writes them: q and k rows permuted for the "llama" architecture only (its
    LlamaModel permutes, its Qwen2Model does not)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(model_dir / "model.Q4_1.gguf", arch=architecture)
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        parts = name.split(".")
        if parts[-1] != "weight" or parts[-2] not in HF_TO_GGUF_NAMES:
            continue
        rows = tensor.float().numpy()
        if architecture == "llama" and parts[-2] in ("q_proj", "k_proj"):
            heads = "num_attention_heads" if parts[-2] == "q_proj" else "num_key_value_heads"
            rows = llama_cpp_permute(rows, config[heads])
        blocks = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q4_1)
        writer.add_tensor(f"blk.{parts[2]}.{HF_TO_GGUF_NAMES[parts[-2]]}.weight", blocks,
                          raw_dtype=gguf.GGMLQuantizationType.Q4_1)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_model_with_gguf(tiny_model_dirs, family: str, architecture: str, directory: Path) -> Path:
    """A copy of the tiny `family` model with a Q4_1 GGUF file of `architecture` beside it."""
    model_dir = Path(shutil.copytree(tiny_model_dirs[family], directory / family))
    write_q4_1_gguf(model_dir, architecture)
    return model_dir


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gguf_q_and_k_rows_come_back_in_hugging_faces_order(tiny_model_dirs, tmp_path, family):
    """quantization="gguf" undoes llama.cpp's q/k row permutation where its converter made one
    (a Llama file), and only there: a Qwen2 file's rows are read as they are. Either way the q
    and k rows the engine multiplies by are the checkpoint's rows rounded to Q4_1's levels
    (gguf's own quantizer on the rows in Hugging Face's order; Q4_1 rounds each row alone)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file

    model_dir = tiny_model_with_gguf(tiny_model_dirs, family, family, tmp_path)
    model = load_model(model_dir, quantization="gguf")
    qkv = model.model.layers[0].self_attn.qkv_proj.quantized
    loaded = qkv.matmul(torch.eye(qkv.shape[1])).T  # the product with the identity: the weight
    state = load_file(model_dir / "model.safetensors")
    for offset, name in ((0, "q_proj"), (model.config.num_heads * model.config.head_dim, "k_proj")):
        weight = state[f"model.layers.0.self_attn.{name}.weight"]
        levels = dequantize(quantize(weight.numpy(), GGMLQuantizationType.Q4_1),
                            GGMLQuantizationType.Q4_1)  # fmt: skip
        rows = loaded[offset : offset + len(weight)]
        torch.testing.assert_close(rows, torch.from_numpy(levels), rtol=0, atol=2e-6)


def file_scales_and_minimums(gguf_path: Path, names) -> tuple[torch.Tensor, torch.Tensor]:
    """The float16 d and m of the named Q4_1 tensors, as the file's bytes hold them (a block:
    d, m, then 16 bytes of nibbles), the tensors' rows one after the other."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    blocks = [torch.from_numpy(tensors[n].data.copy()) for n in names]
    blocks = torch.cat([b.reshape(b.shape[0], -1, 20) for b in blocks])
    return tuple(blocks[..., i : i + 2].contiguous().view(torch.float16)[..., 0] for i in (0, 2))


def test_gguf_scales_are_the_files_and_rounded_once_for_the_kernel(tiny_model_dirs, tmp_path):
    """The file's float16 scales and minimums are read bit for bit (gate and up, stacked into
    one layer). minivllm's kernel (float32 here) keeps them so, in float16; PyTorch's
    bfloat16 kernel's (scale, zero) is exactly bf16(d) and bf16(m + 8 d), the one rounding
    Int4Weight's docstring names, and nothing else."""
    model_dir = tiny_model_with_gguf(tiny_model_dirs, "llama", "llama", tmp_path)
    gguf_path = model_dir / "model.Q4_1.gguf"
    d, m = file_scales_and_minimums(gguf_path, ["blk.1.ffn_gate.weight", "blk.1.ffn_up.weight"])
    read = q.read_q4_1_linear_weights(gguf_path, num_heads=4, num_kv_heads=2)
    for part, file_part in ((1, d), (2, m)):
        loaded = torch.cat(
            [read[f"model.layers.1.mlp.{n}_proj.weight"][part] for n in ("gate", "up")]
        )
        assert loaded.dtype == torch.float32 and torch.equal(loaded, file_part.float())
        assert torch.equal(loaded.half().view(torch.int16), file_part.view(torch.int16))

    def gate_up(kernels: str, dtype: torch.dtype) -> q.Int4Weight:
        with cpu_kernels_of(kernels):
            model = load_model(model_dir, dtype, quantization="gguf")
        return model.model.layers[1].mlp.gate_up_proj.quantized

    own = gate_up("own", torch.float32)
    assert own.layout.kernel == "minivllm"
    assert own.scale.dtype == own.minimum.dtype == torch.float16
    assert torch.equal(own.scale.view(torch.int16), d.view(torch.int16))
    assert torch.equal(own.minimum.view(torch.int16), m.view(torch.int16))
    weight = gate_up("pytorch", torch.bfloat16)
    assert weight.layout.kernel == "cpu"
    scale, zero = weight.scale_and_zero.unbind(-1)
    assert torch.equal(scale.t(), d.float().bfloat16())
    assert torch.equal(zero.t(), (m.float() + 8 * d.float()).bfloat16())


def test_a_gguf_file_of_an_unknown_architecture_is_refused(tiny_model_dirs, tmp_path):
    """A file whose q/k layout minivllm does not know must not load as a wrong model."""
    model_dir = tiny_model_with_gguf(tiny_model_dirs, "llama", "gemma2", tmp_path)
    with pytest.raises(ValueError) as refused:
        load_model(model_dir, quantization="gguf")
    assert str(refused.value) == (
        f"{model_dir / 'model.Q4_1.gguf'}: GGUF architecture 'gemma2' is not supported by "
        "quantization='gguf'; supported: llama, qwen2, qwen3"
    )


def test_a_gguf_file_without_an_architecture_is_refused():
    """No general.architecture at all: refused the same way, naming None."""
    no_field = mock.Mock(get_field=lambda name: None)
    with pytest.raises(ValueError, match=r"^f.gguf: GGUF architecture None is not supported"):
        q.gguf_architecture(no_field, "f.gguf")


def test_only_the_q4_1_linear_weights_of_a_gguf_file_are_read(tmp_path):
    """A linear weight kept in another type (llama.cpp keeps some in F32 or Q8_0) and a Q4_1
    tensor that is no linear layer (the token embeddings) are left out; the linear Q4_1 one
    comes back under its Hugging Face name."""
    import gguf

    rows = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).numpy()
    q4_1 = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q4_1)
    path = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(path, arch="qwen2")
    writer.add_tensor("blk.0.ffn_up.weight", q4_1, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.ffn_down.weight", rows)
    writer.add_tensor("token_embd.weight", q4_1, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    read = q.read_q4_1_linear_weights(path, num_heads=2, num_kv_heads=1)

    assert list(read) == ["model.layers.0.mlp.up_proj.weight"]
    levels = gguf.quants.dequantize(q4_1, gguf.GGMLQuantizationType.Q4_1)
    dequantized = q.dequantize_int4(*read["model.layers.0.mlp.up_proj.weight"], 32)
    assert torch.equal(dequantized, torch.from_numpy(levels))


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


@pytest.mark.parametrize("kernels", CPU_KERNELS)
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_engine_computes_the_dequantized_model(
    tiny_model_dirs, chat_prompts, method, kernels, monkeypatch
):
    """Greedy tokens of LLM(quantization=...) equal transformers' greedy tokens on the model
    whose weights are the dequantized ones (linear layers in the scheme, the embedding in
    int8), batched, with chunked prefill, in float32. minivllm's kernels take float32; an
    engine on PyTorch's refuses it on the CPU for its speed (they take a scalar loop there),
    so the test admits it."""
    from minivllm.config import KERNEL_ACTIVATION_DTYPES

    if kernels == "pytorch":
        monkeypatch.setitem(KERNEL_ACTIVATION_DTYPES["cpu"], method, (torch.float32,))
    path = tiny_model_dirs[ENGINE_TEST_FAMILY]
    reference = dequantized_hf_model(path, method)
    with cpu_kernels_of(kernels):
        llm = LLM(
            model=str(path), dtype="float32", quantization=method, max_num_batched_tokens=32,
            max_num_seqs=4, kv_cache_memory_bytes=2**22,
        )  # fmt: skip
    layers = llm.llm_engine.executor.driver_worker.model.model.layers
    kernel = layers[0].mlp.down_proj.quantized.kernel
    assert kernel.startswith("minivllm_cpu." if kernels == "own" else "aten._weight_int")
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
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_weight_lets_its_float_weight_go(method):
    """Quantizing a weight that autograd tracks (an nn.Parameter) must not record a graph: the
    scales would hold the float weight alive through it, the second copy quantization is meant
    to remove."""
    weight = torch.nn.Parameter(torch.randn(64, 128))
    float_weight = weakref.ref(weight)
    quantized = q.quantize_weight(weight, method)
    del weight
    gc.collect()
    assert float_weight() is None and quantized.nbytes < 64 * 128 * 4 / 2


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


class OperatorsThatRan(TorchDispatchMode):
    """The names of the operators that run inside it ("aten::mm", "mkldnn::_linear_pointwise")
    and the shapes of the floating-point tensors they make."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()
        self.float_shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name)
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            self.float_shapes.append(tuple(out.shape))
        return out


MATRIX_PRODUCTS = {
    "aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::bmm",
    "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu",
    "minivllm::int8_linear", "minivllm::int4_linear",
}  # fmt: skip
FLOAT_PRODUCTS = {"float32": {"mkldnn::_linear_pointwise"}, "bfloat16": {"mkldnn::_linear_pointwise"},
                  "float16": {"aten::linear"}}  # oneDNN on packed weights; float16: F.linear  # fmt: skip
INT8, INT4 = "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu"
OWN_INT8, OWN_INT4 = "minivllm::int8_linear", "minivllm::int4_linear"
SUPPORTED_DTYPES = {"own": ("bfloat16", "float32"), "pytorch": ("bfloat16",)}


def cpu_quantized_products(kernels: str, quantization: str) -> set[str]:
    """A quantized engine's products on the CPU, its tied embedding / LM head in int8: both on
    minivllm's kernels where they built, else on PyTorch's (bfloat16 only; the tiny model's
    widths are multiples of 16)."""
    int8 = OWN_INT8 if kernels == "own" else INT8
    int4 = OWN_INT4 if kernels == "own" else INT4
    return {int8} if quantization == "int8" else {int4, int8}


@pytest.mark.parametrize("kernels", CPU_KERNELS)
@pytest.mark.parametrize("quantization", [None, "int8", "int4", "gguf"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "auto"])
def test_every_dtype_and_quantization_runs_a_kernel_or_is_refused(
    tiny_model_dirs, tmp_path_factory, dtype, quantization, kernels
):
    """LLM(dtype=, quantization=) on the CPU either refuses the pair, naming the dtypes it
    supports, or decodes with the pair's kernel: every matrix product of a one-token step is
    that kernel's, none a reference product on a dequantized weight (PyTorch's int8 past
    INT8_FUSED_MAX_ROWS, or int4's reference layout, would show as aten::linear)."""
    model_dir = tmp_path_factory.getbasetemp() / "with_gguf" / ENGINE_TEST_FAMILY
    if not model_dir.exists():
        tiny_model_with_gguf(tiny_model_dirs, ENGINE_TEST_FAMILY, "llama", model_dir.parent)
    engine_settings = dict(dtype=dtype, quantization=quantization, enforce_eager=True,
                    kv_cache_memory_bytes=2**22)  # fmt: skip
    supported = SUPPORTED_DTYPES[kernels]
    with cpu_kernels_of(kernels):
        if quantization is not None and dtype not in (*supported, "auto"):
            names = ", ".join(supported)
            with pytest.raises(
                ValueError, match=f"dtype {dtype} has no .* supported there: {names}$"
            ):
                LLM(model=str(model_dir), **engine_settings)
            return
        llm = LLM(model=str(model_dir), **engine_settings)
    model = llm.llm_engine.executor.driver_worker.model
    expected_dtype = "float32" if dtype == "auto" and quantization is None else dtype
    expected_dtype = "bfloat16" if expected_dtype == "auto" else expected_dtype
    assert str(model.dtype) == f"torch.{expected_dtype}"
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    with OperatorsThatRan() as ran:  # a one-token prompt: every step multiplies one row
        llm.generate([{"prompt_token_ids": [5]}], params, use_tqdm=False)
    expected = (
        FLOAT_PRODUCTS[expected_dtype] if quantization is None
        else cpu_quantized_products(kernels, quantization)
    )  # fmt: skip
    assert ran.names & MATRIX_PRODUCTS == expected


@pytest.mark.parametrize(
    "num_rows, fused",
    [(1, True), (q.INT8_FUSED_MAX_ROWS, True), (q.INT8_FUSED_MAX_ROWS + 1, False), (64, False)],
)
def test_int8_products_switch_kernel_past_the_fused_rows_and_copy_the_weight_once(num_rows, fused):
    """On PyTorch's kernels: up to INT8_FUSED_MAX_ROWS rows the fused kernel reads the int8
    weight and no float copy of it is made; past them the float product multiplies one copy
    converted to bfloat16 (the scales applied to its output, not a second, scaled copy). Both
    are the product with the dequantized weight."""
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    x = torch.randn(num_rows, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    with cpu_kernels_of("pytorch"):
        int8 = q.Int8Weight.from_float(weight.bfloat16())
    with OperatorsThatRan() as ran:
        out = int8.matmul(x)
    products = ran.names & MATRIX_PRODUCTS
    assert (products == {INT8}) if fused else (products and INT8 not in products)
    assert int8.product_for(num_rows) == ("fused" if fused else "dequantized")
    assert ran.float_shapes.count((48, 64)) == (0 if fused else 1)
    expected = x.double() @ q.dequantize_int8(int8.q, int8.scale).double().T
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def test_quantize_weight_refuses_an_unknown_method_and_groups_as_asked():
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError) as refused:
        q.quantize_weight(weight, "int3")
    assert str(refused.value) == "no weight quantization 'int3': it is 'int8' or 'int4'"
    int4 = q.quantize_weight(weight, "int4", group_size=64)
    assert (int4.group_size, int4.dtype) == (64, torch.float32)
    reference = q.dequantize_int4(*q.quantize_int4(weight, 64), 64)
    torch.testing.assert_close(int4.matmul(torch.eye(128)).T, reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError) as refused:
        q.quantize_int4(weight[:, :48], 32)
    assert str(refused.value) == "int4 groups of 32 do not divide a row of 48 weights"


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_product_keeps_the_leading_dimensions_of_its_input(method):
    """x [..., K] @ w.T is [..., N]: a [2, 3, K] batch gives [2, 3, N], each row the product
    of that row of x with the dequantized weight."""
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(6))
    if method == "int8":
        dequantized = q.dequantize_int8(*q.quantize_int8(weight))
    else:
        dequantized = q.dequantize_int4(*q.quantize_int4(weight, 32), 32)

    out = q.quantize_weight(weight, method).matmul(x)

    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out, x @ dequantized.T, rtol=1e-4, atol=1e-4)


def test_the_smallest_normal_scale_is_still_a_scale():
    """An int4 group spanning exactly 15 x the smallest normal float32, or an int8 row reaching
    127 x it, has that scale (normal, every level kept): its largest weight comes back, not
    zero or only its minimum."""
    weight = torch.zeros(1, 32)
    weight[0, 1] = 15 * q.SMALLEST_SCALE
    levels, scale, minimum = q.quantize_int4(weight, 32)
    assert scale.item() == q.SMALLEST_SCALE and levels[0, 1] == 15
    assert torch.equal(q.dequantize_int4(levels, scale, minimum, 32), weight)
    weight[0, 1] = 127 * q.SMALLEST_SCALE
    levels, scale = q.quantize_int8(weight)
    assert scale.item() == q.SMALLEST_SCALE and levels[0, 1] == 127
    assert torch.equal(q.dequantize_int8(levels, scale), weight)


def test_an_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        LLM(quantization="int3")


# --- an engine's memory -------------------------------------------------------------------------


def resident_bytes() -> int:
    """This process's resident memory (Linux's /proc: pages actually held)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_cpu_pool_is_paid_for_as_its_blocks_are_written(tiny_model_dirs):
    """A 512 MiB pool costs next to nothing until written; it reads as zeros; writing one
    block makes about that block resident, not the pool."""
    from minivllm.attention.backend import PagedKVCache
    from minivllm.models.loader import load_model_config

    config = load_model_config(tiny_model_dirs[ENGINE_TEST_FAMILY])
    bytes_per_block = 16 * config.kv_bytes_per_token(torch.float32)
    num_blocks = (512 << 20) // bytes_per_block
    before = resident_bytes()
    pool = PagedKVCache(config, num_blocks, 16, torch.float32, "cpu")
    assert resident_bytes() - before < 32 << 20
    assert sum(layer.numel() for layer in pool.layers) * 4 >= 500 << 20
    assert all(
        layer.dtype == torch.float32 and layer.shape[1] == num_blocks for layer in pool.layers
    )
    assert not pool.layers[0][:, 1000:1010].any()  # zeros, wherever one reads
    pool.layers[0][:, 7].fill_(1.0)
    assert resident_bytes() - before < 32 << 20


def test_metrics_report_the_pool_and_the_bytes_its_requests_wrote(tiny_model_dirs):
    """minivllm:kv_cache_bytes is the pool; minivllm:kv_cache_touched_bytes the blocks handed
    out at least once, each holding block_size tokens of K and V in every layer."""
    from minivllm.models.loader import load_model_config

    path = tiny_model_dirs[ENGINE_TEST_FAMILY]
    config = load_model_config(path)
    llm = LLM(model=str(path), kv_cache_memory_bytes=2**24, enable_prefix_caching=False)
    bytes_per_block = 16 * 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4

    def metric(name):
        return {m.name: m.value for m in llm.get_metrics()}[name]

    num_blocks = llm.llm_engine.kv_cache_manager.num_blocks
    assert metric("minivllm:kv_cache_bytes") == num_blocks * bytes_per_block
    assert metric("minivllm:kv_cache_touched_bytes") == 0
    prompts = [{"prompt_token_ids": [5] * 40}, {"prompt_token_ids": [7] * 10}]
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    # 40 + 8 tokens fill 3 blocks of 16, 10 + 8 fill 2: 5 blocks, all different.
    assert metric("minivllm:kv_cache_touched_bytes") == 5 * bytes_per_block
    llm.generate(prompts[1:], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert metric("minivllm:kv_cache_touched_bytes") == 7 * bytes_per_block  # 2 new blocks


# --- quality -------------------------------------------------------------------------------------


def test_perplexity_is_transformers_loss_on_the_same_windows(tiny_model_dirs, tiny_models):
    """The engine's perplexity of the held-out prose equals exp of transformers' mean
    cross-entropy over the same windows (each window scored from its own start)."""
    from minivllm.bench import quality

    path = tiny_model_dirs[ENGINE_TEST_FAMILY]
    llm = LLM(model=str(path), kv_cache_memory_bytes=2**24)
    token_ids = quality.heldout_token_ids(llm.get_tokenizer())[:300]
    assert len(token_ids) == 300  # the prose is a few thousand tokens
    hf_model = tiny_models(ENGINE_TEST_FAMILY)[1]
    losses, count = 0.0, 0
    with torch.no_grad():
        for window in quality.windows(token_ids, 128):
            ids = torch.tensor([window])
            logits = hf_model(ids).logits[0, :-1].double()
            losses += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
            count += len(window) - 1
    expected = math.exp(losses / count)
    assert quality.perplexity(llm, token_ids, window=128) == pytest.approx(expected, rel=1e-4)


def test_windows_cover_the_text_and_agreement_counts_the_shared_start():
    from minivllm.bench import quality

    assert quality.windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert quality.windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # [8] scores nothing
    assert quality.tokens_before_first_difference([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert quality.tokens_before_first_difference([1, 2], [1, 2, 3]) == 2
