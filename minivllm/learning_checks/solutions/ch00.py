"""Solutions to chapter 00's exercises: RMSNorm and rotary position embeddings."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x**2) + eps) * weight, the mean over the last dimension (hidden)."""
    mean_square = x.pow(2).mean(dim=-1, keepdim=True)  # [..., 1]: one number per row
    return x / torch.sqrt(mean_square + eps) * weight  # weight [hidden] broadcasts over rows


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate feature i of each head's first half together with feature i of its second half,
    by the angle position * theta^(-2i/head_dim). x: [tokens, heads, head_dim]."""
    head_dim = x.shape[-1]
    half = head_dim // 2
    # One frequency per pair of features, i < head_dim/2: computed as 1 / theta^(2i/head_dim).
    # Writing it theta^(-2i/head_dim) instead rounds differently in float32; at position 4,000
    # the difference is ~1e-4, well inside the check's tolerance of 1e-3.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]  # [tokens, head_dim / 2]
    cos = angles.cos()[:, None, :]  # [tokens, 1, head_dim / 2]: the same for every head
    sin = angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
