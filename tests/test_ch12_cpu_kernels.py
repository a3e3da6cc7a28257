"""Chapter 12, "Our own kernel": the C++ int4/int8 products against their definitions.

The definitions are chapter 12's plain functions (`dequantize_int4`, `dequantize_int8`): the
product of activations with the dequantized weight, computed here in float64. The kernels are
drawn across both of their paths (and, for a few rows, with the activations quantized to int8
blocks too: W4A8 and W8A8, checked against the product with those blocks) (a few rows: the register-blocked product; more: the tiled
one, with tiles made small so that a weight spans several), group sizes of one and two
32-weight blocks, scales stored in float32 and float16, constant groups (scale 1, all zeros) and
tiny rows, float32 and bfloat16 activations.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minivllm.models import cpu_quantized
from minivllm.models.quantization import (
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    unpack_q4_1,
)

if not cpu_quantized.available():
    pytest.fail("the C++ CPU kernels did not build on this machine (see the warning)")

kernels = torch.ops.minivllm_cpu


@st.composite
def weights(draw) -> torch.Tensor:
    """A weight [N, K] of whole 32-weight blocks, some of its groups constant, some rows tiny."""
    rows, blocks = draw(st.integers(1, 40)), draw(st.integers(1, 6))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    weight = torch.randn(rows, blocks * 32, generator=generator)
    if draw(st.booleans()):  # a constant group: its scale would be 0
        weight[0, :32] = draw(st.floats(-2.0, 2.0, width=32))
    if draw(st.booleans()):  # a row near the smallest float32s
        weight[-1] *= 1e-39
    return weight


ACTIVATION_DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
# float32: summed in float32, so a few ulps of the largest partial sum; bfloat16: the output
# rounded to bfloat16 (8 bits of mantissa) on top.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def activations(draw, columns: int, dtype: torch.dtype) -> torch.Tensor:
    # every product: up to 8 rows (register-blocked), 9-64 (bfloat16 pairs), more (tiled)
    rows = draw(st.one_of(st.integers(1, 20), st.integers(60, 70)))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return torch.randn(rows, columns, generator=generator).to(dtype)


def assert_is_product(
    out: torch.Tensor, x: torch.Tensor, seen: torch.Tensor, weight: torch.Tensor
) -> None:
    """out == seen @ weight.T in float64 (seen: the activations x as the kernel multiplies
    them), within the rounding of x's dtype, measured against the product of magnitudes (the
    size of the largest partial sum)."""
    assert out.dtype == x.dtype and out.shape == (x.shape[0], weight.shape[0])
    expected = seen.double() @ weight.double().T
    magnitude = seen.double().abs() @ weight.double().abs().T
    error = (out.double() - expected).abs()
    assert bool((error <= TOLERANCE[x.dtype] * magnitude + 1e-30).all()), error.max()


def as_the_kernel_sees_them(x: torch.Tensor, int8_activations: bool) -> torch.Tensor:
    """The activations a product multiplies: x itself, or its int8 blocks dequantized."""
    if not int8_activations:
        return x
    levels, step = cpu_quantized.quantize_activation_blocks(x)
    blocks = levels.double().reshape(x.shape[0], -1, 32) * step.double()[..., None]
    return blocks.reshape(x.shape)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    weight=weights(),
    dtype=ACTIVATION_DTYPES,
    scale_dtype=st.sampled_from([torch.float32, torch.float16]),
    two_blocks=st.booleans(),
    int8_activations=st.booleans(),
)
def test_int4_product_is_the_product_with_the_dequantized_weight(
    data, weight, dtype, scale_dtype, two_blocks, int8_activations
):
    group_size = 64 if two_blocks and weight.shape[1] % 64 == 0 else 32
    q, scale, minimum = quantize_int4(weight, group_size)
    scale, minimum = scale.to(scale_dtype), minimum.to(scale_dtype)  # as stored
    x = activations(data.draw, weight.shape[1], dtype)
    packed = cpu_quantized.pack_int4_blocks(q)
    tile_rows = data.draw(st.integers(1, 16))  # small tiles: a weight spans several
    out = torch.ops.minivllm.int4_linear(x, packed, scale, minimum, int8_activations, tile_rows)
    seen = as_the_kernel_sees_them(
        x, int8_activations and x.shape[0] <= cpu_quantized.GEMV_MAX_ROWS
    )
    assert_is_product(out, x, seen, dequantize_int4(q, scale.float(), minimum.float(), group_size))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), weight=weights(), dtype=ACTIVATION_DTYPES, int8_activations=st.booleans())
def test_int8_product_is_the_product_with_the_dequantized_weight(
    data, weight, dtype, int8_activations
):
    q, scale = quantize_int8(weight)
    x = activations(data.draw, weight.shape[1], dtype)
    tile_rows = data.draw(st.integers(1, 16))
    out = torch.ops.minivllm.int8_linear(x, q, scale, int8_activations, tile_rows)
    seen = as_the_kernel_sees_them(
        x, int8_activations and x.shape[0] <= cpu_quantized.GEMV_MAX_ROWS
    )
    assert_is_product(out, x, seen, dequantize_int8(q, scale))


@settings(max_examples=20, deadline=None)
@given(weight=weights(), data=st.data())
def test_dequantized_tiles_are_the_weights_rows(weight, data):
    """A tile of rows [begin, begin + n): q * scale + minimum, rounded once (a fused multiply-add),
    so within a float32 ulp of the terms' size of the definition, which rounds twice."""
    begin = data.draw(st.integers(0, weight.shape[0] - 1))
    count = data.draw(st.integers(1, weight.shape[0] - begin))
    q, scale, minimum = quantize_int4(weight)
    tile = torch.empty(count, weight.shape[1])
    kernels.int4_dequantize(tile, cpu_quantized.pack_int4_blocks(q), scale, minimum, begin)
    expected = dequantize_int4(q, scale, minimum, 32)[begin : begin + count]
    terms = dequantize_int4(q, scale.abs(), minimum.abs(), 32)[begin : begin + count]
    ulp = torch.finfo(torch.float32).eps
    assert bool(((tile - expected).abs() <= ulp * terms).all())
    q8, scale8 = quantize_int8(weight)
    kernels.int8_dequantize(tile, q8, scale8, begin)
    torch.testing.assert_close(tile, dequantize_int8(q8, scale8)[begin : begin + count])


# bfloat16 activations hand over to the tiled product later, where the kernels multiply
# bfloat16 pairs; float32 ones at GEMV_MAX_ROWS.
BF16_LAST_ROWS = (
    cpu_quantized.BF16_PAIRS_MAX_ROWS
    if cpu_quantized.multiplies_bfloat16_pairs()
    else cpu_quantized.GEMV_MAX_ROWS
)


@example(rows=cpu_quantized.GEMV_MAX_ROWS)
@example(rows=cpu_quantized.GEMV_MAX_ROWS + 1)
@example(rows=cpu_quantized.BF16_PAIRS_MAX_ROWS)
@example(rows=cpu_quantized.BF16_PAIRS_MAX_ROWS + 1)
@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 2 * cpu_quantized.BF16_PAIRS_MAX_ROWS))
def test_each_row_count_takes_its_path(rows):
    """Up to its threshold a product of its own, past it the tiled one, for both formats and
    both activation dtypes (the thresholds' own row counts included): the tiled product
    multiplies float tiles with ATen's linear, which the profiler sees; the others call no
    other operator."""
    from torch.profiler import ProfilerActivity, profile

    weight = torch.randn(24, 64)
    q, scale, minimum = quantize_int4(weight)
    packed, (q8, scale8) = cpu_quantized.pack_int4_blocks(q), quantize_int8(weight)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, 64).to(dtype)
        last_rows = BF16_LAST_ROWS if dtype == torch.bfloat16 else cpu_quantized.GEMV_MAX_ROWS
        for product in (
            partial(torch.ops.minivllm.int4_linear, x, packed, scale, minimum),
            partial(torch.ops.minivllm.int8_linear, x, q8, scale8),
        ):
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                product()
            called = {event.key for event in profiler.key_averages()}
            assert ("aten::linear" in called) == (rows > last_rows), (dtype, called)


@settings(max_examples=30, deadline=None)
@given(weight=weights())
def test_int8_activation_blocks_round_to_the_nearest_of_255_levels(weight):
    """Each block's largest magnitude becomes level +-127 exactly, every value is within half a
    step of its level, and a block too small for a normal float32 step is zeros."""
    levels, step = cpu_quantized.quantize_activation_blocks(weight)
    blocks, levels = (
        weight.reshape(weight.shape[0], -1, 32),
        levels.reshape(weight.shape[0], -1, 32),
    )
    largest = blocks.abs().amax(dim=-1)
    normal = largest >= torch.finfo(torch.float32).tiny
    assert bool((levels[normal].abs().amax(dim=-1) == 127).all())
    assert bool((levels[~normal] == 0).all()) and bool((step[~normal] == 0).all())
    error = (levels.double() * step.double()[..., None] - blocks.double()).abs()[normal]
    assert bool((error <= step.double()[normal][..., None] * (0.5 + 1e-6)).all())


def test_packing_is_q4_1s_nibble_order():
    """Low nibbles hold a block's first 16 weights, high nibbles the next 16: packing then
    reading the bytes as a GGUF Q4_1 block gives the same integers back."""
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = cpu_quantized.pack_int4_blocks(q).reshape(3, 2, 16)
    assert torch.equal(packed[:, 0, 0] & 15, q[:, 0]) and torch.equal(
        packed[:, 0, 0] >> 4, q[:, 16]
    )
    scales = torch.ones(3, 2, 2, dtype=torch.float16).view(torch.uint8)  # d, m as bytes
    blocks = torch.cat([scales, packed], dim=-1).reshape(3, -1)
    assert torch.equal(unpack_q4_1(blocks)[0], q)


def test_bad_calls_raise():
    q, scale, minimum = quantize_int4(torch.randn(8, 64))
    packed = cpu_quantized.pack_int4_blocks(q)
    out, x = torch.empty(2, 8), torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.int4_gemv(out, torch.randn(2, 32), packed, scale, minimum)
    with pytest.raises(RuntimeError, match="at most"):
        kernels.int4_gemv(torch.empty(9, 8), torch.randn(9, 64), packed, scale, minimum)
    with pytest.raises(RuntimeError, match="uint8"):
        kernels.int4_gemv(out, x, packed.int(), scale, minimum)
    with pytest.raises(RuntimeError, match="whole number"):
        kernels.int4_gemv(
            out,
            x,
            packed,
            scale[:, :1].repeat(1, 3).contiguous(),
            minimum[:, :1].repeat(1, 3).contiguous(),
        )
    with pytest.raises(RuntimeError, match="share one dtype"):
        kernels.int4_gemv(out, x.bfloat16(), packed, scale, minimum)
    with pytest.raises(RuntimeError, match="not in the weight"):
        kernels.int4_dequantize(torch.empty(4, 64), packed, scale, minimum, 6)
    q8, scale8 = quantize_int8(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.int8_gemv(out, x, q8, scale8.double())
    with pytest.raises(RuntimeError, match="at most"):
        kernels.w4a8_gemv(torch.empty(9, 8), torch.randn(9, 64), packed, scale, minimum)
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.w8a8_gemv(out, torch.randn(2, 32), q8, scale8)
    # Rows of the wrong width, whichever product their count chooses.
    for rows in (2, cpu_quantized.BF16_PAIRS_MAX_ROWS, cpu_quantized.BF16_PAIRS_MAX_ROWS + 1):
        narrow = torch.randn(rows, 32).bfloat16()
        with pytest.raises(RuntimeError, match=r"x must be \[rows, 64\]"):
            torch.ops.minivllm.int4_linear(narrow, packed, scale, minimum)
        with pytest.raises(RuntimeError, match=r"x must be \[rows, 64\]"):
            torch.ops.minivllm.int8_linear(narrow, q8, scale8)
    with pytest.raises(ValueError, match="whole blocks"):
        cpu_quantized.pack_int4_blocks(torch.zeros(2, 48, dtype=torch.uint8))
