"""Chapter 12's solutions: int4 group-wise quantization, there and back, and Q4_1's packing."""

import torch


def quantize_int4(weight, group_size):
    """Each run of group_size weights along a row maps onto the levels 0..15 between its own
    minimum and maximum; returns (q, scale, minimum, dequantized)."""
    rows, columns = weight.shape
    groups = weight.reshape(rows, columns // group_size, group_size)
    minimum = groups.amin(dim=-1)
    scale = (groups.amax(dim=-1) - minimum) / 15  # 16 levels, 15 steps between them
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 0
    q = torch.round((groups - minimum[..., None]) / scale[..., None]).clamp(0, 15)
    dequantized = q * scale[..., None] + minimum[..., None]
    return (
        q.reshape(rows, columns).to(torch.uint8),
        scale,
        minimum,
        dequantized.reshape(rows, columns),
    )


def pack_q4_1(q):
    """Levels [N, K] (0..15) as Q4_1's bytes [N, K / 2]: in each block of 32, byte j holds level
    j in its low nibble and level j + 16 in its high one."""
    rows, columns = q.shape
    blocks = q.to(torch.uint8).reshape(rows, columns // 32, 2, 16)  # [row, block, half, j]
    first_half, second_half = blocks[:, :, 0], blocks[:, :, 1]
    return (first_half | (second_half << 4)).reshape(rows, columns // 2)
