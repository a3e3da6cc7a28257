"""Chapter 06 — attention backends timed on their own: one step's attention, outside the engine
(a decode step over a grid of batch sizes and context lengths, or a prefill chunk).

A step's attention is what the engine pays per step: the backend built once (its per-step
preparation: decode groups, block masks) and then called once per layer (store the new K/V,
attend). Every layer reads a different pool in the engine; here all of them read layer 0's:
the same arithmetic, but not the same memory traffic. At small sizes one layer's K/V (a few
hundred KB at one sequence of 128 tokens) can stay in the CPU's caches from one call to the next,
so the small cases read less from memory than an engine's step would. Sequences' blocks are
scattered over one pool at random, as after a while of serving, and the pool is sized once for
the largest case of the grid, so that every backend (flex compiles per pool size) sees the same
pool.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from minivllm.attention.backend import (
    AttentionMetadata,
    PagedKVCache,
    get_attention_backend,
    slot_mapping,
)
from minivllm.bench.measure import Timings, interleaved, synchronize
from minivllm.config import ModelConfig
from minivllm.utils import cdiv


@dataclass
class AttentionStep:
    """One step's inputs: the batch's shape, and the new tokens' q, k, v."""

    metadata: AttentionMetadata
    q: torch.Tensor  # [new tokens, heads, head_dim]
    k: torch.Tensor  # [new tokens, kv_heads, head_dim]
    v: torch.Tensor


def one_layer_pool(
    config: ModelConfig,
    num_seqs: int,
    max_context: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> PagedKVCache:
    """A one-layer pool of the model's shapes with room for `num_seqs` sequences of up to
    `max_context` tokens, filled with random K/V (attention over zeros would be a special case)."""
    one_layer = replace(config, num_layers=1)
    num_blocks = num_seqs * cdiv(max_context, block_size)
    pool = PagedKVCache(one_layer, num_blocks, block_size, dtype, device)
    pool.layers[0].normal_()
    return pool


def random_step(
    config: ModelConfig,
    pool: PagedKVCache,
    query_lens: list[int],
    seq_lens: list[int],
    seed: int = 0,
) -> AttentionStep:
    """Sequences of `seq_lens` tokens whose last `query_lens` are new this step, their blocks
    drawn at random from the pool."""
    generator = torch.Generator().manual_seed(seed)
    needed = [cdiv(n, pool.block_size) for n in seq_lens]
    if sum(needed) > pool.num_blocks:
        raise ValueError(
            f"{sum(seq_lens)} tokens in blocks of {pool.block_size} do not fit the pool"
        )
    order = torch.randperm(pool.num_blocks, generator=generator).tolist()
    tables, slots = [], []
    for num_blocks, query_len, seq_len in zip(needed, query_lens, seq_lens):
        tables.append(order[:num_blocks])
        order = order[num_blocks:]
        slots += slot_mapping(tables[-1], pool.block_size, seq_len - query_len, seq_len)
    device, dtype = pool.layers[0].device, pool.layers[0].dtype
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, slots, device=device)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

    num_tokens = sum(query_lens)
    return AttentionStep(
        metadata,
        randn(num_tokens, config.num_heads, config.head_dim),
        randn(num_tokens, config.num_kv_heads, config.head_dim),
        randn(num_tokens, config.num_kv_heads, config.head_dim),
    )


def random_decode_step(
    config: ModelConfig, pool: PagedKVCache, num_seqs: int, context_len: int, seed: int = 0
) -> AttentionStep:
    """`num_seqs` sequences of `context_len` tokens, the last one new."""
    return random_step(config, pool, [1] * num_seqs, [context_len] * num_seqs, seed)


def attention_step_timings(
    backends: list[str],
    pool: PagedKVCache,
    step: AttentionStep,
    num_layers: int,
    repeats: int,
    warmups: int = 1,
) -> Timings:
    """One step's attention on each of `backends`, timed in interleaved rounds
    (`bench/measure.py`): each backend built once per step and called `num_layers` times; the
    warm-up rounds compile or warm up and are left out."""
    device = pool.layers[0].device

    def one_step(backend_name: str):
        backend_class = get_attention_backend(backend_name).for_device(device)

        def run():
            attention = backend_class(pool, step.metadata)
            for _ in range(num_layers):
                attention(0, step.q, step.k, step.v)

        return run

    runs = {name: one_step(name) for name in backends}
    return interleaved(runs, repeats, warmups, synchronize=lambda: synchronize(device))


def decode_attention_timings(
    config: ModelConfig,
    backends: list[str],
    batches: list[int],
    contexts: list[int],
    dtype: torch.dtype,
    device: torch.device | str,
    repeats: int = 3,
    block_size: int = 16,
) -> dict[tuple[int, int], Timings]:
    """(batch, context) -> one decode step's attention on every backend, all layers, the
    backends interleaved in rounds (`attention_step_timings`)."""
    pool = one_layer_pool(config, max(batches), max(contexts), block_size, dtype, device)
    return {
        (num_seqs, context_len): attention_step_timings(
            backends,
            pool,
            random_decode_step(config, pool, num_seqs, context_len),
            config.num_layers,
            repeats,
        )
        for num_seqs in batches
        for context_len in contexts
    }
