"""Chapter 07 — the model's layers split across tensor-parallel ranks (Megatron-style, with vLLM's
names).

A linear layer y = x W^T, with W of shape [out, in], splits over N ranks in two ways:

- **column-parallel**: each rank holds out/N rows of W and computes out/N of the outputs from
  the whole input. No communication: the outputs stay split.
- **row-parallel**: each rank holds in/N columns of W and multiplies them with *its slice* of
  the input, which is exactly what a column-parallel layer before it left on that rank. Each
  rank then holds a partial sum of the whole output; one all-reduce adds them up.

A transformer layer pairs them twice, so it communicates twice: attention (q, k, v
column-parallel by heads, each rank attending over its own heads; o_proj row-parallel) and the
MLP (gate/up column-parallel, the activation elementwise on each rank's slice; down
row-parallel). The vocabulary is split the same way: the embedding looks up the ids in its
rows and all-reduces (each id lives on exactly one rank), and the LM head computes the logits of
its rows, gathered on rank 0, which samples.

Every parameter carries a `weight_loader(param, checkpoint_tensor, shard_id)` that copies this
rank's part of one checkpoint tensor into it, so a rank never holds more than its share of the
model plus the one checkpoint tensor being read. With N = 1 every part is the whole, and these
are the plain layers of chapter 00.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel_state import SINGLE_PROCESS, TensorParallelGroup
from minivllm.models.linear import Linear, linear, pack_weight, weight_placeholder
from minivllm.models.quantization import Int8Weight
from minivllm.utils import cdiv


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """A parameter that is not split: the checkpoint tensor is the whole of it."""
    param.data.copy_(loaded_weight)


class ColumnParallelLinear(Linear):
    """y[:, rank's rows] = x W[rank's rows]^T: this rank's share of the outputs."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE_PROCESS,
    ):
        super().__init__(input_size, output_size // tp.size, bias=bias)
        self.tp = tp
        for param in self.parameters():
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        rows = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, self.tp.rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matrix (gate and up of the MLP): each
    rank stacks its share of each, so its local [gate_r; up_r] still splits in two halves."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE_PROCESS,
    ):
        super().__init__(input_size, sum(output_sizes), bias, tp)
        self.output_sizes = [size // tp.size for size in output_sizes]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int = 0
    ) -> None:
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v fused and split by heads: each rank gets num_heads / N query heads and the KV
    heads they read. With fewer KV heads than ranks, each KV head is copied onto N / num_kv_heads
    ranks (the ranks whose query heads share it)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE_PROCESS,
    ):
        self.q_size = num_heads // tp.size * head_dim
        self.kv_size = max(1, num_kv_heads // tp.size) * head_dim
        self.kv_head_replicas = max(1, tp.size // num_kv_heads)
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp.size, bias, tp)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str
    ) -> None:
        """Copy this rank's heads of the checkpoint's q, k or v matrix (shard_id) into place."""
        kv_rank = self.tp.rank // self.kv_head_replicas  # which KV-head share this rank holds
        offset, size, start = {
            "q": (0, self.q_size, self.tp.rank * self.q_size),
            "k": (self.q_size, self.kv_size, kv_rank * self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size, kv_rank * self.kv_size),
        }[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, start, size))


class RowParallelLinear(Linear):
    """y = sum over ranks of x_rank W[:, rank's columns]^T (+ bias once): the all-reduce.

    The bias is added once, after the sum. vLLM's RowParallelLinear counts it once the other
    way round: rank 0 passes it to its own matmul, before the all-reduce, and the other ranks
    pass none. Either way it is counted once."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TensorParallelGroup = SINGLE_PROCESS,
    ):
        super().__init__(input_size // tp.size, output_size, bias=bias)
        self.tp = tp
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias.weight_loader = default_weight_loader  # added once, after the sum

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        columns = param.shape[1]
        param.data.copy_(loaded_weight.narrow(1, self.tp.rank * columns, columns))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        out = self.tp.all_reduce(self.matmul(x))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """The embedding split by vocabulary rows: rank r holds ids [r * V/N, (r + 1) * V/N)
    (the last rank's share padded with zero rows when N does not divide V)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup = SINGLE_PROCESS
    ):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp = tp
        self.rows_per_rank = cdiv(num_embeddings, tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim))
        self.weight.weight_loader = self.weight_loader
        # This weight in oneDNN's layout, once `pack` has run (when it serves as the LM head).
        self.packed_weight: torch.Tensor | None = None
        # Chapter 12: the table in int8 instead, once `quantize` has run (lookups and logits).
        self.quantized: Int8Weight | None = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        rows = self.vocab_end - self.vocab_start
        param.data.zero_()  # padding rows stay zero
        param.data[:rows].copy_(loaded_weight[self.vocab_start : self.vocab_end])

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.rows(ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(input_ids)
        # Each id lives on one rank: look up ours, write zeros for the others', sum over ranks.
        elsewhere = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(elsewhere, 0)
        embedded = self.lookup(local_ids).masked_fill(elsewhere[:, None], 0.0)
        return self.tp.all_reduce(embedded)

    def pack(self) -> None:
        """A packed copy for `compute_logits` (the table is an LM head too, when tied); the
        plain table stays, for lookups."""
        if self.quantized is None and self.packed_weight is None:
            self.packed_weight = pack_weight(self.weight)

    def quantize(self, weight: Int8Weight) -> None:
        """Look up and multiply by `weight` from now on; the float table is dropped."""
        self.quantized = weight
        self.weight = None
        self.packed_weight = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Used as the LM head: the logits of this rank's vocabulary rows, gathered on rank 0
        into [n, vocab] (None on the other ranks)."""
        if self.quantized is not None:
            local_logits = self.quantized.matmul(hidden)
        else:
            local_logits = linear(hidden, self.weight, None, self.packed_weight)
        logits = self.tp.gather(local_logits, dim=-1)
        return None if logits is None else logits[:, : self.num_embeddings]


class ParallelLMHead(VocabParallelEmbedding):
    """An LM head of its own (untied models), split like the embedding; only its
    `compute_logits` is used."""

    def pack(self) -> None:
        """Only products read this matrix, so the packed copy is the only one (as in `Linear`)."""
        super().pack()
        if self.packed_weight is not None:
            self.weight = weight_placeholder(self.weight, self.packed_weight)
