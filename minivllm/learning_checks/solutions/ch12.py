"""Chapter 12's solution: int4 group-wise quantization, there and back."""

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
