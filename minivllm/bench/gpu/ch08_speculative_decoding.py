"""Chapter 08 (notebooks/08-speculative-decoding.ipynb) on a GPU: speculative decoding.

Plain decoding against n-gram speculation (k = 3 and 5 draft tokens) and a layer-skip draft,
greedy: copying and free-writing requests at batch 1 (speedup, equal tokens, acceptance per
draft position), then the copying requests at batch 1-64, plain against k = 3. A full run adds
plain and k = 3 in bfloat16 at batch 1. The engines run without prefix caching: the copies of a
paragraph in a batch would otherwise share their prompt, and what is measured here is decoding.
The notebook prints the record; the figure draws the speedups.
"""

from __future__ import annotations

from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import torch

from minivllm.bench.gpu.common import (
    DTYPE,
    Chapter,
    Run,
    chat_requests,
    chat_workload,
    dtype_name,
    error_bars,
    generate_tokens,
    plot_spreads,
    quoted,
    rate_and_ratio,
    style,
)
from minivllm.bench.workloads import Workload
from minivllm.entrypoints.llm import LLM
from minivllm.sample.sampling_params import SamplingParams

# The notebook's requests: a paragraph to copy word for word (the n-gram proposer finds the
# next words in the prompt) and free writing (it finds little to copy).
PARAGRAPHS = (
    "The committee met on Tuesday to review the budget for the new library. After a long "
    "discussion, the members agreed to fund the children's section, the reading room and a small "
    "cafe, and to postpone the renovation of the archive until next year.",
    "To reset the router, unplug it for thirty seconds, plug it back in, and wait until the green "
    "light stops blinking. If the light stays orange, hold the reset button for ten seconds and "
    "try again.",
    "Mix the flour, the sugar and a pinch of salt in a large bowl. Add the eggs one at a time, "
    "then the melted butter, and stir until the batter is smooth. Bake for twenty-five minutes at "
    "180 degrees.",
    "The museum opens at nine in the morning and closes at six in the evening, except on Mondays. "
    "Tickets can be bought at the entrance or online, and children under twelve enter for free.",
)
STORIES = (
    "Write a short story about a lighthouse keeper.",
    "Describe a walk through a forest in autumn.",
    "Tell me about the history of bicycles.",
    "Write a poem about the sea at night.",
)
# The notebook's settings: n-gram drafts of k tokens (matches of 2-4 tokens, the defaults), and
# a layer-skip draft of the first 80% of the target's layers (24 of SmolLM2-135M's 30).
SPECULATIVE = {f"ngram k={k}": {"method": "ngram", "num_speculative_tokens": k} for k in (3, 5)}
SPECULATIVE["layer skip 80% k=3"] = {"method": "layer_skip", "num_speculative_tokens": 3}
LAYER_SKIP_SHARE = 0.8
SWEEP_METHOD = "ngram k=3"  # the one the batch sweep runs against plain decoding
# A full run times these in bfloat16 too, at batch 1, for speed; a quick run checks float32
# only (each engine loads a model of its own).
BFLOAT16_METHODS = ("plain", SWEEP_METHOD)


def measure_speculative_decoding(run: Run) -> Chapter:
    """Every comparison runs the engines interleaved in `engine_repeats` rounds.

    JSON: batch1 (rows {workload, method, tokens_per_s, speedup: over plain on the same
    workload, same_tokens: as plain's}, "plain@bfloat16" and "ngram k=3@bfloat16" in a full
    run, compared with plain in bfloat16); acceptance_per_position {"method/workload": [share of
    verification steps that kept the draft at position 0, 1, ..]} from the engine's counters
    over one pass of the workload; verification_steps {"method/workload": steps of that pass
    that checked drafts (0 where the proposer found no match, as on the quick run's random
    model)}; batch_sweep (plain against speculative_method at each batch).
    """
    sizes = run.sizes
    workloads = {
        "copying": chat_requests(
            run, ["Copy this text exactly, word for word:\n\n" + text for text in PARAGRAPHS]
        ),
        "free writing": chat_requests(run, list(STORIES)),
    }
    largest = max(sizes.spec_batches)
    sweep_prompts = {b: (workloads["copying"] * largest)[:b] for b in sizes.spec_batches}
    engines = speculative_engines(run, sweep_prompts[largest], DTYPE, ["plain", *SPECULATIVE])
    if not run.quick:
        engines |= speculative_engines(
            run, sweep_prompts[largest], torch.bfloat16, list(BFLOAT16_METHODS)
        )

    greedy = SamplingParams(temperature=0.0, max_tokens=sizes.spec_output)
    batch1, acceptance, verification_steps = [], {}, {}
    for workload, prompts in workloads.items():
        # Each engine's counters are read (untimed) before each of its passes over the
        # workload, so that the last reading and the one after the rounds bound one pass.
        before: dict[str, dict[str, float]] = {}
        timings = run.engine_rounds(
            {method: partial(generate_tokens, llm, prompts, greedy, alone=True)
             for method, llm in engines.items()},
            prepare={method: partial(read_counters, before, method, llm)
                     for method, llm in engines.items()},
        )  # fmt: skip
        for method, llm in engines.items():
            setting, _, dtype = method.partition("@")
            plain = "plain" + (f"@{dtype}" if dtype else "")  # the same dtype's plain engine
            rate, speedup = rate_and_ratio(timings, method, plain)
            if setting != "plain":
                after, k = spec_counters(llm), SPECULATIVE[setting]["num_speculative_tokens"]
                key = f"{method}/{workload}"
                acceptance[key] = acceptance_per_position(before[method], after, k)
                verification_steps[key] = counter_delta(before[method], after, DRAFTS)
            same_tokens = timings.results[method] == timings.results[plain]
            row = dict(workload=workload, method=method) | quoted("tokens_per_s", rate)
            batch1.append(row | quoted("speedup", speedup) | dict(same_tokens=same_tokens))
            print(f"batch 1, {workload}, {method}: {rate.format(1)} tokens/s ({speedup.format()}x)")

    batch_sweep = []
    for batch, prompts in sweep_prompts.items():
        timings = run.engine_rounds(
            {name: partial(generate_tokens, engines[name], prompts, greedy)
             for name in ("plain", SWEEP_METHOD)}
        )  # fmt: skip
        speculative, ratio = rate_and_ratio(timings, SWEEP_METHOD, "plain")
        plain, _ = rate_and_ratio(timings, "plain", "plain")
        medians = dict(plain_tokens_per_s=plain.median, speculative_tokens_per_s=speculative.median)
        batch_sweep.append(dict(batch=batch) | medians | quoted("ratio", ratio))
        rates = f"plain {plain.format(1)}, {SWEEP_METHOD} {speculative.format(1)}"
        print(f"batch {batch}: {rates} tokens/s")

    n = len(PARAGRAPHS)
    description = (
        f"{n} chat requests to copy a paragraph word for word and {len(STORIES)} to write "
        f"freely, greedy, at most {sizes.spec_output} tokens each"
    )
    every_prompt = [prompt for prompts in workloads.values() for prompt in prompts]
    workload = chat_workload("copy-and-free-write", every_prompt, sizes.spec_output, description)
    measured = dict(
        max_tokens=sizes.spec_output,
        batch1=batch1,
        acceptance_per_position=acceptance,
        verification_steps=verification_steps,
        batch_sweep=batch_sweep,
        speculative_method=SWEEP_METHOD,
    )
    fig = plot_speculative_decoding(run, workload, batch1, batch_sweep)
    return Chapter("08-speculative-decoding", workload, measured=measured, figure=fig)


def speculative_engines(
    run: Run, largest_batch: list[dict], dtype: torch.dtype, names: list[str]
) -> dict[str, LLM]:
    """The engines of `names` ("plain" or a key of SPECULATIVE) in `dtype`, by name (with
    "@bfloat16" when not the run's dtype), each with a KV pool sized for the largest batch
    (every engine loads its own copy of the model: left to themselves, they would each take
    most of a GPU, or 2 GiB of zeroed CPU memory)."""
    most_drafts = max(s["num_speculative_tokens"] for s in SPECULATIVE.values())
    # The verification step writes the drafts' KV too: room for them past the last token.
    largest = chat_workload("largest-batch", largest_batch, run.sizes.spec_output + most_drafts, "")
    suffix = "" if dtype == DTYPE else "@" + dtype_name(dtype)
    engines = {}
    num_layers = run.model.config.num_layers
    for name in names:
        config, layers = SPECULATIVE.get(name), num_layers  # config None: plain decoding
        if config is not None and config["method"] == "layer_skip":
            # The draft's layers keep K/V of their own: a block costs that much more.
            draft_layers = min(max(1, round(LAYER_SKIP_SHARE * num_layers)), num_layers - 1)
            config = config | {"num_draft_layers": draft_layers}
            layers += draft_layers
        pool_bytes = run.kv_budget(largest, dtype) * layers // num_layers
        engines[name + suffix] = run.engine(
            largest, dtype, speculative_config=config, enable_prefix_caching=False,
            kv_cache_memory_bytes=pool_bytes,
        )  # fmt: skip
    return engines


def spec_counters(llm: LLM) -> dict[str, float]:
    """The engine's speculative-decoding counters (cumulative since it was built)."""
    return {m.name: m.value for m in llm.get_metrics() if "spec_decode" in m.name}


DRAFTS = "vllm:spec_decode_num_drafts"  # verification steps: steps that checked drafts
ACCEPTED_AT = 'vllm:spec_decode_num_accepted_tokens_per_pos{{position="{}"}}'  # drafts kept at i


def counter_delta(before: dict, after: dict, name: str) -> float:
    """What a counter gained between two readings (absent: not counted yet)."""
    return after.get(name, 0) - before.get(name, 0)


def acceptance_per_position(before: dict, after: dict, k: int) -> list[float]:
    """Of the verification steps between the two readings, the share that kept draft i. A
    draft is kept only after every earlier one was, so the shares cannot grow with i."""
    drafts = counter_delta(before, after, DRAFTS)
    return [counter_delta(before, after, ACCEPTED_AT.format(i)) / max(drafts, 1) for i in range(k)]


def read_counters(readings: dict, method: str, llm: LLM) -> None:
    """Keep the engine's counters as they stand before its next pass (untimed)."""
    readings[method] = spec_counters(llm)


def plot_speculative_decoding(
    run: Run, workload: Workload, batch1: list[dict], batch_sweep: list[dict]
) -> plt.Figure:
    what = "Speculative decoding with n-gram drafts, greedy"
    fig, (ax1, ax2) = run.figure(what, workload, (12, 4.2), 1, 2)
    workloads = list(dict.fromkeys(row["workload"] for row in batch1))
    methods = [
        m for m in dict.fromkeys(row["method"] for row in batch1) if m.partition("@")[0] != "plain"
    ]
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        rows = {row["workload"]: row for row in batch1 if row["method"] == method}
        x = np.arange(len(workloads)) + (i - (len(methods) - 1) / 2) * width
        spreads = error_bars([rows[w]["speedup_spread"] for w in workloads])
        speedups = [rows[w]["speedup"] for w in workloads]
        bars = ax1.bar(x, speedups, width, yerr=spreads, capsize=3, label=method)
        ax1.bar_label(bars, [f"{rows[w]['speedup']:.2f}x" for w in workloads], fontsize=8)
    ax1.axhline(1, color="gray", linewidth=0.8)
    highest = max(row["speedup_spread"]["high"] for row in batch1)
    ax1.set_ylim(0, highest * 1.15)  # room for the labels
    ax1.set_xticks(range(len(workloads)), [f"{w} requests" for w in workloads])
    ylabel = "output tokens/s, speculative / plain (×)"
    style(ax1, "", ylabel, "batch 1: each request alone", legend=8, grid="y")

    batches = [row["batch"] for row in batch_sweep]
    spreads = [row["ratio_spread"] for row in batch_sweep]
    plot_spreads(ax2, batches, spreads, label=f"{SWEEP_METHOD} / plain")
    ax2.axhline(1, color="gray", linewidth=0.8)
    title = "copying requests, all submitted at once"
    style(ax2, "copying requests in the batch", ylabel, title, batches, legend=8)
    return fig
