"""Chapter 03 — paged attention: attend over K/V scattered across the blocks of a pool.

One engine step runs a flat batch that mixes sequences in different phases: some decode one
token, some prefill a chunk of their prompt. `AttentionMetadata` (`attention/backend.py`)
describes that batch; every attention backend takes it, with the pool, and honours the contract
written there. The "torch" backend here is the readable reference: write the new K/V at their
slots, then for each sequence gather its K/V through its block table and run ordinary
attention, with a causal mask shifted by the number of tokens already in the cache. Decodes
(one query each) are batched: one call per group of sequences of similar length, prepared once
per step and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.attention.backend import (
    AttentionMetadata,
    PagedAttentionBackend,
    PagedKVCache,
    query_starts,
)
from minivllm.utils import cdiv, tokens_first_attention

# Decodes are attended in groups of this many sequences of similar length (see `decode_groups`).
DECODE_GROUP_SIZE = 16


@dataclass
class DecodeGroup:
    """Decoding sequences of similar length, answered together by one padded attention call."""

    rows: torch.Tensor  # [seqs] their query rows in the flat batch
    block_tables: torch.Tensor  # [seqs, blocks] enough blocks for the longest, padded with 0
    mask: torch.Tensor  # [seqs, 1, 1, longest] which of the padded positions hold real tokens
    longest: int


def decode_groups(metadata: AttentionMetadata) -> list[DecodeGroup]:
    """Sort the decoding sequences (one query each) by length and cut them into groups.

    A padded batch costs as much as if every member were as long as its longest one: with
    contexts spread over 20..360 tokens, one group of 64 would copy and attend over about
    twice the real tokens. Groups of similar lengths pad each only to its own longest member.
    The lists give the sorting and sizes without a device sync; the step's tensors give each
    group's rows.
    """
    query_lens, seq_lens = metadata.query_lens_list, metadata.seq_lens_list
    block_tables = metadata.block_tables_list
    seq_lens_tensor, block_tables_tensor = metadata.seq_lens, metadata.block_tables
    device = block_tables_tensor.device
    decodes = sorted((i for i, n in enumerate(query_lens) if n == 1), key=lambda i: seq_lens[i])
    starts = query_starts(query_lens)
    groups = []
    for start in range(0, len(decodes), DECODE_GROUP_SIZE):
        members = decodes[start : start + DECODE_GROUP_SIZE]
        index = torch.tensor(members, device=device)
        longest = seq_lens[members[-1]]
        width = max(len(block_tables[i]) for i in members)
        mask = torch.arange(longest, device=device)[None, :] < seq_lens_tensor[index, None]
        groups.append(
            DecodeGroup(
                rows=torch.tensor([starts[i] for i in members], device=device),
                block_tables=block_tables_tensor[index, :width],
                mask=mask[:, None, None, :],
                longest=longest,
            )
        )
    return groups


class TorchPagedAttention(PagedAttentionBackend):
    """The reference backend: plain PyTorch, correct on any device."""

    name = "torch"

    def __init__(self, kv_cache: PagedKVCache, metadata: AttentionMetadata):
        super().__init__(kv_cache, metadata)
        self.decode_groups = decode_groups(metadata)  # once per step, for every layer

    def __call__(self, layer_index: int, q, k, v) -> torch.Tensor:
        kv = self.kv_cache.layers[layer_index]
        write_kv(kv, k, v, self.metadata.slot_mapping)
        return paged_attention(q, kv, self.metadata, self.decode_groups, new_k=k, new_v=v)


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
    """Store the new tokens' K/V at their slots. Viewing the pool as [slots, heads, dim] turns
    (block, offset) addressing into one index: slot = block * block_size + offset."""
    num_kv_heads, head_dim = kv.shape[-2:]
    kv[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(
    kv: torch.Tensor, block_tables: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `length` tokens of sequences, copied out of their blocks.

    `block_tables` is [num_seqs, num_blocks]; returns keys and values, each
    [num_seqs, length, heads, dim], every sequence's tokens contiguous and in position order.
    Viewed as [num_blocks, block_size * heads * dim], a pool half holds one block per row, so
    `index_select` copies whole rows, one memcpy per block: several times faster than
    selecting along an inner dimension of the 5-D pool, which copies element by element.
    """
    num_seqs = block_tables.shape[0]
    num_blocks, num_kv_heads, head_dim = kv.shape[1], kv.shape[-2], kv.shape[-1]
    rows = block_tables.flatten()
    keys, values = (
        half.view(num_blocks, -1)
        .index_select(0, rows)
        .view(num_seqs, -1, num_kv_heads, head_dim)[:, :length]
        for half in kv
    )
    return keys, values


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    metadata: AttentionMetadata,
    groups: list[DecodeGroup] | None = None,
    new_k: torch.Tensor | None = None,
    new_v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every new token over its own sequence's cached tokens, [tokens, heads, dim].

    `groups` are the step's decode groups (made here when not given). `new_k`/`new_v`, when
    given, are this step's keys and values (already written to the pool `kv`): a sequence
    whose whole context is new this step reads them directly instead of gathering them back
    out of its blocks.
    """
    out = torch.empty_like(q)
    for group in decode_groups(metadata) if groups is None else groups:
        group_out = _batched_decode_attention(q.index_select(0, group.rows), kv, group)
        out.index_copy_(0, group.rows, group_out)
    starts = query_starts(metadata.query_lens_list)
    for i, query_len in enumerate(metadata.query_lens_list):
        if query_len > 1:
            start, seq_len = starts[i], metadata.seq_lens_list[i]
            rows = slice(start, start + query_len)
            if query_len == seq_len and new_k is not None:
                keys, values = new_k[rows], new_v[rows]
            else:
                num_blocks = cdiv(seq_len, kv.shape[2])
                table = metadata.block_tables[i : i + 1, :num_blocks]
                keys, values = (t[0] for t in gather_kv(kv, table, seq_len))
            out[rows] = _prefill_attention(q[rows], keys, values)
    return out


def _prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention of a chunk of `len(q)` new tokens that come after the cached ones.

    Query i sits at position (num_keys - num_queries + i) and may see keys up to there: the
    usual causal triangle, shifted right by the number of tokens computed in earlier steps.
    """
    num_queries, num_keys = q.shape[0], keys.shape[0]
    if num_queries == num_keys:  # the whole sequence is new: the plain causal mask
        mask, is_causal = None, True
    else:
        query_positions = torch.arange(num_keys - num_queries, num_keys, device=q.device)
        mask = query_positions[:, None] >= torch.arange(num_keys, device=q.device)[None, :]
        is_causal = False
    return tokens_first_attention(q, keys, values, attn_mask=mask, is_causal=is_causal)


def _batched_decode_attention(
    q: torch.Tensor, kv: torch.Tensor, group: DecodeGroup
) -> torch.Tensor:
    """One query per sequence: gather the group's blocks into a padded batch and run one
    masked attention call for all of them, [num_seqs, heads, dim].

    Grouped-query attention is folded into the query length: the `group` query heads that
    share a K/V head become `group` queries of that one head. All of a sequence's decode
    queries sit at the same position and share one mask, so this is exactly GQA; and SDPA's
    CPU kernel, which works one (sequence, head) pair at a time, then reads each K/V head once
    for its `group` queries instead of once per query head (`enable_gqa`).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv.shape[-2]
    keys, values = gather_kv(kv, group.block_tables, group.longest)
    out = F.scaled_dot_product_attention(
        q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=group.mask,
    )
    return out.reshape(num_seqs, num_heads, head_dim)
