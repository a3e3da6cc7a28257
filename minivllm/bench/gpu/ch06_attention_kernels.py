"""Chapter 06 (notebooks/06-attention-kernels.ipynb) on a GPU: the attention backends.

The torch reference, flex and Triton on decode steps over batch x context and on a prefill
chunk; the Triton decode kernel's memory bandwidth against a device-to-device copy's; the engine
on each backend, in float32 and in bfloat16.
"""

from __future__ import annotations

from functools import partial

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
from minivllm.bench.gpu_results import plot_throughput
from minivllm.bench.measure import Timings


def measure_attention_kernels(run: Run) -> Chapter:
    """JSON: results (the engine on each backend, varied-output workload: methods
    "engine-no-prefix-cache:NAME", then "engine-no-prefix-cache:NAME@bfloat16", for speed);
    backends; decode_attention (a list of {batch, context, ms: {backend: ms of one step's
    attention, all layers, the median of `repeats` rounds, the backends interleaved}, ms_spread:
    {backend: {median, low, high}}}); prefill_attention {chunk, cached, ms: {backend: ms},
    ms_spread}; triton_decode_bandwidth ({batch, context, gb_per_s, copy_gb_per_s,
    share_of_copy}, each from the median of rounds interleaving the kernel and the copy, on
    CUDA; null elsewhere: the interpreter's speed means nothing).
    """
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

    fig, (left, right) = run.figure("Attention backends", workload, (14, 4.5), 1, 2)
    contexts = list(sizes.kernel_contexts)
    for name in backends:
        for b in sizes.kernel_batches:
            spreads = [spread_record(timings[b, c].spread(name)) for c in contexts]
            plot_spreads(left, contexts, spreads, 1e3, label=f"{name}, batch {b}")
    ylabel = f"attention per decode step, {config.num_layers} layers (ms)"
    style(left, "context per sequence (tokens)", ylabel, log2_ticks=contexts, log_y=True)
    left.legend(fontsize=7, ncol=len(backends))
    plot_throughput(results, "the engine on each backend", ax=right, baseline=methods[0])
    measured = dict(
        backends=backends,
        decode_attention=decode_rows,
        prefill_attention=dict(chunk=chunk, cached=chunk) | ms_of(prefill_timings, backends),
        triton_decode_bandwidth=bandwidth,
    )
    return Chapter("06-attention-kernels", workload, fig, results, measured)


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
