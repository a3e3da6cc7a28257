"""Chapter 12, "Our own kernel": int4 and int8 weight-only products on the CPU.

A batch-1 decode reads every weight once, so the product of one activation row with an int4
weight should take as long as reading the int4 bytes. `csrc/quantized_linear.cpp` does that
for a few rows (`GEMV_MAX_ROWS`): each thread walks whole output columns and turns a block of 32
weights into float vectors in registers, then multiplies them with every row's activations;
nothing is written but the output. An int4 block is dequantized by table lookup where vectors
hold 16 floats (AVX512): the group's 16 possible weights, level * scale + minimum, fill one
vector, and one permute per 16 weights picks them (`csrc/quantized_blocks.h`); with AVX2 the
levels are widened to floats and scaled by one multiply-add. An int8 block is widened to floats,
and its output column's scale multiplies the finished sum once.
Many rows (a prompt, a large batch) make the product compute-bound instead: there the weight is
dequantized a tile of `TILE_ROWS` output columns at a time into a buffer that stays in the cache,
and a float matrix product (oneDNN's) reads the tile. No float copy of the whole weight is
ever made.

int4 weights are kept in llama.cpp's Q4_1 order (`pack_int4_blocks`): 32 weights of a row in 16
bytes, byte j holding weight j in its low nibble and weight j + 16 in its high one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm import cpu_kernels
from minivllm.utils import define_operator

GEMV_MAX_ROWS = 8  # the C++ product's register blocking; more rows take the tiled product
TILE_ROWS = 4096  # output columns dequantized at a time: 4.5 MiB of bfloat16 for K = 576


def available() -> bool:
    """Whether the C++ kernels built here (they share chapter 06's library)."""
    return cpu_kernels.load_kernels() is not None


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


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    int8_activations: bool = False,
) -> torch.Tensor:
    """x [M, K] @ w.T for the int4 weight (packed, scale, minimum): [M, N] in x's dtype. With
    `int8_activations`, a few rows are quantized to int8 blocks first (W4A8, llama.cpp's Q4_1 x
    Q8_1); the tiled product of many rows keeps them as they are."""
    kernels = torch.ops.minivllm_cpu
    if x.shape[0] <= GEMV_MAX_ROWS:
        out = x.new_empty(x.shape[0], packed.shape[0])
        gemv = kernels.w4a8_gemv if int8_activations else kernels.int4_gemv
        gemv(out, x.contiguous(), packed, scale, minimum)
        return out
    return tiled_linear(
        x,
        packed.shape[0],
        lambda tile, begin: kernels.int4_dequantize(tile, packed, scale, minimum, begin),
    )


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, int8_activations: bool = False
) -> torch.Tensor:
    """x [M, K] @ w.T for the int8 weight (q, scale [N] float32): [M, N] in x's dtype; with
    `int8_activations`, W8A8 for a few rows (see `int4_linear`)."""
    kernels = torch.ops.minivllm_cpu
    if x.shape[0] <= GEMV_MAX_ROWS:
        out = x.new_empty(x.shape[0], q.shape[0])
        gemv = kernels.w8a8_gemv if int8_activations else kernels.int8_gemv
        gemv(out, x.contiguous(), q, scale)
        return out
    return tiled_linear(
        x, q.shape[0], lambda tile, begin: kernels.int8_dequantize(tile, q, scale, begin)
    )


def tiled_linear(x: torch.Tensor, columns: int, dequantize_tile) -> torch.Tensor:
    """x @ w.T with w made `TILE_ROWS` rows at a time by `dequantize_tile(tile, first_row)`
    into one reused buffer, each tile's product written into its columns of the output."""
    out = x.new_empty(x.shape[0], columns)
    buffer = x.new_empty(min(columns, TILE_ROWS), x.shape[1])
    for begin in range(0, columns, TILE_ROWS):
        tile = buffer[: min(columns - begin, TILE_ROWS)]
        dequantize_tile(tile, begin)
        out[:, begin : begin + tile.shape[0]] = F.linear(x, tile)
    return out


# The products as operators of their own, which `Int4Weight`/`Int8Weight` call: the compiled
# model (chapter 11) sees each as one opaque call whose result has a known shape, and the
# choice by row count is made inside it when it runs, so no graph is guarded on the rows.
def _linear_result(x: torch.Tensor, weight: torch.Tensor, *_: object) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


define_operator(
    "minivllm::int4_linear",
    "(Tensor x, Tensor packed, Tensor scale, Tensor minimum, bool int8_activations=False)"
    " -> Tensor",
    int4_linear,
    _linear_result,
)
define_operator(
    "minivllm::int8_linear",
    "(Tensor x, Tensor q, Tensor scale, bool int8_activations=False) -> Tensor",
    int8_linear,
    _linear_result,
)
