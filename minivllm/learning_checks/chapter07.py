"""Chapter 07's learning check: the row-parallel linear layer, run on simulated ranks.

The ranks here are threads of one process that share a tiny stand-in for the tensor-parallel
group (`ThreadRanks`): the same `rank`, `size` and `all_reduce` that `TensorParallelGroup` offers
over torch.distributed, so your function runs unchanged on real processes afterwards
(`minivllm.models.parallel_layers.RowParallelLinear`, tested over gloo in
tests/test_ch07_parallel_layers.py). Threads make the check quick and its failures easy to read.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check, show_values


class ThreadRanks:
    """`size` ranks as threads; `all_reduce` sums every rank's tensor into each, in place."""

    # A rank that calls all_reduce fewer times than the others (a learner's `if rank == 0:`
    # around it) would leave them waiting forever: past this many seconds the barrier breaks
    # and `run` says why. A correct all-reduce of the check's small tensors takes milliseconds.
    MEETING_TIMEOUT_S = 5.0

    def __init__(self, size: int):
        self.size = size
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=self.MEETING_TIMEOUT_S)

    def group(self, rank: int) -> RankView:
        return RankView(self, rank)

    def run(self, fn, args_per_rank: list[tuple]) -> list:
        """fn(*args, group) on every rank at once; the results in rank order."""
        results: list = [None] * self.size
        errors: list[BaseException] = []

        def run_rank(rank: int) -> None:
            try:
                results[rank] = fn(*args_per_rank[rank], self.group(rank))
            except BaseException as error:  # another rank may wait for this one: release it
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=run_rank, args=(r,)) for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:  # the rank that failed first, not the ones its abort released
            real_errors = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            if real_errors:
                raise real_errors[0]
            raise RuntimeError(
                f"the {self.size} ranks did not all reach all_reduce within "
                f"{self.MEETING_TIMEOUT_S:.0f} s: every rank must call all_reduce, the same "
                "number of times (a collective waits for the whole group)"
            )
        return results


class RankView:
    """What one rank sees of the group."""

    def __init__(self, ranks: ThreadRanks, rank: int):
        self.ranks, self.rank, self.size = ranks, rank, ranks.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.ranks.slots[self.rank] = x.clone()
        self.ranks.barrier.wait()  # every rank has put its part
        x.copy_(sum(self.ranks.slots))
        self.ranks.barrier.wait()  # every rank has read the parts before any reuses its slot
        return x


def _our_row_parallel_linear():
    from minivllm.models.parallel_layers import RowParallelLinear

    def row_parallel_linear(x_shard, weight_shard, bias, tp):
        out_features, in_shard = weight_shard.shape
        layer = RowParallelLinear(in_shard * tp.size, out_features, bias is not None, tp)
        with torch.no_grad():
            layer.weight.copy_(weight_shard)
            if bias is not None:
                layer.bias.copy_(bias)
            return layer(x_shard)

    return row_parallel_linear


@learning_check(
    "ch07.row_parallel_linear",
    signature="row_parallel_linear(x_shard: Tensor[tokens, in/N], weight_shard: Tensor[out, in/N], "
    "bias: Tensor[out] | None, tp) -> Tensor[tokens, out]: this rank's slice of the input times "
    "its columns of W, summed over the ranks with tp.all_reduce(t) (in place, returns t), plus "
    "the bias; tp.rank and tp.size say which rank of how many this is. Every rank returns the "
    "whole x @ W.T + bias.",
    reference=_our_row_parallel_linear,
)
def check_row_parallel_linear(row_parallel_linear) -> None:
    """Against the unsplit layer, F.linear(x, W, bias), on every simulated rank."""

    @check_settings(max_examples=25)
    @given(
        size=st.integers(1, 4),
        tokens=st.integers(1, 4),
        in_per_rank=st.integers(1, 4),
        out_features=st.integers(1, 5),
        with_bias=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    # Always two ranks with a bias: where a bias added on every rank is counted twice.
    @example(size=2, tokens=2, in_per_rank=2, out_features=3, with_bias=True, seed=0)
    def property_(size, tokens, in_per_rank, out_features, with_bias, seed):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, in_per_rank * size, generator=generator)
        weight = torch.randn(out_features, in_per_rank * size, generator=generator)
        bias = torch.randn(out_features, generator=generator) if with_bias else None
        expected = F.linear(x, weight, bias)
        columns = [slice(r * in_per_rank, (r + 1) * in_per_rank) for r in range(size)]
        args = [(x[:, c].clone(), weight[:, c].clone(), bias) for c in columns]
        results = ThreadRanks(size).run(row_parallel_linear, args)
        for rank, got in enumerate(results):
            if not (isinstance(got, torch.Tensor) and got.shape == expected.shape):
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise AssertionError(
                    f"rank {rank} returned {shape}, expected {tuple(expected.shape)}"
                )
            if not torch.allclose(got, expected, atol=1e-5, rtol=1e-5):
                raise AssertionError(
                    f"rank {rank} of {size}: expected x @ W.T + bias = {show_values(expected)}, "
                    f"got {show_values(got)}"
                )

    property_()
