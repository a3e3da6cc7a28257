"""Chapter 11 (notebooks/11-the-cost-of-a-step.ipynb) on a GPU: the compiled step.

The engine eager against compiled with CUDA graphs (its default on a GPU), float32 and
bfloat16: one request decoding alone (batch 1, where launch overhead is the whole step) and the
varied-output workload. The notebook's section "On a GPU" draws the varied workload's output
tokens/s and prints both speedups; the figure here draws batch 1's.
"""

from __future__ import annotations

from minivllm.bench.gpu.common import Chapter, Run, speedup_records
from minivllm.bench.gpu_results import as_dicts, plot_throughput
from minivllm.bench.workloads import throughput_workload


def measure_compiled_step(run: Run) -> Chapter:
    """JSON: results (the varied-output workload) and batch1 (the same methods on one request);
    speedups {"batch1", "varied"} -> dtype -> compiled / eager, the ratios taken within rounds.
    """
    # A quick run checks the plumbing in float32 only: each compiled engine costs a compile.
    dtypes = ("",) if run.quick else ("", "@bfloat16")
    methods = [
        f"engine-no-prefix-cache:{setting}{dtype}"
        for dtype in dtypes
        for setting in ("eager", "compiled")
    ]
    single = throughput_workload(run.tokenizer, 1, output_length=run.sizes.single_output)
    varied = run.varied_workload()
    batch1 = run.benchmark(run.context(), single, methods)
    results = run.benchmark(run.context(), varied, methods)

    pairs = {
        dtype.removeprefix("@") or "float32": (
            f"engine-no-prefix-cache:compiled{dtype}",
            f"engine-no-prefix-cache:eager{dtype}",
        )
        for dtype in dtypes
    }
    medians, spreads = speedup_records(dict(batch1=batch1, varied=results), pairs)

    what = "Eager against compiled (CUDA graphs on a GPU), batch 1"
    fig, ax = run.figure(what, single, (10, 1.4 + 0.6 * len(batch1)))
    plot_throughput(batch1, "", ax=ax)
    measured = dict(batch1=as_dicts(batch1), speedups=medians, speedup_spreads=spreads)
    return Chapter("11-compiled-step", varied, results, measured, figure=fig)
