"""Solutions to chapter 03's exercises: slot mapping and paged attention."""

import torch


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The pool slot of each of a sequence's positions start .. end - 1: position p sits at
    offset p % block_size of the table's block p // block_size, whose first slot is
    block_id * block_size."""
    slots = []
    for position in range(start, end):
        block_id = block_table[position // block_size]
        slots.append(block_id * block_size + position % block_size)
    return slots


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
) -> torch.Tensor:
    """Causal attention over K/V kept in a pool of blocks.

    q: [tokens, heads, head_dim], the flat batch: sequence i owns the next query_lens[i] rows.
    kv: [2, num_blocks, block_size, kv_heads, head_dim], already holding the K/V of all
    seq_lens[i] tokens of each sequence along its block table. Query j of sequence i sits at
    position seq_lens[i] - query_lens[i] + j and sees keys 0 .. that position."""
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // kv.shape[3]  # query heads per KV head
    out = torch.empty_like(q)
    start = 0
    for table, seq_len, query_len in zip(block_tables, seq_lens, query_lens):
        # Gather the sequence's blocks in table order: its K/V as one dense [seq_len, ...].
        keys = kv[0, table].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
        values = kv[1, table].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
        queries = q[start : start + query_len]  # [query_len, heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) / head_dim**0.5
        # The causal mask, offset: the queries are the sequence's *last* query_len tokens.
        query_positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
        key_positions = torch.arange(seq_len, device=q.device)
        visible = query_positions[:, None] >= key_positions[None, :]  # [query_len, seq_len]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start : start + query_len] = torch.einsum("hqk,khd->qhd", weights, values)
        start += query_len
    return out
