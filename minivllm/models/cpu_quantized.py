"""Chapter 12, "Our own kernel": int4 and int8 weight-only products on the CPU.

A batch-1 decode reads every weight once, so the product of one activation row with an int4
weight should take as long as reading the int4 bytes. `csrc/quantized_linear.cpp` does that
for a few rows (`GEMV_MAX_ROWS`): each thread walks whole output columns and turns a block of 32
weights into vectors in registers, then multiplies them with every row's activations; nothing
is written but the output, and each thread asks for its next columns' bytes ahead of use
(`for_column_tiles` in `csrc/quantized_blocks.h`). How a block becomes numbers depends on the
activations and the CPU:

- bfloat16 activations on a CPU with AVX512-BF16: the levels 0..15 are bfloat16 numbers
  exactly, so a block's nibbles pick them from a table (one permute for 32 weights) and one
  instruction multiplies 32 of them with 32 activations, summing pairs into float32 lanes; a
  group's sum(q * x) is scaled once, and minimum * sum(x) added per group.
- otherwise (float32 activations, or no AVX512-BF16), floats: with AVX512 the group's 16
  possible weights, level * scale + minimum, fill one vector and one permute per 16 weights
  picks them; with AVX2 the levels are widened to floats and scaled by one multiply-add.
- int8 blocks are widened to floats, and the output column's scale multiplies the finished sum.

More rows (a batch of decodes) make the product compute-bound instead. With bfloat16
activations and AVX512-BF16, up to `BF16_PAIRS_MAX_ROWS`, four columns at a time are dequantized
once into a bfloat16 buffer that stays in L1 (the scales applied, each weight rounded to
bfloat16) and multiplied with every row, six rows at a time, by the pair dot product: 24
accumulators in registers and no per-group work in the loop. Otherwise, and for a prompt's
hundreds of rows, the weight is dequantized a tile of output columns at a time (`tile_rows`,
4096 unless told) into a buffer that stays in the cache, and a float matrix product (oneDNN's)
reads the tile. No float copy of the whole weight is ever made.

The model calls `torch.ops.minivllm.int4_linear(x, packed, scale, minimum)` and
`torch.ops.minivllm.int8_linear(x, q, scale)`, C++ operators that choose the product by the
row count when they run (so chapter 11's compiled graph holds one opaque call, guarded on
nothing); `int8_activations=True` takes the W4A8/W8A8 products for a few rows instead.

int4 weights are kept in llama.cpp's Q4_1 order (`pack_int4_blocks`): 32 weights of a row in 16
bytes, byte j holding weight j in its low nibble and weight j + 16 in its high one.
"""

from __future__ import annotations

import torch

from minivllm import cpu_kernels

# Rows up to which the products are the register-blocked ones (`kMaxGemvRows` in
# csrc/quantized_blocks.h); more rows take the tiled product, except that bfloat16 rows, up to
# BF16_PAIRS_MAX_ROWS (`kMaxBf16Rows`), take the product that dequantizes a few columns at a
# time into bfloat16 and multiplies them with every row, where the CPU has AVX512-BF16
# (`multiplies_bfloat16_pairs`).
GEMV_MAX_ROWS = 8
BF16_PAIRS_MAX_ROWS = 64


def available() -> bool:
    """Whether the C++ kernels built here (they share chapter 06's library)."""
    return cpu_kernels.load_kernels() is not None


def multiplies_bfloat16_pairs() -> bool:
    """Whether the kernels were built with AVX512-BF16's pair dot product (this CPU has it)."""
    return available() and "-DMINIVLLM_AVX512_BF16" in cpu_kernels.compiler_flags()[1]


def pack_int4_blocks(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] of 0..15 -> [N, K / 2] uint8 in Q4_1's order (see the module docstring)."""
    rows, columns = q.shape
    if columns % 32:
        raise ValueError(f"int4 blocks hold 32 weights; a row of {columns} is not whole blocks")
    halves = q.to(torch.uint8).reshape(rows, columns // 32, 2, 16)
    return (halves[:, :, 0] | halves[:, :, 1] << 4).reshape(rows, columns // 2)


def quantize_activation_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 activations of the W4A8/W8A8 products, written out: each block of 32 values
    of a row as int8 levels xq [M, K] and one step per block [M, K / 32], x ~ xq * step,
    step = max|x| / 127; a block whose largest magnitude is below the smallest normal float32
    is all zeros with step 0."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    normal = largest >= torch.finfo(torch.float32).tiny
    levels = torch.round(blocks * torch.where(normal, 127.0 / largest, 0.0))
    step = torch.where(normal, largest / 127.0, 0.0)
    return levels.to(torch.int8).reshape(x.shape), step.squeeze(-1)
