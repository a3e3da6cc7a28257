"""Chapter 04 (notebooks/04-continuous-batching.ipynb) on a GPU: static against continuous
batching.

At equal seats, and against transformers' padded batches, on outputs of varied length; the
engine in float32 and in bfloat16. The notebook's section "On a GPU" draws the methods' output
tokens/s, as speedups over static batching: no figure here.
"""

from __future__ import annotations

from minivllm.bench.gpu.common import Chapter, Run


def measure_throughput(run: Run) -> Chapter:
    """JSON: results (every method at most `seats` sequences at once) and seats."""
    seats = run.sizes.seats
    workload = run.varied_workload()
    ctx = run.context(batch_size=seats, engine_args=dict(max_num_seqs=seats))
    engine = "engine-no-prefix-cache"
    methods = [f"hf-static:{seats}", f"static:{seats}", engine, f"{engine}@bfloat16"]
    results = run.benchmark(ctx, workload, methods)
    return Chapter("04-throughput", workload, results, dict(seats=seats))
