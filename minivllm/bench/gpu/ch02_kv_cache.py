"""Chapter 02 (notebooks/02-kv-cache.ipynb) on a GPU: the KV cache and static batching.

Every method of chapters 01-02 side by side on whole requests (speedup over the no-cache
loop), static batching in bfloat16 beside float32; one decode step against the rows in the
batch; the memory a static batch reserves against what its requests need.
"""

from __future__ import annotations

import torch

from minivllm.baselines.kv_cache import generate_static_batch
from minivllm.bench.benchmark import BenchmarkContext, greedy_requests
from minivllm.bench.gpu.common import (
    DTYPE,
    Chapter,
    MiB,
    Run,
    dtype_name,
    plot_spreads,
    quoted,
    spread_record,
    style,
    time_decode_steps,
)
from minivllm.bench.gpu_results import plot_throughput
from minivllm.bench.measure import rate_spread
from minivllm.bench.workloads import throughput_workload
from minivllm.sample.sampler import Sampler


def measure_kv_cache(run: Run) -> Chapter:
    """JSON: results ("hf", "naive", "kv-cache", "static", "static@bfloat16" and "hf-static", one
    static batch of all requests; the bfloat16 row is for speed, its tokens may differ);
    decode_rows, decode_step_seconds (one decode step with decode_context cached tokens per row:
    the median of `repeats` rounds, the row counts interleaved), decode_step_seconds_spread
    (each one's {median, low, high}); kv_bytes_per_token {dtype: bytes}; static_batch
    {workload, reserved_kv_bytes (rows x longest prompt + longest output), needed_kv_bytes (each
    request's final length), decode_steps, computed_rows, useful_rows}.
    """
    sizes = run.sizes
    workload = throughput_workload(
        run.tokenizer, sizes.speedup_requests, (20, 300), sizes.speedup_output
    )
    ctx = run.context(batch_size=workload.num_requests)
    methods = ["hf", "naive", "kv-cache", "static", "static@bfloat16", "hf-static"]
    results = run.benchmark(ctx, workload, methods)
    decode = time_decode_steps(run, sizes.decode_rows, sizes.decode_context)
    static_batch = static_batch_memory(run, ctx)

    what = "The KV cache and static batching"
    fig, (ax1, ax2, ax3) = run.figure(what, workload, (17, 4.4), 1, 3)
    plot_throughput(results, "whole requests, one static batch", ax=ax1, baseline="naive")
    rows = list(sizes.decode_rows)
    # Tokens per second, round by round: a row makes one token a step.
    rates = [spread_record(rate_spread(r, step)) for r, step in zip(rows, decode)]
    plot_spreads(ax2, rows, rates, color="tab:green")
    ax2.set_ylim(bottom=0)
    title = f"one decode step, {sizes.decode_context} cached tokens per row"
    style(ax2, "rows in the decode batch", "generated tokens per second", title, rows)
    reserved, needed = static_batch["reserved_kv_bytes"], static_batch["needed_kv_bytes"]
    ax3.bar(
        ["reserved\n(rows × longest)", "needed\n(each request's length)"],
        [reserved / MiB, needed / MiB],
        color=["tab:red", "tab:blue"],
    )
    ax3.set_ylabel("KV cache memory (MiB)")
    useful = static_batch["useful_rows"] / static_batch["computed_rows"]
    ax3.set_title(
        f"one static batch of {static_batch['workload']}\n{needed / reserved:.0%} of the reserved"
        f" memory needed, {useful:.0%} of the decode rows useful",
        fontsize=9,
    )
    per_token = {
        dtype_name(d): run.model.config.kv_bytes_per_token(d)
        for d in (torch.float32, torch.bfloat16)
    }
    measured = dict(
        decode_rows=rows,
        decode_context=sizes.decode_context,
        **quoted("decode_step_seconds", decode),
        kv_bytes_per_token=per_token,
        static_batch=static_batch,
    )
    return Chapter("02-kv-cache", workload, fig, results, measured)


def static_batch_memory(run: Run, ctx: BenchmarkContext) -> dict:
    """Run the varied-output workload as one static batch and compare the KV memory it reserves
    with what its requests need at their final length."""
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
