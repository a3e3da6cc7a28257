"""Chapter 12 — what an engine holds in memory, measured in a process of its own.

A process's resident memory (the pages it actually holds, Linux's VmRSS) is the number a laptop
runs out of, and it has parts no tensor count shows: PyTorch's and transformers' own code and
data, the tokenizer, whatever the C allocator keeps after a free. So each engine is built in a
fresh Python process (`python -m minivllm.bench.memory '<engine arguments as JSON>'`), generates
a few tokens, and reports:

- `resident_bytes`: the process's resident memory after that generate;
- `baseline_bytes`: the same process after importing minivllm (PyTorch included), before any
  engine: what every engine pays before its first weight;
- `weight_bytes`: the bytes of the weights the model multiplies by (packed, plain or quantized:
  whatever the layers hold, each copy counted once);
- `kv_cache_bytes` and `kv_cache_touched_bytes`: the pool, and the part of it requests wrote
  (the engine's `get_metrics`: on a CPU the rest of the pool is never made resident).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch


@dataclass
class EngineMemory:
    resident_bytes: int
    baseline_bytes: int
    weight_bytes: int
    kv_cache_bytes: int
    kv_cache_touched_bytes: int


def resident_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/status's VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmRSS line")


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight the model holds, each storage once: parameters (a packed layer's
    placeholder is one element), oneDNN's packed copies, and quantized weights."""
    storages: dict[int, int] = {}
    for parameter in model.parameters():
        storage = parameter.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    total = sum(storages.values())
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if packed is not None:  # an opaque oneDNN tensor: its logical size
            total += packed.numel() * packed.element_size()
        quantized = getattr(module, "quantized", None)
        if quantized is not None:
            total += quantized.nbytes
    return total


def _measure_here(engine_args: dict, max_tokens: int) -> EngineMemory:
    from minivllm import LLM, SamplingParams

    baseline = resident_bytes()
    llm = LLM(**engine_args)
    llm.generate(
        ["The capital of France is"],
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    metrics = {metric.name: metric.value for metric in llm.get_metrics()}
    model = llm.llm_engine.executor.driver_worker.model
    return EngineMemory(
        resident_bytes=resident_bytes(),
        baseline_bytes=baseline,
        weight_bytes=model_weight_bytes(model),
        kv_cache_bytes=int(metrics["minivllm:kv_cache_bytes"]),
        kv_cache_touched_bytes=int(metrics["minivllm:kv_cache_touched_bytes"]),
    )


def measure_engine_memory(engine_args: dict, max_tokens: int = 16) -> EngineMemory:
    """Build `LLM(**engine_args)` in a fresh process, generate `max_tokens` tokens, and report
    its memory (one engine, one process: nothing another engine freed is counted)."""
    result = subprocess.run(
        [sys.executable, "-m", "minivllm.bench.memory", json.dumps(engine_args), str(max_tokens)],
        capture_output=True,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    if result.returncode != 0:
        raise RuntimeError(f"the engine {engine_args} failed:\n{result.stderr[-2000:]}")
    return EngineMemory(**json.loads(result.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    memory = _measure_here(json.loads(sys.argv[1]), int(sys.argv[2]))
    print(json.dumps(asdict(memory)))
