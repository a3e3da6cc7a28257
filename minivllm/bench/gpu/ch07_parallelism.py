"""Chapter 07 (notebooks/07-parallelism.ipynb) on a GPU: tensor and data parallelism.

With 2+ GPUs, the engine alone against data parallel (DP=2) and tensor parallel (the smallest TP
the model's heads and the GPUs allow: SmolLM2's 9 query / 3 KV heads need TP=3) on chapter 04's
workload (greedy tokens compared), and NCCL all-reduces between 2 GPUs. With one GPU no engine
runs. On a CPU (--quick) the same engines, their ranks and replicas processes sharing the cores,
and gloo all-reduces between 2 processes. On every device: its decode step (this model in
bfloat16), matmul peak and memory bandwidth, and `projected_step` of this model and of a
Llama-3-8B shape at TP = 1..8 over a spec-sheet NVLink ring. The notebook prints the record;
the figure draws it.
"""

from __future__ import annotations

from dataclasses import asdict

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes

from minivllm.bench.benchmark import MethodResult, device_label, measure_matmul_peak
from minivllm.bench.gpu.common import (
    Chapter,
    Run,
    all_reduce_between_processes,
    dtype_name,
    engine_tensor_parallel_size,
    plot_spreads,
    spread_record,
    style,
    tensor_parallel_sizes,
    time_decode_steps,
)
from minivllm.bench.gpu_results import plot_throughput
from minivllm.bench.parallel import (
    LLAMA3_8B,
    Link,
    RankPool,
    fit_link,
    measure_all_reduce,
    projected_step,
    ring_link,
)
from minivllm.bench.roofline import Machine, measure_memory_bandwidth
from minivllm.bench.workloads import Workload
from minivllm.config import ModelConfig
from minivllm.models.loader import load_model

PROJECTION_DTYPE = torch.bfloat16  # what models are served in
PROJECTION_BATCHES = tuple(2**k for k in range(9))  # 1 to 256 sequences
# Each model is projected at those of these sizes that split its heads, as the engine would
# split them: SmolLM2's 9 query / 3 KV heads allow 1 and 3, Llama-3-8B's 32 / 8 allow 1, 2, 4, 8.
PROJECTION_TP_SIZES = (1, 2, 3, 4, 8)
DATA_PARALLEL_SIZE = 2  # fits any model: every replica holds all of it
NVLINK_NAME = "NVLink 4 (spec sheet, 450 GB/s each way; 10 µs latency assumed)"
BATCH_LABEL = "sequences in the decode batch"
TP_COLORS = {1: "tab:blue", 2: "tab:orange", 3: "tab:red", 4: "tab:green", 8: "tab:purple"}


def nvlink(tp: int) -> Link:
    """The projection's link: an all-reduce ring of `tp` GPUs over NVLink 4 (H100, H200) at the
    spec sheet's bandwidth. The latency is an assumption, not a measurement: NCCL's small
    all-reduces within one machine take some microseconds."""
    return ring_link(NVLINK_NAME, 10e-6, 450e9, tp)


def measure_parallelism(run: Run) -> Chapter:
    """JSON: results ("engine", "engine:dp=2", "engine:tp=N"; empty when no engine ran); skipped
    and tensor_parallel_skipped (why no engine, or no tensor-parallel one, ran; else null);
    all_reduce (`measure_rank_all_reduce`: empty on one GPU) and the link fitted to it, or null;
    machine (this device in bfloat16, measured); decode_steps (`measure_decode_steps`);
    projection (`project_tensor_parallel`, of this model and of a Llama-3-8B shape) and the
    NVLink rings it assumes, projection_links.
    """
    sizes = run.sizes
    num_gpus = torch.cuda.device_count()
    all_reduce_backend, all_reduce = measure_rank_all_reduce(run, num_gpus)
    link = fit_link(f"{all_reduce_backend} (measured)", all_reduce) if all_reduce else None

    notes: list[str] = []
    results: list[MethodResult] = []
    skipped = tp = tp_skipped = None
    if run.device.type == "cuda" and num_gpus < 2:
        skipped = tp_skipped = "tensor and data parallelism need 2+ GPUs"
        low, high = min(sizes.parallel_batches), max(sizes.parallel_batches)
        description = (
            f"bfloat16 decode steps of {low}-{high} rows x {sizes.parallel_context} cached "
            f"tokens (no engine run: {skipped})"
        )
        workload = Workload("decode-steps", [], [], description)
    else:
        tp, tp_skipped = engine_tensor_parallel_size(run, num_gpus)
        methods = ["engine", f"engine:dp={DATA_PARALLEL_SIZE}"]
        methods += [f"engine:tp={tp}"] if tp else []
        workload = run.varied_workload()
        results = compare_engines(run, workload, methods)
        if run.device.type == "cuda":  # the engine's replica_device and rank_config
            notes.append(
                "every data-parallel replica and tensor-parallel rank ran on a GPU of its own, "
                "counting from cuda:0"
            )

    machine = measure_machine(run)
    decode_steps = measure_decode_steps(run, machine)
    models = {run.model_name: run.model.config, "Llama-3-8B shape": LLAMA3_8B}
    projection = [
        row
        for name, config in models.items()
        for row in project_tensor_parallel(name, config, machine, sizes.parallel_context)
    ]
    tp_sizes = sorted({row["tp"] for row in projection} - {1})

    fig = plot_parallelism(run, workload, results, all_reduce, link, decode_steps, projection)
    measured = dict(
        num_gpus=num_gpus,
        skipped=skipped,
        tensor_parallel_size=tp,
        tensor_parallel_skipped=tp_skipped,
        notes=notes,
        all_reduce_backend=all_reduce_backend,
        all_reduce=all_reduce,
        link=None if link is None else asdict(link),
        machine=asdict(machine),
        decode_steps=decode_steps,
        projection_dtype=dtype_name(PROJECTION_DTYPE),
        projection_context=sizes.parallel_context,
        projection_links=[dict(tp=n, **asdict(nvlink(n))) for n in tp_sizes],
        projection=projection,
    )
    return Chapter("07-parallelism", workload, results, measured, figure=fig)


def compare_engines(run: Run, workload: Workload, methods: list[str]) -> list[MethodResult]:
    """The engine methods side by side, then every engine stopped: replicas and ranks are
    processes, and a tensor-parallel engine holds this process's torch.distributed group until
    it shuts down."""
    ctx = run.context()
    try:
        return run.benchmark(ctx, workload, methods)
    finally:
        for llm in ctx.engines.values():
            llm.llm_engine.shutdown()


def measure_rank_all_reduce(run: Run, num_gpus: int) -> tuple[str | None, list[dict]]:
    """All-reduce times between 2 ranks, one row per size as `measure_all_reduce` gives them:
    gloo between CPU processes (the package's `RankPool`, as the notebook measures), NCCL
    between 2 GPUs, and nothing on one GPU (NCCL needs a GPU per rank)."""
    counts, repeats = list(run.sizes.all_reduce_elements), run.sizes.all_reduce_repeats
    if run.device.type == "cpu":
        pool = RankPool(2)
        try:
            return "gloo, 2 CPU processes", measure_all_reduce(pool, counts, repeats)
        finally:
            pool.close()
    if num_gpus >= 2:
        return "NCCL, 2 GPUs", all_reduce_between_processes("nccl", counts, repeats)
    return None, []


def measure_machine(run: Run) -> Machine:
    """This device's two roofline numbers in the projection's dtype, measured: the best matrix
    product and a large copy."""
    dtype = dtype_name(PROJECTION_DTYPE)
    return Machine(
        f"{device_label()}, measured in {dtype}",
        peak_flops=measure_matmul_peak(PROJECTION_DTYPE, run.device, run.sizes.matmul_size),
        bandwidth=measure_memory_bandwidth(run.device, run.sizes.copy_megabytes),
    )


def measure_decode_steps(run: Run, machine: Machine) -> list[dict]:
    """One decode step of this model in the projection's dtype at each batch size, measured
    (the median of `repeats` rounds, the batches interleaved; measured_spread {median, low,
    high}) and projected at TP=1: how far eager PyTorch is from the roofline that the
    projection divides among the ranks."""
    model = load_model(run.model_dir, PROJECTION_DTYPE, run.device)
    context, batches = run.sizes.parallel_context, run.sizes.parallel_batches
    steps = time_decode_steps(run, batches, context, model)
    return [
        dict(
            batch=batch,
            measured_s=step.median,
            measured_spread=spread_record(step),
            projected_s=projected_step(
                model.config, PROJECTION_DTYPE, batch, context, machine, 1, None
            ).seconds,
        )
        for batch, step in zip(batches, steps)
    ]


def project_tensor_parallel(
    name: str, config: ModelConfig, machine: Machine, context: int
) -> list[dict]:
    """`projected_step` of `config` at each TP size that fits it and each batch size, with its
    speedup over one GPU at the same batch."""
    rows = []
    for tp in tensor_parallel_sizes(config, PROJECTION_TP_SIZES):
        link = nvlink(tp) if tp > 1 else None
        for batch in PROJECTION_BATCHES:
            step = projected_step(config, PROJECTION_DTYPE, batch, context, machine, tp, link)
            rows.append(
                dict(
                    model=name,
                    tp=tp,
                    batch=batch,
                    compute_s=step.compute_s,
                    communication_s=step.communication_s,
                    seconds=step.seconds,
                )
            )
    one_gpu = {row["batch"]: row["seconds"] for row in rows if row["tp"] == 1}
    for row in rows:
        row["speedup"] = one_gpu[row["batch"]] / row["seconds"]
    return rows


def plot_parallelism(
    run: Run,
    workload: Workload,
    results: list[MethodResult],
    all_reduce: list[dict],
    link: Link | None,
    decode_steps: list[dict],
    projection: list[dict],
) -> plt.Figure:
    """All-reduce time against message size; this model's decode step, measured and projected;
    each TP size's projected speedup against the batch; the engines' throughput if they ran."""
    what, panels = "Tensor and data parallelism", 4 if results else 3
    fig, axes = run.figure(what, workload, (22 if results else 17, 4.6), 1, panels)
    plot_all_reduce(axes[0], all_reduce, link)
    plot_decode_steps(axes[1], run, decode_steps, projection)
    plot_projected_speedup(axes[2], run, projection)
    if results:
        plot_throughput(results, "the engine, whole workload", ax=axes[3], baseline="engine")
    return fig


def plot_rows(
    ax: Axes, rows: list[dict], x: str, y: str, fmt: str = "o-", scale: float = 1.0, **look
) -> None:
    """Each row's `y` (times `scale`) against its `x`."""
    ax.plot([row[x] for row in rows], [row[y] * scale for row in rows], fmt, **look)


def plot_all_reduce(ax, all_reduce: list[dict], link: Link | None) -> None:
    # Each link's modelled all-reduce time (µs) over the messages: (link, line, colour, label).
    lines = [
        (nvlink(tp), "--", TP_COLORS[tp], f"ring of {tp} GPUs, {NVLINK_NAME}") for tp in (2, 8)
    ]
    if all_reduce:
        label = f"measured, {link.name.removesuffix(' (measured)')}"
        plot_rows(ax, all_reduce, "bytes", "seconds", "o", 1e6, color="black", label=label)
        fit = f"fit: {link.latency_s * 1e6:.0f} µs + bytes / {link.bandwidth / 1e9:.2f} GB/s"
        lines.insert(0, (link, "-", "black", fit))
    message = np.geomspace(2**8, 2**28, 60)  # bytes
    for modelled, line, color, label in lines:
        seconds = [modelled.all_reduce_seconds(n) * 1e6 for n in message]
        ax.plot(message, seconds, line, color=color, label=label)
    ax.set_xscale("log", base=2)
    measured = "measured between 2 ranks" if all_reduce else "none measured (one GPU)"
    xlabel, ylabel = "all-reduce message (bytes)", "time of one all-reduce (µs)"
    style(ax, xlabel, ylabel, f"all-reduce: {measured}", log_y=True, legend=6)


def plot_decode_steps(ax, run: Run, decode_steps: list[dict], projection: list[dict]) -> None:
    where = "1 GPU" if run.device.type == "cuda" else "this CPU"
    spreads = [row["measured_spread"] for row in decode_steps]
    batches = [row["batch"] for row in decode_steps]
    plot_spreads(ax, batches, spreads, 1e3, color="k", label=f"measured, {where}")
    ours = [row for row in projection if row["model"] == run.model_name]
    for tp in sorted({row["tp"] for row in ours}):
        rows = [row for row in ours if row["tp"] == tp]
        label = f"projected, TP={tp}" + (" (roofline)" if tp == 1 else " (+ all-reduces)")
        plot_rows(ax, rows, "batch", "seconds", "--", 1e3, color=TP_COLORS[tp], label=label)
    dtype = dtype_name(PROJECTION_DTYPE)
    title = f"{run.model_name}, {dtype}, {run.sizes.parallel_context} cached tokens per sequence"
    ylabel = "time of one decode step (ms)"
    style(ax, BATCH_LABEL, ylabel, title, PROJECTION_BATCHES, log_y=True, legend=7)


def plot_projected_speedup(ax, run: Run, projection: list[dict]) -> None:
    for model, line in ((run.model_name, ":"), ("Llama-3-8B shape", "-")):
        rows = [row for row in projection if row["model"] == model]
        for tp in sorted({row["tp"] for row in rows} - {1}):
            at_tp = [row for row in rows if row["tp"] == tp]
            look = dict(color=TP_COLORS[tp], marker="o", markersize=3, label=f"{model}, TP={tp}")
            plot_rows(ax, at_tp, "batch", "speedup", line, **look)
    ax.axhline(1, color="gray", linewidth=0.8)
    ax.set_yscale("log", base=2)
    dtype = dtype_name(PROJECTION_DTYPE)
    title = f"projection, {dtype}: this device's roofline / TP + NVLink all-reduces"
    ylabel = "projected decode-step speedup over 1 GPU (×)"
    style(ax, BATCH_LABEL, ylabel, title, PROJECTION_BATCHES, legend=7)
