"""Chapter 02 (notebooks/02-kv-cache.ipynb) on a GPU: the KV cache and static batching.

Every method of chapters 01-02 side by side on whole requests (speedup over the no-cache
loop), static batching in bfloat16 beside float32; one decode step against the rows in the
batch; the memory a static batch reserves against what its requests need. The notebook's
section "On a GPU" draws the methods and the decode step; the figure here draws the static
batch's memory, which it does not.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from minivllm.baselines.kv_cache import generate_static_batch
from minivllm.bench.benchmark import BenchmarkContext, greedy_requests
from minivllm.bench.gpu.common import (
    DTYPE,
    Chapter,
    MiB,
    Run,
    dtype_name,
    quoted,
    time_decode_steps,
)
from minivllm.bench.workloads import throughput_workload
from minivllm.sample.sampler import Sampler


def measure_kv_cache(run: Run) -> Chapter:
    """JSON: results (each method on one static batch of all requests; the bfloat16 row is for
    speed, its tokens may differ); decode_step_seconds (one decode step of each of decode_rows,
    the row counts interleaved in rounds); static_batch (`static_batch_memory`)."""
    sizes = run.sizes
    workload = throughput_workload(
        run.tokenizer, sizes.speedup_requests, (20, 300), sizes.speedup_output
    )
    ctx = run.context(batch_size=workload.num_requests)
    methods = ["hf", "naive", "kv-cache", "static", "static@bfloat16", "hf-static"]
    results = run.benchmark(ctx, workload, methods)
    decode = time_decode_steps(run, sizes.decode_rows, sizes.decode_context)
    static_batch = static_batch_memory(run, ctx)
    per_token = {
        dtype_name(d): run.model.config.kv_bytes_per_token(d)
        for d in (torch.float32, torch.bfloat16)
    }
    measured = dict(
        decode_rows=list(sizes.decode_rows),
        decode_context=sizes.decode_context,
        **quoted("decode_step_seconds", decode),
        kv_bytes_per_token=per_token,
        static_batch=static_batch,
    )
    fig = plot_static_batch(run, static_batch)
    return Chapter("02-kv-cache", workload, results, measured, figure=fig)


def static_batch_memory(run: Run, ctx: BenchmarkContext) -> dict:
    """Run the varied-output workload as one static batch and compare the KV memory it reserves
    (every row as long as the longest prompt and output) with what its requests need at their
    final length; the decode rows it computed, and how many of them a request still needed."""
    workload = run.varied_workload()
    stats = generate_static_batch(run.model, greedy_requests(ctx, workload), Sampler())
    final_lengths = [len(p) + n for p, n in zip(workload.prompts, workload.output_lengths)]
    return dict(
        workload=workload.description,
        reserved_kv_bytes=stats.reserved_kv_bytes,
        needed_kv_bytes=sum(final_lengths) * run.model.config.kv_bytes_per_token(DTYPE),
        decode_steps=stats.decode_steps,
        computed_rows=stats.computed_rows,
        useful_rows=stats.useful_rows,
    )


def plot_static_batch(run: Run, static_batch: dict) -> plt.Figure:
    """The KV memory a static batch reserves against what its requests need."""
    what = "The KV memory of one static batch"
    fig, ax = run.figure(what, None, (7, 4.4))
    reserved, needed = static_batch["reserved_kv_bytes"], static_batch["needed_kv_bytes"]
    ax.bar(
        ["reserved\n(rows × longest)", "needed\n(each request's length)"],
        [reserved / MiB, needed / MiB],
        color=["tab:red", "tab:blue"],
    )
    ax.set_ylabel("KV cache memory (MiB)")
    useful = static_batch["useful_rows"] / static_batch["computed_rows"]
    ax.set_title(
        f"one static batch of {static_batch['workload']}\n{needed / reserved:.0%} of the reserved"
        f" memory needed, {useful:.0%} of the decode rows useful",
        fontsize=9,
    )
    return fig
