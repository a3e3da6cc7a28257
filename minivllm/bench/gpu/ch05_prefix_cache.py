"""Chapter 05 (notebooks/05-prefix-caching.ipynb) on a GPU: what prefix caching saves.

The engine with and without prefix caching, in float32 and in bfloat16, on requests that share
a long system prompt: time to first token, throughput, prompt tokens computed. The notebook's
section "On a GPU" draws all three as what the cache saves (float32, next to its own): no figure
here.
"""

from __future__ import annotations

from minivllm.bench.gpu.common import Chapter, Run, quoted, result_speedup
from minivllm.bench.workloads import shared_prefix_workload

DTYPES = ("", "@bfloat16")  # each engine in the run's dtype, then in bfloat16


def measure_prefix_cache(run: Run) -> Chapter:
    """JSON: prefix_cache_hit_rate (the warm-up request's lookups included); ttft_ratio (each
    engine's median request in the last round); the ratios and prompt_tokens_computed are the
    float32 engines' (the bfloat16 rows of results are for speed)."""
    workload = shared_prefix_workload(
        run.tokenizer,
        run.sizes.prefix_requests,
        run.sizes.system_prompt_length,
        run.sizes.prefix_output,
    )
    ctx = run.context(engine_args=dict(max_num_batched_tokens=run.sizes.prefix_step_tokens))
    methods = [
        f"{name}{dtype}" for dtype in DTYPES for name in ("engine-no-prefix-cache", "engine")
    ]
    results = run.benchmark(ctx, workload, methods)
    off, on = results[:2]
    metrics = {m.name: m.value for m in ctx.engines["engine"].get_metrics()}
    hit_rate = metrics["vllm:prefix_cache_hits"] / metrics["vllm:prefix_cache_queries"]

    # On over off, round by round (the engines ran interleaved).
    throughput = result_speedup(results, "engine", "engine-no-prefix-cache")
    measured = dict(
        prefix_cache_hit_rate=hit_rate,
        ttft_ratio=off.median_ttft_s / on.median_ttft_s,
        **quoted("throughput_ratio", throughput),
        prompt_tokens_computed=dict(off=off.prompt_tokens_computed, on=on.prompt_tokens_computed),
    )
    return Chapter("05-prefix-cache", workload, results, measured)
