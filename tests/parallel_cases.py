"""Chapter 07's layer checks, run on every rank of a `RankPool` (they must be importable by
name in the rank processes).

Each case builds the full (unsplit) weights from a seed, the same on every rank, loads the
rank's share into a parallel layer through its `weight_loader`, runs it, and returns the
largest difference from what the unsplit layer gives that rank: its slice of the outputs for a
column-parallel layer, the whole output for a row-parallel one or the embedding, the whole
logits on rank 0 for the LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.distributed.parallel_state import TensorParallelGroup
from minivllm.models.parallel_layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _load(layer, name: str, tensor: torch.Tensor, *shard_id) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, *shard_id)


def _difference(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    return (got - want).abs().max().item()


def column(tp: TensorParallelGroup, tokens, input_size, output_size, bias, seed) -> float:
    weight, b, x = (
        _randn(seed, output_size, input_size),
        _randn(seed + 1, output_size),
        _randn(seed + 2, tokens, input_size),
    )
    layer = ColumnParallelLinear(input_size, output_size, bias, tp)
    _load(layer, "weight", weight)
    if bias:
        _load(layer, "bias", b)
    full = F.linear(x, weight, b if bias else None)
    share = output_size // tp.size
    return _difference(layer(x), full[:, tp.rank * share : (tp.rank + 1) * share])


def merged_column(tp, tokens, input_size, output_sizes, seed) -> float:
    weights = [_randn(seed + i, size, input_size) for i, size in enumerate(output_sizes)]
    x = _randn(seed + 9, tokens, input_size)
    layer = MergedColumnParallelLinear(input_size, output_sizes, False, tp)
    for shard_id, weight in enumerate(weights):
        _load(layer, "weight", weight, shard_id)
    want = []
    for weight, size in zip(weights, output_sizes):
        share = size // tp.size
        want.append(F.linear(x, weight)[:, tp.rank * share : (tp.rank + 1) * share])
    return _difference(layer(x), torch.cat(want, dim=-1))


def qkv(tp, tokens, hidden, head_dim, num_heads, num_kv_heads, bias, seed) -> float:
    """Rank r must compute query heads [r*H/N, (r+1)*H/N) and the KV heads they read."""
    sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
    weights = {name: _randn(seed + i, size, hidden) for i, (name, size) in enumerate(sizes.items())}
    biases = {name: _randn(seed + 5 + i, size) for i, (name, size) in enumerate(sizes.items())}
    x = _randn(seed + 9, tokens, hidden)
    layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias, tp)
    for name in sizes:
        _load(layer, "weight", weights[name], name)
        if bias:
            _load(layer, "bias", biases[name], name)
    heads_per_rank = num_heads // tp.size
    query_heads = range(tp.rank * heads_per_rank, (tp.rank + 1) * heads_per_rank)
    group = num_heads // num_kv_heads  # query heads per KV head
    kv_heads = sorted({head // group for head in query_heads})
    want = []
    for name, heads in (("q", query_heads), ("k", kv_heads), ("v", kv_heads)):
        full = F.linear(x, weights[name], biases[name] if bias else None)
        want += [full[:, h * head_dim : (h + 1) * head_dim] for h in heads]
    return _difference(layer(x), torch.cat(want, dim=-1))


def row(tp, tokens, input_size, output_size, bias, seed) -> float:
    weight, b, x = (
        _randn(seed, output_size, input_size),
        _randn(seed + 1, output_size),
        _randn(seed + 2, tokens, input_size),
    )
    layer = RowParallelLinear(input_size, output_size, bias, tp)
    _load(layer, "weight", weight)
    if bias:
        _load(layer, "bias", b)
    share = input_size // tp.size
    x_share = x[:, tp.rank * share : (tp.rank + 1) * share]  # a column-parallel layer's output
    return _difference(layer(x_share), F.linear(x, weight, b if bias else None))


def embedding(tp, vocab_size, dim, ids, seed) -> float:
    weight = _randn(seed, vocab_size, dim)
    layer = VocabParallelEmbedding(vocab_size, dim, tp)
    _load(layer, "weight", weight)
    ids = torch.tensor(ids)
    return _difference(layer(ids), F.embedding(ids, weight))


def lm_head(tp, vocab_size, dim, tokens, seed) -> float | None:
    """Logits on rank 0 only; the other ranks return None and must get None."""
    weight, hidden = _randn(seed, vocab_size, dim), _randn(seed + 1, tokens, dim)
    layer = ParallelLMHead(vocab_size, dim, tp)
    _load(layer, "weight", weight)
    logits = layer.compute_logits(hidden)
    if not tp.is_driver:
        if logits is not None:
            raise AssertionError("a follower rank got logits")
        return None
    return _difference(logits, F.linear(hidden, weight))


def row_without_all_reduce(tp, tokens, input_size, output_size, seed) -> float:
    """A broken row-parallel layer (each rank keeps its partial sum): must differ."""
    weight, x = (
        _randn(seed, output_size, input_size * tp.size),
        _randn(seed + 2, tokens, input_size * tp.size),
    )
    share = weight[:, tp.rank * input_size : (tp.rank + 1) * input_size]
    partial = F.linear(x[:, tp.rank * input_size : (tp.rank + 1) * input_size], share)
    return _difference(partial, F.linear(x, weight))
