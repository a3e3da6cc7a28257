"""Chapter 01b (notebooks/01b-decoding.ipynb) on a GPU: what decoding choices add to a step.

The sampler alone on random logits over the model's vocabulary, per setting (greedy,
temperature, top-k, top-p, min-p, penalties, a seed) and rows in the batch. The notebook prints
the record; the figure draws it, a bar per setting and rows.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from minivllm.bench.gpu.common import Chapter, Run, quoted, style
from minivllm.bench.workloads import Workload
from minivllm.sample.sampler import Sampler, SamplingRow, make_generator
from minivllm.sample.sampling_params import SamplingParams

SAMPLER_SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top-k 50": SamplingParams(temperature=0.8, top_k=50),
    "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "min-p 0.1": SamplingParams(temperature=0.8, min_p=0.1),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5),
    "seeded": SamplingParams(temperature=0.8, seed=0),
}


def sampling_rows(params: SamplingParams, rows: int) -> list[SamplingRow]:
    """`rows` rows of one setting, each with 64 tokens of history (and, seeded, a generator of
    its own)."""
    history = list(range(64))
    seeded = params.seed is not None  # `if params.seed` would take seed 0 for no seed
    return [
        SamplingRow(params, history, history, make_generator(0) if seeded else None)
        for _ in range(rows)
    ]


def measure_sampler_cost(run: Run) -> Chapter:
    """Milliseconds of a sampler call per setting and rows, the settings interleaved in
    rounds."""
    vocab = run.model.config.vocab_size
    generator = torch.Generator(device=run.device).manual_seed(0)
    sampler = Sampler(default_generator=generator)
    rows_ms = []
    for rows in run.sizes.sampler_batches:
        logits = torch.randn(rows, vocab, device=run.device, generator=generator)
        calls = {
            setting: partial(sampler, logits, sampling_rows(params, rows))
            for setting, params in SAMPLER_SETTINGS.items()
        }
        for setting, seconds in zip(calls, run.sweep(calls)):
            rows_ms.append(dict(setting=setting, rows=rows) | quoted("ms", seconds, 1e3))
    print("\n".join(f"{r['setting']:>16}, {r['rows']:>4} rows: {r['ms']:.3f} ms" for r in rows_ms))

    workload = Workload(
        "sampler-rows", [], [], f"random logits over {vocab} tokens, 64 tokens of history a row"
    )
    what = "The sampler's cost per step, by decoding setting"
    fig, ax = run.figure(what, workload, (10, 4))
    batches, x = run.sizes.sampler_batches, np.arange(len(SAMPLER_SETTINGS))
    width = 0.8 / len(batches)
    for i, rows in enumerate(batches):
        ms = [r["ms"] for r in rows_ms if r["rows"] == rows]  # in the settings' order
        ax.bar(x + i * width, ms, width, label=f"{rows} rows")
    ax.set_xticks(x + width * (len(batches) - 1) / 2, list(SAMPLER_SETTINGS))
    style(ax, "", "milliseconds per sampler call", log_y=True, legend=10, grid="y")
    measured = dict(sampler_ms=rows_ms, vocab_size=vocab)
    return Chapter("01b-sampler-cost", workload, measured=measured, figure=fig)
