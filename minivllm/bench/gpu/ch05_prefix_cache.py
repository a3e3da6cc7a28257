"""Chapter 05 (notebooks/05-prefix-caching.ipynb) on a GPU: what prefix caching saves.

The engine with and without prefix caching, in float32 and in bfloat16, on requests that share
a long system prompt: time to first token, throughput, prompt tokens computed.
"""

from __future__ import annotations

from minivllm.bench.gpu.common import Chapter, Run, quoted, result_speedup, style
from minivllm.bench.workloads import shared_prefix_workload

DTYPES = ("", "@bfloat16")  # each engine in the run's dtype, then in bfloat16


def measure_prefix_cache(run: Run) -> Chapter:
    """JSON: results ("engine-no-prefix-cache", "engine", then both "@bfloat16": median_ttft_s,
    prompt_tokens_computed, output_tokens_per_s among their fields); prefix_cache_hit_rate (prompt
    tokens found cached over those looked up, the warm-up request's included); ttft_ratio (off /
    on, each the median request's in the last round); throughput_ratio (on / off, the median of
    the ratios within `engine_repeats` rounds) and throughput_ratio_spread;
    prompt_tokens_computed {off, on}: these of the float32 engines (the bfloat16 rows are for
    speed: compare them in results).
    """
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
    pairs = list(zip(results[::2], results[1::2]))  # (off, on) of each dtype
    panels = [
        ("time to first token, median (s)", "median_ttft_s"),
        ("output tokens per second", "output_tokens_per_s"),
        ("prompt tokens computed", "prompt_tokens_computed"),
    ]
    what = f"Prefix caching (hit rate {hit_rate:.0%})"
    fig, axes = run.figure(what, workload, (16, 4.2), 1, 3)
    for ax, (label, attribute) in zip(axes, panels):
        names, values, texts = [], [], []
        for without, with_cache in pairs:
            off_value, on_value = getattr(without, attribute), getattr(with_cache, attribute)
            names += [f"prefix cache off\n{without.dtype}", f"prefix cache on\n{with_cache.dtype}"]
            values += [off_value, on_value]
            texts += [f"{off_value:.3g}", f"{on_value:.3g} ({on_value / off_value:.2f}x)"]
        bars = ax.bar(names, values, color=["tab:gray", "tab:purple"] * len(pairs))
        ax.bar_label(bars, texts, fontsize=8)
        ax.set_ylim(0, max(values) * 1.2)
        ax.tick_params(axis="x", labelsize=8)
        style(ax, "", label, grid="y")
    measured = dict(
        prefix_cache_hit_rate=hit_rate,
        ttft_ratio=off.median_ttft_s / on.median_ttft_s,
        **quoted("throughput_ratio", throughput),
        prompt_tokens_computed=dict(off=off.prompt_tokens_computed, on=on.prompt_tokens_computed),
    )
    return Chapter("05-prefix-cache", workload, fig, results, measured)
