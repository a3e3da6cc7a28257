"""`minivllm tour`: the book in one command.

It asks the embedded model a question through the offline API, then runs a small workload
with every chapter's method built so far and prints each one's speedup over chapter 01's
naive loop.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from minivllm.bench.benchmark import (
    BenchmarkContext,
    MethodResult,
    device_label,
    format_table,
    run_benchmark,
)
from minivllm.bench.workloads import throughput_workload
from minivllm.config import resolve_device
from minivllm.entrypoints.llm import LLM
from minivllm.sample.sampling_params import SamplingParams

TOUR_QUESTION = "What is the capital of France? Answer in one sentence."
# One method per chapter; transformers first, so "same tokens" compares against the oracle.
TOUR_METHODS = ["hf", "naive", "kv-cache", "static", "engine-no-prefix-cache", "engine"]


def run_tour(quick: bool = False, model: str | Path | None = None) -> list[MethodResult]:
    """Print the answer and the table; returns the benchmark results. `model` defaults to the
    embedded SmolLM2 (any local Llama-family directory works, the tests use a tiny one)."""
    start = time.perf_counter()
    # float32 (the dtype the tokens are checked in), on the GPU when there is one.
    device = resolve_device("auto")
    llm = LLM(model, dtype="float32", device=str(device))
    print(f"Loaded the model in {time.perf_counter() - start:.1f} s.\n")
    print(f"Q: {TOUR_QUESTION}")
    answer = llm.chat(
        [{"role": "user", "content": TOUR_QUESTION}],
        SamplingParams(temperature=0.0, max_tokens=48),
        use_tqdm=False,
    )
    print(f"A: {answer[0].outputs[0].text}\n")

    engine = llm.llm_engine
    model = engine.executor.driver_worker.model  # the other methods reuse the loaded weights
    ctx = BenchmarkContext(engine.model_path, model, engine.tokenizer, torch.float32, batch_size=8)
    num_requests, output_length = (4, 16) if quick else (8, 32)
    workload = throughput_workload(
        engine.tokenizer,
        num_requests=num_requests,
        prompt_lengths=(20, 120),
        output_length=output_length,
    )
    print(f"Workload: {workload.description}; {device_label()}, float32, greedy.")
    results = run_benchmark(ctx, workload, TOUR_METHODS)
    print(format_table(results, baseline="naive"))
    return results
