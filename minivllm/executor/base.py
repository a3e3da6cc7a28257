"""Chapter 04 — the executor: how the engine reaches its workers, wherever they run.

The engine speaks to one object whatever the hardware: "run this method on every worker and
give me the results" (`collective_rpc`, vLLM's name). With one device the worker lives in the
engine's own process (`UniProcExecutor`, below); tensor parallelism (chapter 07,
`executor/multiproc.py`) has workers in other processes, behind the same three calls:

    num_blocks = executor.determine_num_kv_blocks()
    executor.initialize_kv_cache(num_blocks)
    runner_output = executor.execute_model(scheduler_output)   # rank 0's result

Everything that crosses is plain data (`SchedulerOutput` in, `ModelRunnerOutput` out), so
the same calls work over a pipe or a network.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from minivllm.config import EngineConfig
from minivllm.core.scheduler_output import SchedulerOutput
from minivllm.outputs import ModelRunnerOutput
from minivllm.worker.worker import Worker


class Executor(ABC):
    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call `method(*args)` on every worker; their results in rank order."""

    def determine_num_kv_blocks(self) -> int:
        """Every worker's pool must hold the same blocks: the smallest budget wins."""
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes over every worker (each rank holds its share of heads)."""
        return sum(self.collective_rpc("kv_cache_bytes_per_block"))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every worker; rank 0 samples, so its output is the step's."""
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers and whatever they hold."""


class UniProcExecutor(Executor):
    """One worker, in the engine's process: a method call is a plain call."""

    def __init__(self, config: EngineConfig, model_path: Path):
        self.driver_worker = Worker(config, model_path)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args)]

    def shutdown(self) -> None:
        """Nothing to release: the worker lives and ends with the engine's process."""
