"""Chapter 10 (notebooks/10-structured-outputs.ipynb) on a GPU: what a grammar costs.

The same chat requests answered freely and under a JSON schema (xgrammar's bitmask per sampled
row): output tokens/s of each, and the schema's compile time; a full run adds both in bfloat16.
The notebook prints the record; the figure draws the rates.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from minivllm.bench.gpu.common import (
    DTYPE,
    Chapter,
    Run,
    chat_requests,
    chat_workload,
    dtype_name,
    generate_tokens,
    quoted,
    rate_and_ratio,
)
from minivllm.bench.measure import Spread, stopwatch
from minivllm.bench.workloads import Workload
from minivllm.sample.sampling_params import SamplingParams, StructuredOutputsParams

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def measure_structured_outputs(run: Run) -> Chapter:
    """The grammar's cost is the bitmask each sampled row gets and the matchers advanced by each
    token. The schema's first compile is timed apart (xgrammar caches it).

    JSON: rows (`free_and_constrained`'s: float32, then in a full run bfloat16); ratio (schema /
    free tokens/s in float32, taken within rounds); compile_seconds (one run).
    """
    messages = [f"Describe person number {i} as JSON with a name and an age." for i in range(8)]
    requests, output = run.sizes.grammar_requests, run.sizes.grammar_output
    prompts = (chat_requests(run, messages) * requests)[:requests]
    description = f"{requests} chat requests for a person as JSON, greedy, at most {output} tokens"
    workload = chat_workload("json-person", prompts, output, description)
    rows, ratio, compile_seconds = free_and_constrained(run, workload, DTYPE)
    if not run.quick:  # a quick run checks float32 only: every engine costs a start
        rows += free_and_constrained(run, workload, torch.bfloat16)[0]
    print(
        f"schema compile {compile_seconds:.2f} s (one run); "
        + ", ".join(f"{r['mode']} {r['tokens_per_s']:.1f} tok/s" for r in rows)
        + f" ({ratio.format()}x)"
    )

    what = "Structured outputs: the grammar's cost"
    fig, ax = run.figure(what, workload, (8, 1.6 + 0.7 * len(rows)))
    bars = ax.barh([r["mode"] for r in rows], [r["tokens_per_s"] for r in rows], color="tab:purple")
    ax.bar_label(bars, [f" {r['tokens_per_s']:.1f}" for r in rows])
    ax.set_xlabel("output tokens per second")
    ax.invert_yaxis()
    measured = dict(rows=rows, **quoted("ratio", ratio), compile_seconds=compile_seconds)
    return Chapter("10-structured-outputs", workload, measured=measured, figure=fig)


def free_and_constrained(
    run: Run, workload: Workload, dtype: torch.dtype
) -> tuple[list[dict], Spread, float]:
    """One engine in `dtype` (its KV pool sized for the workload) answers the workload freely
    and under the schema, the two interleaved in `engine_repeats` rounds: a row for each
    ("@bfloat16" after the mode when not the run's dtype), the schema's rate over the free one
    round by round, and the seconds of the schema's first compile (a one-off)."""
    suffix = "" if dtype == DTYPE else "@" + dtype_name(dtype)
    llm = run.engine(workload, dtype, enforce_eager=run.quick)
    prompts = [{"prompt_token_ids": prompt} for prompt in workload.prompts]
    schema = StructuredOutputsParams(json=PERSON_SCHEMA)
    with stopwatch() as compile_watch:  # generate returns tokens on the host: no sync needed
        llm.generate(
            prompts[:1], SamplingParams(max_tokens=1, structured_outputs=schema), use_tqdm=False
        )
    greedy = SamplingParams(temperature=0.0, max_tokens=run.sizes.grammar_output)
    modes = {"free": greedy, "json schema": replace(greedy, structured_outputs=schema)}
    calls = {mode: partial(generate_tokens, llm, prompts, params) for mode, params in modes.items()}
    timings = run.engine_rounds(calls)
    rows = []
    for mode in modes:
        tokens = sum(map(len, timings.results[mode]))
        seconds = timings.spread(mode)
        row = dict(mode=mode + suffix, requests=len(prompts), output_tokens=tokens)
        rows.append(row | quoted("seconds", seconds) | dict(tokens_per_s=tokens / seconds.median))
    return rows, rate_and_ratio(timings, "json schema", "free")[1], compile_watch.seconds
