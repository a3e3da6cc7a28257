"""Random paged-attention steps, and the definition they are checked against, shared by every
attention backend's tests (chapter 03's reference, chapter 06's kernels).

A case is a flat batch of sequences, each with some tokens already cached and some new this
step (1 new token is a decode; more, a prefill chunk that may start mid-sequence), its blocks
scattered over a pool whose other slots hold large garbage, so reading a wrong slot shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from minivllm.attention.backend import AttentionMetadata, PagedKVCache
from minivllm.attention.torch_paged import write_kv
from minivllm.config import ModelConfig


def blocks_for(num_tokens: int, block_size: int) -> int:
    """By definition: the fewest blocks of `block_size` slots that hold `num_tokens` tokens."""
    return math.ceil(num_tokens / block_size)


def attention_config(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8) -> ModelConfig:
    """A model config with just the shapes the KV cache reads (the rest is never used)."""
    return ModelConfig(
        model_type="llama",
        vocab_size=32,
        hidden_size=num_heads * head_dim,
        intermediate_size=16,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


@st.composite
def paged_batches(
    draw,
    block_sizes=(1, 2, 3, 5, 8, 16),
    head_dims=(4, 8),
    max_group: int = 3,
    max_cached: int = 30,
    max_new: int = 12,
    decodes_only: bool = False,
    kv_heads=(1, 2, 3),
    pool_blocks: int | None = None,
):
    """(block_size, num_kv_heads, group, head_dim, [(cached, new)], physical ids, seed).

    `pool_blocks` fixes the pool's size (the sequences' blocks are drawn from it); otherwise
    the pool has just the blocks the sequences need and a few spare."""
    if pool_blocks is not None and blocks_for(max_cached + max_new, min(block_sizes)) > pool_blocks:
        raise ValueError(f"a pool of {pool_blocks} blocks cannot hold the longest sequence")
    block_size = draw(st.sampled_from(block_sizes))
    num_kv_heads = draw(st.sampled_from(kv_heads))
    group = draw(st.integers(1, max_group))  # query heads per KV head (GQA)
    head_dim = draw(st.sampled_from(head_dims))
    new_tokens = st.just(1) if decodes_only else st.one_of(st.just(1), st.integers(2, max_new))
    sequences = draw(
        st.lists(st.tuples(st.integers(0, max_cached), new_tokens), min_size=1, max_size=5)
    )
    if pool_blocks is not None:
        sequences = sequences_that_fit(sequences, block_size, pool_blocks)
    needed = sum(blocks_for(c + n, block_size) for c, n in sequences)
    num_blocks = pool_blocks if pool_blocks is not None else needed + draw(st.integers(0, 3))
    physical = draw(st.permutations(range(num_blocks)))  # shuffled physical block ids
    seed = draw(st.integers(0, 2**31 - 1))
    return block_size, num_kv_heads, group, head_dim, sequences, physical, seed


def sequences_that_fit(sequences: list, block_size: int, pool_blocks: int) -> list:
    """The drawn sequences from the first on, as many as a pool of `pool_blocks` holds: the
    strategy builds only cases that exist (at least one sequence always fits, since the caller
    sizes the pool for the longest one)."""
    kept, used = [], 0
    for cached, new in sequences:
        used += blocks_for(cached + new, block_size)
        if used > pool_blocks:
            break
        kept.append((cached, new))
    return kept


def dense_attention(q, keys, values, group: int) -> torch.Tensor:
    """The definition, in float64: query i of a chunk of L new tokens in a sequence of S tokens
    sits at position S - L + i and attends with softmax(q.k / sqrt(d)) to keys 0..S-L+i; query
    head h reads KV head h // group."""
    q, keys, values = q.double(), keys.double(), values.double()
    num_queries, num_keys = q.shape[0], keys.shape[0]
    keys = keys.repeat_interleave(group, dim=1)  # [S, heads, d]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(q.shape[-1])
    query_positions = torch.arange(num_keys - num_queries, num_keys)
    visible = torch.arange(num_keys)[None, :] <= query_positions[:, None]  # [L, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


@dataclass
class BackendStep:
    """One step as the model calls a backend: earlier steps' K/V already in the pool."""

    cache: PagedKVCache
    metadata: AttentionMetadata
    q: torch.Tensor  # [new tokens, heads, dim]
    new_k: torch.Tensor  # [new tokens, kv heads, dim]
    new_v: torch.Tensor
    expected: torch.Tensor  # dense attention, float64
    new_slots: list[int]


def backend_step(batch, dtype: torch.dtype = torch.float32) -> BackendStep:
    block_size, num_kv_heads, group, head_dim, sequences, physical, seed = batch
    generator = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    config = attention_config(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    cache = PagedKVCache(config, len(physical), block_size, dtype, "cpu")
    kv = cache.layers[0]
    kv.copy_(10 * randn(*kv.shape))  # stale garbage everywhere: reading a wrong slot shows

    tables, new_slots, query_lens, seq_lens = [], [], [], []
    queries, keys, values, new_keys, new_values = [], [], [], [], []
    next_block = 0
    for cached, new in sequences:
        seq_len = cached + new
        num = blocks_for(seq_len, block_size)
        table = list(physical[next_block : next_block + num])
        next_block += num
        slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        k, v = randn(seq_len, num_kv_heads, head_dim), randn(seq_len, num_kv_heads, head_dim)
        if cached:  # what earlier steps wrote
            write_kv(kv, k[:cached], v[:cached], torch.tensor(slots[:cached]))
        tables.append(table)
        new_slots += slots[cached:]
        keys.append(k)
        values.append(v)
        new_keys.append(k[cached:])
        new_values.append(v[cached:])
        queries.append(randn(new, num_heads, head_dim))
        query_lens.append(new)
        seq_lens.append(seq_len)

    expected = torch.cat(
        [dense_attention(qi, ki, vi, group) for qi, ki, vi in zip(queries, keys, values)]
    )
    return BackendStep(
        cache=cache,
        metadata=AttentionMetadata.build(query_lens, seq_lens, tables, new_slots),
        q=torch.cat(queries),
        new_k=torch.cat(new_keys),
        new_v=torch.cat(new_values),
        expected=expected,
        new_slots=new_slots,
    )
