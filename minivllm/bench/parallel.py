"""Chapter 07's measurements: run code on every rank of a group, and time what the ranks say to
each other.

`RankPool(size)` starts `size` processes joined in one torch.distributed group (gloo over
loopback) and runs module-level functions on all of them at once, `fn(tp, *args)` on each rank,
returning every rank's result. The notebook times all-reduces with it, and the tests check
each parallel layer against its unsplit counterpart on real ranks.

`allreduce_bytes_per_token` is the communication a split model needs, from its shapes alone.
"""

from __future__ import annotations

import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

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


def time_all_reduce(tp: TensorParallelGroup, num_elements: int, repeats: int = 20) -> float:
    """Median seconds of one all-reduce of `num_elements` float32 values (run on every rank)."""
    x = torch.ones(num_elements)
    tp.all_reduce(x)  # the first call sets up the connections' buffers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tp.all_reduce(x)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def allreduce_bytes_per_token(config: ModelConfig, element_size: int = 4) -> int:
    """Bytes one token's activations put through all-reduces in one forward of a
    tensor-parallel model: one hidden vector after attention and one after the MLP in every
    layer, plus one after the vocabulary-split embedding."""
    return (2 * config.num_layers + 1) * config.hidden_size * element_size
