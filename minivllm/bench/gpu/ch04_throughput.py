"""Chapter 04 (notebooks/04-continuous-batching.ipynb) on a GPU: static against continuous
batching.

At equal seats, and against transformers' padded batches, on outputs of varied length; the
engine in float32 and in bfloat16.
"""

from __future__ import annotations

from minivllm.bench.gpu.common import Chapter, Run
from minivllm.bench.gpu_results import plot_throughput


def measure_throughput(run: Run) -> Chapter:
    """JSON: results ("hf-static:S", "static:S", "engine-no-prefix-cache",
    "engine-no-prefix-cache@bfloat16", S = seats; the engines run at most S sequences at once);
    seats.
    """
    seats = run.sizes.seats
    workload = run.varied_workload()
    ctx = run.context(batch_size=seats, engine_args=dict(max_num_seqs=seats))
    engine = "engine-no-prefix-cache"
    methods = [f"hf-static:{seats}", f"static:{seats}", engine, f"{engine}@bfloat16"]
    results = run.benchmark(ctx, workload, methods)

    what = f"Static vs continuous batching, at most {seats} sequences at once"
    fig, ax = run.figure(what, workload, (10, 1.2 + 0.7 * len(results)))
    plot_throughput(results, "", ax=ax, baseline=f"static:{seats}")
    return Chapter("04-throughput", workload, fig, results, dict(seats=seats))
