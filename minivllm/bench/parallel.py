"""Chapter 07's measurements: run code on every rank of a group, and time what the ranks say to
each other.

`RankPool(size)` starts `size` processes joined in one torch.distributed group (gloo over
loopback) and runs module-level functions on all of them at once, `fn(tp, *args)` on each rank,
returning every rank's result. The notebook times all-reduces with it, and the tests check
each parallel layer against its unsplit counterpart on real ranks.

`allreduce_bytes_per_token` is the communication a split model needs, from its shapes alone;
`measure_all_reduce` times all-reduces of growing size and `fit_link` reads a latency and a
bandwidth off them. `projected_step` puts the two costs of a tensor-parallel decode step side by
side, the arithmetic and memory traffic that N ranks share (chapter 02's roofline, divided by
N) and the all-reduces that they add, to say when splitting a model pays off.
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.multiprocessing as mp

from minivllm.bench.measure import interleaved
from minivllm.bench.roofline import Machine, decode_step_cost
from minivllm.config import ModelConfig
from minivllm.distributed.parallel_state import (
    TensorParallelGroup,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from minivllm.executor.multiproc import fair_share_of_threads, free_port


@dataclass
class RankFailure:
    """What a rank sends back instead of a result when its function raised."""

    rank: int
    traceback: str


class RankPool:
    """`size` processes in one gloo group, each waiting for a function to run."""

    def __init__(self, size: int):
        context = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.size = size
        self.pipes, processes = [], []
        for rank in range(size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_serve,
                args=(rank, size, init_method, theirs, fair_share_of_threads(size)),
                daemon=True,
            )
            process.start()
            self.pipes.append(ours)
            processes.append(process)
        self._finalizer = weakref.finalize(self, _stop, self.pipes, processes)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(tp, *args)` on every rank at once (fn must be importable by name); the results
        in rank order. A rank that raises makes this raise with its traceback."""
        for pipe in self.pipes:
            pipe.send((fn, args))
        results = [pipe.recv() for pipe in self.pipes]
        failures = [r for r in results if isinstance(r, RankFailure)]
        if failures:
            raise RuntimeError(f"rank {failures[0].rank} raised:\n{failures[0].traceback}")
        return results

    def close(self) -> None:
        self._finalizer()


def _serve(rank: int, size: int, init_method: str, pipe, num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    tp = init_tensor_parallel(rank, size, init_method, torch.device("cpu"))
    while (message := pipe.recv()) is not None:
        fn, args = message
        try:
            pipe.send(fn(tp, *args))
        except Exception:
            pipe.send(RankFailure(rank, traceback.format_exc()))
    destroy_tensor_parallel()


def _stop(pipes, processes) -> None:
    for pipe in pipes:
        try:
            pipe.send(None)
        except OSError:
            pass
    for process in processes:
        process.join(5)
        if process.is_alive():
            process.kill()


def time_all_reduce(tp: TensorParallelGroup, num_elements: int, repeats: int = 50) -> float:
    """Median seconds of one all-reduce of `num_elements` float32 values (run on every rank).
    Single calls vary by an order of magnitude (a rank that the OS schedules late holds up the
    others), so the median of many is the number to trust."""
    x = torch.ones(num_elements)
    # Five untimed calls first: they set up the connections' buffers.
    timings = interleaved({"all_reduce": partial(tp.all_reduce, x)}, repeats, warmups=5)
    return timings.spread("all_reduce").median


def allreduce_bytes_per_token(config: ModelConfig, element_size: int = 4) -> int:
    """Bytes one token's activations put through all-reduces in one forward of a
    tensor-parallel model: one hidden vector after attention and one after the MLP in every
    layer, plus one after the vocabulary-split embedding."""
    return (2 * config.num_layers + 1) * config.hidden_size * element_size


def measure_all_reduce(pool: RankPool, element_counts: list[int], repeats: int = 50) -> list[dict]:
    """Median seconds of one float32 all-reduce of each size, on the pool's ranks: one row per
    size, {"bytes", "seconds"} (the slowest rank's median: the others wait for it)."""
    rows = []
    for count in element_counts:
        seconds = max(pool.run(time_all_reduce, count, repeats))
        rows.append({"bytes": 4 * count, "seconds": seconds})
    return rows


@dataclass
class Link:
    """How fast ranks talk: an all-reduce of n bytes takes latency + n / bandwidth."""

    name: str
    latency_s: float
    bandwidth: float  # bytes/s, as one all-reduce of a large message achieves it

    def all_reduce_seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth


def fit_link(name: str, rows: list[dict]) -> Link:
    """The link's two numbers read off measured (bytes, seconds) rows: the latency is the
    fastest message's time (small messages move next to nothing, and a late rank only ever
    makes a time longer), the bandwidth what the largest message adds on top of that latency.
    Not a least-squares line: timings of small messages scatter, and a line through them can
    come out with a negative slope."""
    latency = min(row["seconds"] for row in rows)
    largest = max(rows, key=lambda row: row["bytes"])
    extra = largest["seconds"] - latency
    return Link(name, latency, largest["bytes"] / extra if extra > 0 else float("inf"))


def ring_link(name: str, latency_s: float, link_bandwidth: float, num_ranks: int) -> Link:
    """A ring all-reduce over links of `link_bandwidth` bytes/s each way: every rank sends and
    receives 2 (N - 1) / N of the message, so a message moves at link_bandwidth * N / (2 (N - 1))."""
    return Link(name, latency_s, link_bandwidth * num_ranks / (2 * (num_ranks - 1)))


# Llama-3-8B's shapes, for `projected_step` (no weights: the projection is arithmetic). A decode step of it reads
# 16 GB of bfloat16 weights, which is what splitting a model over GPUs is for; the embedded
# model's 0.27 GB show the other side.
LLAMA3_8B = ModelConfig(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    rope_theta=500000.0,
)


@dataclass
class ProjectedStep:
    """One decode step of a model split over `tp` ranks, in seconds."""

    tp: int
    compute_s: float  # the roofline's time for the rank's 1/tp share of FLOPs and bytes
    communication_s: float  # the all-reduces

    @property
    def seconds(self) -> float:
        return self.compute_s + self.communication_s


def projected_step(
    config: ModelConfig,
    dtype: torch.dtype,
    batch_size: int,
    context_length: int,
    machine: Machine,
    tp: int,
    link: Link | None,
) -> ProjectedStep:
    """Each rank multiplies 1/tp of the weights and reads 1/tp of the weights and of the KV
    cache; then 2 x layers + 1 all-reduces of the batch's hidden states (which cannot overlap
    the arithmetic: the next layer needs their result)."""
    compute = decode_step_cost(config, dtype, batch_size, context_length).seconds_on(machine) / tp
    if tp == 1:
        return ProjectedStep(tp, compute, 0.0)
    element = torch.empty((), dtype=dtype).element_size()
    message = batch_size * config.hidden_size * element
    num_all_reduces = 2 * config.num_layers + 1
    return ProjectedStep(tp, compute, num_all_reduces * link.all_reduce_seconds(message))
