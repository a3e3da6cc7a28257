"""Appendix A's solution: gather K/V out of the pool as whole rows, one copy per block."""

import torch


def gather_kv(
    kv: torch.Tensor, block_tables: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the first `length` tokens of each sequence, [seqs, length, heads, dim].

    Each half of the pool viewed as [num_blocks, block_size * heads * dim] holds one block per
    row, so index_select copies whole contiguous rows instead of single elements."""
    num_seqs = block_tables.shape[0]
    num_blocks, heads, dim = kv.shape[1], kv.shape[3], kv.shape[4]
    rows = block_tables.flatten()
    keys = kv[0].reshape(num_blocks, -1).index_select(0, rows).view(num_seqs, -1, heads, dim)
    values = kv[1].reshape(num_blocks, -1).index_select(0, rows).view(num_seqs, -1, heads, dim)
    return keys[:, :length], values[:, :length]
