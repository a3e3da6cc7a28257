"""Chapter 01 (notebooks/01-naive-generation.ipynb) on a GPU: the cost of generating without
a KV cache.

One no-cache step (a forward pass over the whole sequence, for one new token) against the
sequence length, then the no-cache loop against transformers' `generate` (which keeps a KV
cache) on whole requests. The notebook's section "On a GPU" draws both (the step's time against
the length, `generate`'s speedup over the loop): no figure here.
"""

from __future__ import annotations

from functools import partial
from random import Random

import torch

from minivllm.baselines.naive import CausalAttention
from minivllm.bench.gpu.common import Chapter, Run, quoted
from minivllm.bench.workloads import chat_prompt_of_length, throughput_workload


def measure_naive_cost(run: Run) -> Chapter:
    """JSON: step_seconds (one forward pass over step_lengths tokens, logits of the last one,
    the lengths interleaved in rounds) and results: "hf", then "naive"."""
    lengths = list(run.sizes.step_lengths)
    long_prompt = chat_prompt_of_length(run.tokenizer, max(lengths), Random(0))

    @torch.inference_mode()
    def one_step(length: int) -> torch.Tensor:
        ids = torch.tensor(long_prompt[:length], device=run.device)
        positions = torch.arange(length, device=run.device)
        hidden = run.model(ids, positions, CausalAttention([0, length]))
        return run.model.compute_logits(hidden[-1:])

    steps = quoted("step_seconds", run.sweep({n: partial(one_step, n) for n in lengths}))
    workload = throughput_workload(
        run.tokenizer, run.sizes.naive_requests, (20, 300), run.sizes.naive_output
    )
    results = run.benchmark(run.context(), workload, ["hf", "naive"])
    return Chapter("01-cost-vs-length", workload, results, dict(step_lengths=lengths) | steps)
