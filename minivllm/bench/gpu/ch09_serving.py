"""Chapter 09 (notebooks/09-serving.ipynb) on a GPU: the OpenAI server's latency under load.

`minivllm serve` runs in a process of its own (an interpreter and a GIL apart from the client's
timing) on the GPU; streaming completions arrive as a Poisson process at a few request rates,
from well below what the engine can do to all at once. Every rate gets prompts of its own and
the server runs without prefix caching, so no rate finds the prompts of an earlier one cached
and none is made cheaper by those before it. Per rate: requests completed and failed, the
throughput achieved, and at p50/p90/p99 the time to first token (TTFT), the time per output
token after the first (TPOT, one value per request) and the inter-token latency (ITL, every
gap between two tokens). The notebook's section "On a GPU" draws TTFT and ITL against the
throughput achieved, next to its own server's, and prints the rest; the figure here draws TPOT
the same way.
"""

from __future__ import annotations

import asyncio
import math
from functools import partial

import matplotlib.pyplot as plt

from minivllm.bench.gpu.common import DTYPE, Chapter, Run, dtype_name
from minivllm.bench.gpu_results import SERVING_LATENCIES, plot_latency_against_throughput
from minivllm.bench.serve import ServerProcess, run_at_rate, served_model, split_per_rate
from minivllm.bench.workloads import Workload, throughput_workload

PROMPT_LENGTHS = (20, 300)  # tokens, spread evenly over the requests of every rate
# On a GPU the server compiles its model and records its CUDA graphs before it answers /health:
# a minute or two when the compile cache is cold.
SERVER_START_TIMEOUT_S = 300


def measure_serving(run: Run) -> Chapter:
    """The server at each of `serve_rates`, `serve_requests` fresh requests a rate.

    JSON: rates, one `ServeBenchResult.as_dict()` per offered rate, in order."""
    sizes = run.sizes
    rates = list(sizes.serve_rates)
    workload, prompts_per_rate = fresh_prompts(run)
    args = server_args(run, prompts_per_rate)
    with ServerProcess(args, startup_timeout_s=SERVER_START_TIMEOUT_S) as server:
        at_rate = partial(run_at_rate, server.base_url, served_model(server.base_url))
        warm_up = [[1, 2, 3, 4]]  # the first request's one-time costs are no rate's
        asyncio.run(at_rate(warm_up, math.inf, 2, 60.0))
        rows = []
        for rate, prompts in zip(rates, prompts_per_rate):
            result = asyncio.run(at_rate(prompts, rate, sizes.serve_output, sizes.serve_seconds))
            rows.append(result.as_dict())
            print(
                f"rate {rate:g}/s: {result.num_completed}/{result.num_sent} completed, "
                f"{result.output_throughput:.1f} tok/s; p50 TTFT {result.ttft_ms['p50']:.1f} ms, "
                f"TPOT {result.tpot_ms['p50']:.2f} ms, ITL {result.itl_ms['p50']:.2f} ms"
            )

    measured = dict(
        rates=rows,
        max_num_seqs=sizes.serve_seats,
        max_seconds_per_rate=sizes.serve_seconds,
        prefix_caching=False,
        engine_core_process=engine_core_process(run),
    )
    fig = plot_tpot(run, workload, rows)
    return Chapter("09-serving", workload, measured=measured, figure=fig)


def plot_tpot(run: Run, workload: Workload, rows: list[dict]) -> plt.Figure:
    """The time per output token at each offered rate against the throughput achieved."""
    what = "Serving latency under Poisson arrivals, prefix caching off"
    fig, ax = run.figure(what, workload, (8, 4.4))
    plot_latency_against_throughput(ax, rows, "tpot_ms", f"minivllm serve, {run.model_name}")
    ax.set_title(SERVING_LATENCIES["tpot_ms"], fontsize=9)
    # A log scale needs positive times: a rate at which nothing completed has none.
    if all(row["tpot_ms"]["p50"] > 0 for row in rows):
        ax.set_yscale("log")
    return fig


def fresh_prompts(run: Run) -> tuple[Workload, list[list[list[int]]]]:
    """The whole workload, and its prompts cut into one slice per rate, none shared."""
    sizes = run.sizes
    rates, n = sizes.serve_rates, sizes.serve_requests
    everything = throughput_workload(
        run.tokenizer, n * len(rates), PROMPT_LENGTHS, sizes.serve_output
    )
    offered = ", ".join("all at once" if math.isinf(r) else f"{r:g}/s" for r in rates)
    workload = Workload(
        "poisson-serving",
        everything.prompts,
        everything.output_lengths,
        f"{n} fresh chat requests per rate ({offered}), prompts "
        f"{PROMPT_LENGTHS[0]}-{PROMPT_LENGTHS[1]} tokens, {sizes.serve_output} new tokens each, "
        "streamed",
    )
    return workload, split_per_rate(everything.prompts, len(rates))


def server_args(run: Run, prompts_per_rate: list[list[list[int]]]) -> list[str]:
    """`minivllm serve`'s flags: the run's model, dtype and device, prefix caching off, and a
    KV pool that holds every request of the largest rate at once (left to itself, the server
    would take most of a GPU that this process already uses, or 2 GiB of zeroed CPU memory)."""
    output = run.sizes.serve_output
    budget = max(
        run.kv_budget(Workload("one-rate", prompts, [output] * len(prompts), ""))
        for prompts in prompts_per_rate
    )
    args = [
        "--model", run.model_dir, "--dtype", dtype_name(DTYPE),
        "--device", run.device, "--max-num-seqs", run.sizes.serve_seats,
        "--kv-cache-memory-bytes", budget, "--no-enable-prefix-caching",
    ]  # fmt: skip
    return args + ([] if engine_core_process(run) else ["--no-engine-core-process"])


def engine_core_process(run: Run) -> bool:
    """The server's default steps its engine in a process of its own, as vLLM's does; a quick
    run steps it in the server's process: one interpreter to start instead of two, half the
    chapter's time on a CPU (chapter 09's tests cover the engine-core process)."""
    return not run.quick
