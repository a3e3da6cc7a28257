"""The GPU track of every chapter: find the records `make gpu-bench` wrote, and draw them.

The notebooks measure on the machine they run on; the committed outputs come from a 2-core CPU.
`make gpu-bench` (the package minivllm.bench.gpu) measures what each chapter measures on a CUDA
GPU and writes figures/gpu/<device>/NN-name.json per chapter (`write_json`'s record plus
"chapter", "model", "dtype", "quick", "seconds" and the chapter's own numbers). Each notebook
ends with a section "On a GPU" that loads its chapter's records with `load_gpu_results` and
plots them next to its own numbers, or says plainly that the chapter was not measured on a GPU
yet. A reader without a GPU thus sees the chapter's measurement on the kind of machine vLLM is
built for, next to the CPU's, as soon as someone has run the bench on one, and no notebook has
to know where the files are or how many devices there are.

Quick-mode records (`python -m minivllm.bench.gpu --quick`: a tiny random model, tiny sizes)
check the measurements' plumbing and measure nothing, so they are skipped.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from minivllm.bench.benchmark import MethodResult

# figures/gpu of the repository this package sits in (an editable install, as `make setup`).
GPU_RESULTS_DIR = Path(__file__).resolve().parents[2] / "figures" / "gpu"

# Bar colours by method name prefix, as in the notebooks and the GPU bench's figures:
# transformers, chapter 01's loop, chapter 02's cache and static batches, our engine.
METHOD_COLORS = {
    "hf": "tab:orange",
    "naive": "tab:gray",
    "kv-cache": "tab:blue",
    "static": "tab:green",
    "engine": "tab:purple",
}


def load_gpu_results(chapter: str, root: Path | None = None) -> list[dict]:
    """The records of `chapter` ("00", "04", ...) under `root`/<device>/, sorted by device.

    `root` defaults to the repository's figures/gpu; a notebook passes FIGURES / "gpu" so that
    it reads the figures folder it writes to. Records of quick runs are left out. Each record
    gets one more key, "path": the file it came from. No record: an empty list.
    """
    root = GPU_RESULTS_DIR if root is None else Path(root)
    records = []
    for path in sorted(root.glob(f"*/{chapter}-*.json")):
        record = json.loads(path.read_text())
        if record.get("quick", False):
            continue  # a check of the script at tiny sizes, not a measurement
        records.append(record | {"path": str(path)})
    return records


def record_title(record: dict) -> str:
    """One line naming where and how a record was measured: device, model, dtype, workload."""
    parts = [record.get("device", "unknown device")]
    parts += [record[key] for key in ("model", "dtype") if record.get(key)]
    workload = record.get("workload", {})
    line = " · ".join(parts)
    if workload:
        line += f"\n{workload['name']}: {workload['description']}"
    return line


def as_dicts(results: list[dict] | list[MethodResult]) -> list[dict]:
    """Benchmark results as the JSON records hold them: a dict per method, output_tokens_per_s
    included. Results measured in this process (`MethodResult`s) become such dicts too, so that
    a notebook's numbers and a GPU's are drawn by the same code."""
    return [
        r if isinstance(r, dict) else asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s}
        for r in results
    ]


def plot_throughput(
    results: list[dict] | list[MethodResult],
    title: str,
    ax: Axes | None = None,
    baseline: str | None = None,
) -> Figure:
    """Horizontal bars of output tokens/s per method, first method on top, each labelled with
    its speedup over `baseline` (a method name; the first method by default). Hatched: a method
    run in another dtype than the record's ("engine@bfloat16"). Draws on `ax` when given, else
    on a new figure; returns the figure."""
    results = as_dicts(results)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.4 + 0.6 * len(results)), layout="constrained")
    base_method = baseline or results[0]["method"]
    base = next(r for r in results if r["method"] == base_method)["output_tokens_per_s"]
    rates = [r["output_tokens_per_s"] for r in results]
    colors = [
        next(
            (color for prefix, color in METHOD_COLORS.items() if r["method"].startswith(prefix)),
            "tab:gray",
        )
        for r in results
    ]
    bars = ax.barh([r["label"] for r in results], rates, color=colors)
    for bar, r in zip(bars, results):
        bar.set_hatch("//" if "@" in r["method"] else "")
    ax.bar_label(bars, [f" {rate:.0f} tok/s, {rate / base:.2f}x" for rate in rates], fontsize=8)
    ax.invert_yaxis()  # the first method on top
    ax.set_xlim(0, max(rates) * 1.45)
    ax.set_xlabel("output tokens per second")
    ax.set_ylabel("method")
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=9)
    return ax.figure


def plot_gpu_throughput(
    record: dict, ax: Axes | None = None, baseline: str | None = None
) -> Figure:
    """The common case: a GPU record's methods as output-tokens/s bars, titled with the record's
    device, model, dtype and workload. Returns the figure."""
    return plot_throughput(record["results"], record_title(record), ax=ax, baseline=baseline)


# Chapter 09's latencies, by their key in a request rate's record: what each measures (a panel's
# title; its axis says "TTFT (ms)").
SERVING_LATENCIES = {
    "ttft_ms": "time to first token",
    "tpot_ms": "time per output token after the first",
    "itl_ms": "inter-token latency",
}


def plot_latency_against_throughput(ax: Axes, rates: list[dict], latency: str, label: str) -> None:
    """A server's `latency` ("ttft_ms", "tpot_ms" or "itl_ms") at each offered request rate
    against the output throughput it achieved there: p50 solid, p99 dashed in the same colour,
    each p50 point named by its offered rate. `rates` are chapter 09's records, one per rate (a
    GPU record's "rates", or `ServeBenchResult.as_dict()` of a run here); one call per server,
    `label` naming it, several on the same axis."""
    throughput = [rate["output_throughput"] for rate in rates]
    (line,) = ax.plot(throughput, [rate[latency]["p50"] for rate in rates], "o-", label=label)
    ax.plot(
        throughput,
        [rate[latency]["p99"] for rate in rates],
        "s--",
        color=line.get_color(),
        alpha=0.6,
    )
    for x, rate in zip(throughput, rates):
        offered = rate["request_rate"]
        name = "all at once" if math.isinf(offered) else f"{offered:g}/s"
        point = (x, rate[latency]["p50"])
        ax.annotate(name, point, xytext=(3, 3), textcoords="offset points", fontsize=7)
    ax.set_xlabel("output throughput achieved (tokens/s)")
    short = latency.removesuffix("_ms").upper()  # "TTFT": the long name is the panel's title
    ax.set_ylabel(f"{short} (ms), p50 solid, p99 dashed")
    ax.grid(alpha=0.3)
