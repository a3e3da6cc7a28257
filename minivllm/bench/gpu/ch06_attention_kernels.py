"""Chapter 06 (notebooks/06-attention-kernels.ipynb) on a GPU: the attention backends.

The torch reference, flex and Triton on decode steps over batch x context and on a prefill
chunk; the Triton decode kernel's memory bandwidth against a device-to-device copy's; the engine
on each backend, in float32 and in bfloat16. The notebook's section "On a GPU" draws the
engines' output tokens/s and prints the rest; the figure here draws the decode steps' attention
across the grid.
"""

from __future__ import annotations

from functools import partial

import matplotlib.pyplot as plt
import torch

from minivllm.attention import triton_paged
from minivllm.bench.attention import attention_step_timings, decode_attention_timings
from minivllm.bench.gpu.common import (
    DTYPE,
    Chapter,
    Run,
    decode_attention_step,
    plot_spreads,
    prefill_chunk,
    spread_record,
    style,
)
from minivllm.bench.measure import Timings


def measure_attention_kernels(run: Run) -> Chapter:
    """JSON: decode_attention (per batch and context, each backend's ms of one step's
    attention over all layers, the backends interleaved in rounds) and prefill_attention (the
    same of the prefill chunk); triton_decode_bandwidth (`decode_bandwidth` on CUDA; null
    elsewhere: the interpreter's speed means nothing)."""
    sizes, config = run.sizes, run.model.config
    on_gpu = run.device.type == "cuda"
    backends = ["torch", "flex"] + (["triton"] if on_gpu or triton_paged.interpreting() else [])
    timings = decode_attention_timings(
        config, backends, list(sizes.kernel_batches), list(sizes.kernel_contexts), DTYPE,
        run.device, sizes.repeats,
    )  # fmt: skip
    decode_rows = [
        dict(batch=b, context=c) | ms_of(timed, backends) for (b, c), timed in timings.items()
    ]
    chunk = sizes.prefill_chunk
    pool, prefill = prefill_chunk(run)
    prefill_timings = attention_step_timings(
        backends, pool, prefill, config.num_layers, sizes.repeats
    )
    bandwidth = decode_bandwidth(run) if on_gpu else None

    workload = run.varied_workload()
    # Triton's interpreter (a quick run without a GPU) runs the kernels above, too slowly for
    # an engine's workload.
    engine_backends = [name for name in backends if on_gpu or name != "triton"]
    methods = [f"engine-no-prefix-cache:{name}" for name in engine_backends]
    # bfloat16 beside float32 on each backend; a quick run leaves out flex's, whose kernels
    # would compile once more for the other dtype (most of a quick run's time on a CPU).
    methods += [
        f"engine-no-prefix-cache:{name}@bfloat16"
        for name in engine_backends
        if not (run.quick and name == "flex")
    ]
    # A quick run keeps flex's shapes (compiled when an engine starts) few: decodes of 1 and 2
    # sequences, chunks of 16 tokens.
    limits = dict(max_num_seqs=2, max_num_batched_tokens=16) if run.quick else {}
    results = run.benchmark(run.context(engine_args=limits), workload, methods)

    measured = dict(
        backends=backends,
        decode_attention=decode_rows,
        prefill_attention=dict(chunk=chunk, cached=chunk) | ms_of(prefill_timings, backends),
        triton_decode_bandwidth=bandwidth,
    )
    fig = plot_decode_attention(run, backends, decode_rows)
    return Chapter("06-attention-kernels", workload, results, measured, figure=fig)


def plot_decode_attention(run: Run, backends: list[str], decode_rows: list[dict]) -> plt.Figure:
    """Each backend's attention per decode step against the context, a line per batch."""
    what = "Attention backends: one decode step over random K/V"
    fig, ax = run.figure(what, None, (8, 4.5))
    contexts = list(run.sizes.kernel_contexts)
    for name in backends:
        for batch in run.sizes.kernel_batches:
            rows = [row for row in decode_rows if row["batch"] == batch]  # in the contexts' order
            spreads = [row["ms_spread"][name] for row in rows]
            plot_spreads(ax, contexts, spreads, label=f"{name}, batch {batch}")
    ylabel = f"attention per decode step, {run.model.config.num_layers} layers (ms)"
    style(ax, "context per sequence (tokens)", ylabel, log2_ticks=contexts, log_y=True)
    ax.legend(fontsize=7, ncol=len(backends))
    return fig


def ms_of(timings: Timings, backends: list[str]) -> dict[str, dict]:
    """{ms: {backend: median ms}, ms_spread: {backend: {median, low, high}}} of one case."""
    spreads = {name: timings.spread(name) for name in backends}
    return dict(
        ms={name: spread.median * 1e3 for name, spread in spreads.items()},
        ms_spread={name: spread_record(spread, 1e3) for name, spread in spreads.items()},
    )


@torch.inference_mode()
def decode_bandwidth(run: Run) -> dict:
    """The Triton decode kernel alone at the grid's largest batch and context: K/V bytes read per
    second, against a device-to-device copy of as many bytes (read once, written once)."""
    sizes, config = run.sizes, run.model.config
    batch, context = max(sizes.kernel_batches), max(sizes.kernel_contexts)
    pool, step = decode_attention_step(run, batch, context)
    kv = pool.layers[0]
    splits = triton_paged.choose_num_splits(batch, config.num_kv_heads, context, run.device)
    bytes_read = 2 * batch * context * config.num_kv_heads * config.head_dim * kv.element_size()
    source = torch.empty(bytes_read, dtype=torch.uint8, device=run.device)
    target = torch.empty_like(source)
    kernel = partial(
        triton_paged.paged_decode_attention,
        step.q, kv, step.metadata.block_tables, step.metadata.seq_lens, splits,
    )  # fmt: skip
    kernel_s, copy_s = run.sweep({"kernel": kernel, "copy": partial(target.copy_, source)})
    gb_per_s = bytes_read / kernel_s.median / 1e9
    copy_gb_per_s = 2 * bytes_read / copy_s.median / 1e9
    return dict(
        batch=batch,
        context=context,
        num_splits=splits,
        gb_per_s=gb_per_s,
        copy_gb_per_s=copy_gb_per_s,
        share_of_copy=gb_per_s / copy_gb_per_s,
    )
