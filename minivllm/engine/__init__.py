"""The engine: requests in, steps through the scheduler and the executor, outputs out.

`LLMEngine` (chapter 04) is the engine itself; `AsyncLLM` (chapter 09) serves it to many
users at once, with its core, the loop that steps it, in a thread (core_client.InprocClient)
or in a process of its own (core.py, core_client.MPClient)."""

from __future__ import annotations


def make_engine(config):
    """The engine for an `EngineConfig`: an `LLMEngine` (chapter 04), or a `DataParallelEngine`
    (chapter 07) with the same calls when data_parallel_size > 1. Imported here, on demand, so
    that importing one engine module does not load the others."""
    if config.data_parallel_size > 1:
        from minivllm.engine.data_parallel import DataParallelEngine

        return DataParallelEngine.from_config(config)
    from minivllm.engine.llm_engine import LLMEngine

    return LLMEngine.from_config(config)
