"""Chapter 03 — paged attention: attend over K/V scattered across the blocks of a pool.

One engine step runs a flat batch that mixes sequences in different phases: some decode one
token, some prefill a chunk of their prompt. `AttentionMetadata` describes that batch:

    query_start_loc  [0, 1, 2, 130]   sequence i's new tokens are rows qsl[i]:qsl[i+1]
    seq_lens         [57, 9, 300]     tokens of each sequence *after* this step (context + new)
    block_tables     [[4, 7, 0, 0],   physical blocks of each sequence, padded
                      [2, 0, 0, 0],
                      [1, 3, 5, ...]]
    slot_mapping     [..]             pool slot of each new token: where its K/V are written

Every attention backend takes this one metadata object. The "torch" backend here is the
readable reference: write the new K/V at their slots, then for each sequence gather its K/V
through its block table and run ordinary attention, with a causal mask shifted by the number
of tokens already in the cache. Decodes (one query each) are batched into one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.block_manager import cdiv
from minivllm.config import ModelConfig


@dataclass
class AttentionMetadata:
    """The shape of one step's flat batch, as the attention kernels need it."""

    slot_mapping: torch.Tensor  # [num_tokens] pool slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] where each sequence's new tokens start
    seq_lens: torch.Tensor  # [num_seqs] context + new tokens of each sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks] physical block ids, padded with 0
    # The same numbers as Python lists, so loops over sequences need no device sync.
    query_lens_list: list[int]
    seq_lens_list: list[int]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        width = max(len(table) for table in block_tables)
        padded = [table + [0] * (width - len(table)) for table in block_tables]
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(_starts(query_lens), dtype=torch.long, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
            block_tables=torch.tensor(padded, dtype=torch.long, device=device),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


class PagedKVCache:
    """The pool: per layer one tensor [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.layers = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)
        ]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def num_blocks_for_budget(
        config: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: int
    ) -> int:
        """How many blocks a memory budget holds."""
        return memory_bytes // (block_size * config.kv_bytes_per_token(dtype))


@dataclass
class TorchPagedAttention:
    """The reference backend: plain PyTorch, correct on any device."""

    kv_cache: PagedKVCache
    metadata: AttentionMetadata

    def __call__(self, layer_index: int, q, k, v) -> torch.Tensor:
        kv = self.kv_cache.layers[layer_index]
        write_kv(kv, k, v, self.metadata.slot_mapping)
        return paged_attention(q, kv, self.metadata, new_k=k, new_v=v)


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
    """Store the new tokens' K/V at their slots. Viewing the pool as [slots, heads, dim] turns
    (block, offset) addressing into one index: slot = block * block_size + offset."""
    num_kv_heads, head_dim = kv.shape[-2:]
    kv[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(kv: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """K and V of the first `length` tokens of sequences, copied out of their blocks.

    `block_tables` is [num_seqs, num_blocks]; returns [2, num_seqs, length, heads, dim]. One
    `index_select` fetches the blocks for K and V together, in block-table order, so that each
    sequence's tokens come out contiguous and in position order.
    """
    num_seqs = block_tables.shape[0]
    num_kv_heads, head_dim = kv.shape[-2:]
    blocks = kv.index_select(1, block_tables.flatten())
    return blocks.view(2, num_seqs, -1, num_kv_heads, head_dim)[:, :, :length]


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    metadata: AttentionMetadata,
    new_k: torch.Tensor | None = None,
    new_v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every new token over its own sequence's cached tokens, [tokens, heads, dim].

    `new_k`/`new_v`, when given, are this step's keys and values (already written to the pool
    `kv`): a sequence whose whole context is new this step reads them directly instead of
    gathering them back out of its blocks.
    """
    out = torch.empty_like(q)
    starts = _starts(metadata.query_lens_list)
    decode_seqs = [i for i, n in enumerate(metadata.query_lens_list) if n == 1]
    if decode_seqs:
        rows = torch.tensor([starts[i] for i in decode_seqs], device=q.device)
        out[rows] = _batched_decode_attention(q[rows], kv, metadata, decode_seqs)
    for i, query_len in enumerate(metadata.query_lens_list):
        if query_len > 1:
            start, seq_len = starts[i], metadata.seq_lens_list[i]
            rows = slice(start, start + query_len)
            if query_len == seq_len and new_k is not None:
                keys, values = new_k[rows], new_v[rows]
            else:
                num_blocks = cdiv(seq_len, kv.shape[2])
                table = metadata.block_tables[i : i + 1, :num_blocks]
                keys, values = gather_kv(kv, table, seq_len)[:, 0]
            out[rows] = _prefill_attention(q[rows], keys, values)
    return out


def _starts(query_lens: list[int]) -> list[int]:
    """Cumulative sums from 0: where each sequence's rows start in the flat batch."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return starts


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
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        is_causal=is_causal,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def _batched_decode_attention(
    q: torch.Tensor, kv: torch.Tensor, metadata: AttentionMetadata, seqs: list[int]
) -> torch.Tensor:
    """One query per sequence: gather each sequence's blocks into a padded batch and run one
    masked attention call for all of them, [num_seqs, heads, dim]."""
    seq_lens = metadata.seq_lens[seqs]
    longest = max(metadata.seq_lens_list[i] for i in seqs)
    block_size = kv.shape[2]
    num_blocks = cdiv(longest, block_size)
    keys, values = gather_kv(kv, metadata.block_tables[seqs, :num_blocks], longest)
    slots = torch.arange(longest, device=q.device)
    mask = (slots[None, :] < seq_lens[:, None])[:, None, None, :]  # [seqs, 1, 1, slots]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :],
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        enable_gqa=True,
    )
    return out[:, :, 0, :]
