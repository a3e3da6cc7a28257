"""Chapter 11 (notebooks/11-the-cost-of-a-step.ipynb) on a GPU: the compiled step.

The engine eager against compiled with CUDA graphs (its default on a GPU), float32 and
bfloat16: one request decoding alone (batch 1, where launch overhead is the whole step) and the
varied-output workload.
"""

from __future__ import annotations

from minivllm.bench.gpu.common import Chapter, Run, speedup_records, stacked_throughput
from minivllm.bench.gpu_results import as_dicts
from minivllm.bench.workloads import throughput_workload


def measure_compiled_step(run: Run) -> Chapter:
    """JSON: results (the varied-output workload: "engine-no-prefix-cache:eager",
    "engine-no-prefix-cache:compiled" and both "@bfloat16"); batch1 (the same four methods on one
    request, each a result record); speedups {"batch1", "varied"} -> dtype -> compiled / eager
    (the median of the ratios within `engine_repeats` rounds) and speedup_spreads beside them
    ({median, low, high}).
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

    what = "Eager against compiled (CUDA graphs on a GPU)"
    fig = stacked_throughput(run, what, [(batch1, single), (results, varied)], 7)
    measured = dict(batch1=as_dicts(batch1), speedups=medians, speedup_spreads=spreads)
    return Chapter("11-compiled-step", varied, fig, results, measured)
