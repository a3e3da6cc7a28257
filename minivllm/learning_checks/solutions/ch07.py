"""Chapter 07's solution: the row-parallel linear layer."""

import torch.nn.functional as F


def row_parallel_linear(x_shard, weight_shard, bias, tp):
    # Each rank multiplies its slice of the input by its columns of W: a partial sum of the
    # whole output. The all-reduce adds the partial sums up on every rank.
    partial = F.linear(x_shard, weight_shard)
    out = tp.all_reduce(partial)
    # The bias is added once, after the sum (added on every rank first, it would count N times).
    return out if bias is None else out + bias
