"""The book's measurements on one CUDA GPU: every chapter's, in one run of a few minutes.

    make gpu-bench                               # HF_HUB_OFFLINE=1 python scripts/gpu_bench.py
    python scripts/gpu_bench.py --out DIR        # write somewhere else than figures/gpu/
    python scripts/gpu_bench.py --quick          # tiny sizes, any device: checks that it runs
    python scripts/gpu_bench.py --chapters 06,11 # only those chapters

The notebooks measure on the machine they run on (a 2-core CPU for the committed outputs). This
script measures what each chapter measures on a GPU, with the embedded SmolLM2-135M-Instruct in
float32 (the dtype in which our tokens equal transformers'; chapter 04 adds a bfloat16 engine),
and everything it runs comes from the package (`run_benchmark`, the shared workloads, the
chapters' modules). Per chapter:

    00 logits            our logits against transformers' on chat prompts of 20-1000 tokens:
                         the largest difference per prompt, a histogram of all of them
    01 cost-vs-length    one no-cache step (a forward pass over the whole sequence) against the
                         sequence length; the no-cache loop against transformers' `generate`
    02 kv-cache          every method of chapters 01-02 side by side (speedup over the no-cache
                         loop); one decode step against the rows in the batch; the memory a
                         static batch reserves against what its requests need
    03 memory-waste      the engine run step by step: KV memory holding tokens, in paged blocks
                         against a contiguous reservation per request; paged decode attention
                         against the block size
    04 throughput        static against continuous batching at equal seats, and against
                         transformers' padded batches, on outputs of varied length
    05 prefix-cache      the engine with and without prefix caching on requests that share a
                         long system prompt: time to first token, throughput, prompt tokens
                         computed
    06 attention-kernels the attention backends (torch reference, flex, Triton) on decode steps
                         over batch x context and on a prefill chunk; the Triton decode
                         kernel's memory bandwidth; the engine on each backend
    07 parallelism       with 2+ GPUs, the engine alone against data parallel (DP=2) and tensor
                         parallel (TP=3: the model's heads need it) on chapter 04's workload,
                         and NCCL all-reduces between 2 GPUs; with one GPU, its decode step,
                         matmul peak and memory bandwidth; on any device, the projected
                         tensor-parallel decode step of this model and of a Llama-3-8B shape at
                         TP = 1-8 over a spec-sheet NVLink ring
    08 speculative-decoding
                         plain decoding against n-gram speculation (k = 3 and 5 draft tokens),
                         greedy: copying and free-writing requests at batch 1 (speedup, equal
                         tokens, acceptance per draft position), then the copying requests at
                         batch 1-64, plain against k = 3
    01b sampler-cost     the sampler's time per step on random logits over the model's vocabulary,
                         per setting (greedy, temperature, top-k, top-p, min-p, penalties, a
                         seed) and rows in the batch: what decoding choices add to a step
    10 structured-outputs
                         the same chat requests answered freely and under a JSON schema
                         (xgrammar's bitmask per sampled row): output tokens/s of each and
                         the schema's compile time
    11 compiled-step     the engine eager against compiled with CUDA graphs (its default on a
                         GPU), float32 and bfloat16: one request decoding alone (batch 1, where
                         launch overhead is the whole step) and the varied-output workload

Each chapter writes two files under OUT/<device>/ (OUT is figures/gpu by default, <device> the
GPU's name as a slug): NN-name.json and NN-name.png, e.g. figures/gpu/nvidia-h200/04-throughput.
Each chapter runs in isolation: one that raises writes NN.error.json (its error and traceback)
instead of its files, and the others still run; the script then exits with status 1 naming the
chapters that failed. The JSON is `write_json`'s record, the same as `minivllm bench` writes: "workload" (name,
description), "device", "results" (one entry per method `run_benchmark` timed: every
`MethodResult` field and output_tokens_per_s; empty for chapters 00, 03 and 08, and for 07 on
one GPU), and then "chapter", "model", "dtype", "quick", "seconds" (wall time of the chapter) and
the chapter's own measurements (see each `measure_*` function). Each notebook's GPU section globs
figures/gpu/*/NN-*.json, skips files whose "quick" is true, and plots what it finds next to
its own CPU numbers; without such a file the section says so and moves on.

On a CPU the full sizes would take hours, and the notebooks' full mode already measures a CPU,
so without --quick the script refuses to run there. --quick runs every chapter at tiny sizes on
a tiny random model (two layers, the embedded tokenizer), in about a minute on a 2-core CPU, and
writes to a temporary directory unless --out is given: the tests run it so that it cannot rot.
Its numbers check the plumbing, they measure nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from random import Random

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.attention import triton_paged
from minivllm.attention.backend import AttentionMetadata, PagedKVCache
from minivllm.attention.torch_paged import TorchPagedAttention
from minivllm.baselines.kv_cache import ContiguousKVCache, generate_static_batch
from minivllm.baselines.naive import CausalAttention
from minivllm.bench.attention import (
    attention_step_seconds,
    one_layer_pool,
    random_decode_step,
    random_step,
    sweep_decode_attention,
)
from minivllm.bench.benchmark import (
    BenchmarkContext,
    MethodResult,
    best_time,
    device_label,
    format_table,
    greedy_requests,
    measure_matmul_peak,
    run_benchmark,
    workload_kv_cache_bytes,
    write_json,
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
from minivllm.bench.workloads import (
    Workload,
    chat_prompt_of_length,
    shared_prefix_workload,
    throughput_workload,
    varied_output_workload,
)
from minivllm.config import EngineConfig, ModelConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.llm import LLM
from minivllm.executor.multiproc import free_port
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.loader import embedded_model_dir, load_model, load_tokenizer
from minivllm.models.tiny import make_tiny_model
from minivllm.sample.sampler import Sampler, SamplingRow, make_generator
from minivllm.sample.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.tokenizer import apply_chat_template
from minivllm.utils import cdiv

DTYPE = torch.float32
SCRIPT_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = SCRIPT_DIR.parent / "figures" / "gpu"
MiB = 2**20


@dataclass(frozen=True)
class Sizes:
    """How much each chapter measures."""

    logit_prompts: int  # ch00: chat prompts whose logits are compared with transformers'
    logit_prompt_lengths: tuple[int, int]  # shortest and longest of them, tokens
    step_lengths: tuple[int, ...]  # ch01: sequence lengths of one no-cache step
    naive_requests: int  # ch01: requests of the no-cache loop against `generate`
    naive_output: int  # ch01: tokens each of them generates
    speedup_requests: int  # ch02: requests of the methods side by side (one static batch)
    speedup_output: int
    decode_rows: tuple[int, ...]  # ch02: rows of the decode-step sweep
    decode_context: int  # ch02: cached tokens per row in that sweep
    varied_requests: int  # ch02-04: the varied-output workload
    varied_outputs: tuple[int, int]
    seats: int  # ch04: sequences at once, static batches and the engine alike
    block_sizes: tuple[int, ...]  # ch03: block sizes of the paged decode-attention sweep
    attention_seqs: int  # ch03: sequences in that sweep
    attention_seq_len: int  # ch03: tokens of each
    prefix_requests: int  # ch05: the shared-prefix workload
    system_prompt_length: int
    prefix_output: int
    # ch05: the engines' token budget per step. Requests admitted in the same step cannot hit
    # each other's blocks (they are cached once computed), so the budget must not admit them all.
    prefix_step_tokens: int
    kernel_batches: tuple[int, ...]  # ch06: decode batches of the attention-backend grid
    kernel_contexts: tuple[int, ...]  # ch06: context lengths of that grid, tokens
    prefill_chunk: int  # ch06: new tokens of the timed prefill chunk (after as many cached)
    all_reduce_elements: tuple[int, ...]  # ch07: float32 values of each timed all-reduce
    all_reduce_repeats: int  # ch07: all-reduces per size; the median counts
    parallel_batches: tuple[int, ...]  # ch07: rows of the measured decode steps
    parallel_context: int  # ch07: cached tokens per row, there and in the projection
    matmul_size: int  # ch07: side of the square products that measure the matmul peak
    copy_megabytes: int  # ch07: size of the copy that measures the memory bandwidth
    spec_output: int  # ch08: most tokens each request generates (a copy ends on its own)
    spec_batches: tuple[int, ...]  # ch08: copying requests at once in the batch sweep
    single_output: int  # ch11: tokens the one batch-1 request decodes
    sampler_batches: tuple[int, ...]  # ch01b: rows of logits the sampler picks from at once
    grammar_requests: int  # ch10: requests answered with and without a JSON schema
    grammar_output: int  # ch10: most tokens each of them generates
    repeats: int  # timed repetitions of a micro-benchmark; the fastest counts


# About three minutes on an H200 by an estimate of eager PyTorch's per-step cost there, not yet
# a measurement: the JSON records each chapter's seconds.
GPU_SIZES = Sizes(
    logit_prompts=8,
    logit_prompt_lengths=(20, 1000),
    step_lengths=(16, 64, 128, 256, 512, 1024, 2048),
    naive_requests=4,
    naive_output=128,
    speedup_requests=16,
    speedup_output=32,
    decode_rows=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    decode_context=128,
    varied_requests=64,
    varied_outputs=(16, 256),
    seats=16,
    block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    attention_seqs=64,
    attention_seq_len=1024,
    prefix_requests=64,
    system_prompt_length=1000,
    prefix_output=16,
    prefix_step_tokens=2048,  # the engine's default: one or two of the ~1030-token prompts
    kernel_batches=(1, 16, 64),
    kernel_contexts=(512, 2048, 4096),
    prefill_chunk=2048,
    all_reduce_elements=tuple(4**k for k in range(4, 14)),  # 1 KiB to 256 MiB
    all_reduce_repeats=20,
    parallel_batches=(1, 4, 16, 64, 256),
    parallel_context=1024,
    matmul_size=8192,  # 1 TFLOP a product: long enough for the clock, as a 2048 one is not
    copy_megabytes=1024,
    spec_output=96,  # a paragraph's copy is 40-60 tokens: it ends before
    spec_batches=(1, 4, 16, 32, 64),
    single_output=128,
    sampler_batches=(1, 32, 256),
    grammar_requests=32,
    grammar_output=64,
    repeats=5,
)

QUICK_SIZES = Sizes(
    logit_prompts=3,
    logit_prompt_lengths=(20, 120),
    step_lengths=(16, 64, 128),
    naive_requests=2,
    naive_output=6,
    speedup_requests=3,
    speedup_output=6,
    decode_rows=(1, 2, 4),
    decode_context=32,
    varied_requests=6,
    varied_outputs=(4, 16),
    seats=3,
    block_sizes=(1, 4, 16),
    attention_seqs=4,
    attention_seq_len=64,
    prefix_requests=4,
    system_prompt_length=200,
    prefix_output=4,
    prefix_step_tokens=128,
    kernel_batches=(1, 2),
    kernel_contexts=(32, 64),
    prefill_chunk=32,
    # Up to 16 MiB: on a 2-core CPU a small all-reduce's median varies from 0.3 to 3.5 ms, and
    # the largest (~14 ms) must stand clear of that for the fit to find a bandwidth.
    all_reduce_elements=(2**8, 2**12, 2**16, 2**20, 2**22),
    all_reduce_repeats=20,
    parallel_batches=(1, 4),
    parallel_context=32,
    matmul_size=256,
    copy_megabytes=16,
    spec_output=8,
    spec_batches=(1, 2),
    single_output=8,
    sampler_batches=(1, 4),
    grammar_requests=2,
    grammar_output=12,
    repeats=2,
)


@dataclass
class Run:
    """What every chapter shares: the model (loaded once), the sizes, the device."""

    model_dir: Path
    model_name: str  # for titles
    model: LlamaForCausalLM
    tokenizer: object
    sizes: Sizes
    quick: bool

    @property
    def device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    def context(self, **settings) -> BenchmarkContext:
        """A fresh benchmark context on the shared model: its own engines, its own settings."""
        return BenchmarkContext(self.model_dir, self.model, self.tokenizer, DTYPE, **settings)

    def benchmark(self, ctx: BenchmarkContext, workload: Workload, methods: list[str]):
        """`run_benchmark`, with the table printed. The matmul peak (for MFU) is measured in
        a full run only: a quick run is a check, and the peak takes seconds on a CPU."""
        if self.device.type == "cpu":
            # On CUDA the benchmark sizes each engine's KV pool for the workload itself; on the
            # CPU an engine takes a default of 2 GiB, zeroed as it is allocated: most of a
            # quick run's time. The same sizing keeps it small.
            block_size = ctx.engine_args.get("block_size", EngineConfig.block_size)
            budget = workload_kv_cache_bytes(workload, self.model.config, DTYPE, block_size)
            ctx.engine_args.setdefault("kv_cache_memory_bytes", budget)
        results = run_benchmark(ctx, workload, methods, measure_peak=not self.quick)
        print(format_table(results))
        return results

    def title(self, what: str, workload: Workload | None = None) -> str:
        """A figure title naming the measurement, model, dtype, device and workload."""
        dtype = str(DTYPE).removeprefix("torch.")
        line = f"{what} · {self.model_name} · {dtype} · {device_label()}"
        if workload is not None:
            line += f"\n{workload.name}: {workload.description}"
        return line


@dataclass
class Chapter:
    """One chapter's measurement, ready to be written out."""

    stem: str  # "04-throughput": the names of its JSON and its figure
    workload: Workload  # what it measured on (for chapter 00, the prompts it compared on)
    figure: plt.Figure
    results: list[MethodResult] = field(default_factory=list)  # methods timed side by side
    measured: dict = field(default_factory=dict)  # the chapter's own numbers

    @property
    def number(self) -> int:
        return int(self.stem[:2])


# --- chapter 00: the model ---------------------------------------------------------------------


@torch.inference_mode()
def measure_logits(run: Run) -> Chapter:
    """Our logits against transformers' at every position of each prompt, float32.

    JSON: prompt_lengths, max_abs_diff_per_prompt, max_abs_diff, same_argmax (the same argmax
    at every position of every prompt), logit_range (transformers', [min, max]), and
    abs_diff_histogram {log10_edges, counts} over every logit (|diff| below 1e-9 counts as 1e-9).
    """
    low, high = run.sizes.logit_prompt_lengths
    chat = throughput_workload(run.tokenizer, run.sizes.logit_prompts, (low, high), 1)
    prompts = replace(
        chat,
        name="chat-prompts",
        description=f"{chat.num_requests} chat prompts, {low}-{high} tokens",
    )
    hf_model = run.context().hf_model
    edges = np.linspace(-9, 1, 41)  # log10 |diff|, 4 bins per decade
    counts = np.zeros(len(edges) - 1, dtype=np.int64)
    max_per_prompt, same_argmax, logit_range = [], True, [float("inf"), float("-inf")]
    for prompt in prompts.prompts:
        ids = torch.tensor(prompt, device=run.device)
        positions = torch.arange(len(prompt), device=run.device)
        ours = run.model.compute_logits(
            run.model(ids, positions, CausalAttention([0, len(prompt)]))
        )
        theirs = hf_model(ids[None]).logits[0]
        diff = (ours - theirs).abs()
        max_per_prompt.append(diff.max().item())
        # Counted on the device: a 1000-token prompt has 49 M logits.
        log10_diff = diff.clamp(1e-9, 10.0).log10()
        counts += torch.histc(log10_diff, len(counts), edges[0], edges[-1]).long().cpu().numpy()
        same_argmax &= torch.equal(ours.argmax(-1), theirs.argmax(-1))
        logit_range = [
            min(logit_range[0], theirs.min().item()),
            max(logit_range[1], theirs.max().item()),
        ]
    lengths = [len(p) for p in prompts.prompts]
    print(f"max |ours - transformers| = {max(max_per_prompt):.2e}; same argmax: {same_argmax}")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    ax1.plot(lengths, np.maximum(max_per_prompt, 1e-9), "o")  # 1e-9: equal
    ax1.set_yscale("log")
    ax1.set_xlabel("prompt length (tokens)")
    ax1.set_ylabel("max |ours − transformers| over the prompt's logits")
    ax1.set_title("largest difference per prompt")
    ax1.grid(alpha=0.3)
    ax2.stairs(counts, edges, fill=True)
    ax2.set_yscale("log")
    ax2.set_xlabel("log10 |ours − transformers| per logit (−9: equal)")
    ax2.set_ylabel("count of logits")
    ax2.set_title(f"all {counts.sum():,} logits")
    fig.suptitle(run.title("Logits: minivllm vs transformers", prompts), fontsize=10)
    return Chapter(
        "00-logits",
        prompts,
        fig,
        measured=dict(
            prompt_lengths=lengths,
            max_abs_diff_per_prompt=max_per_prompt,
            max_abs_diff=max(max_per_prompt),
            same_argmax=same_argmax,
            logit_range=logit_range,
            abs_diff_histogram=dict(log10_edges=edges.tolist(), counts=counts.tolist()),
        ),
    )


# --- chapter 01: naive generation --------------------------------------------------------------


def measure_naive_cost(run: Run) -> Chapter:
    """One no-cache step against the sequence length, then the no-cache loop against
    transformers' `generate` (which keeps a KV cache) on whole requests.

    JSON: step_lengths (tokens), step_seconds (the fastest of `repeats` forward passes over that
    many tokens, logits of the last one), and results: "hf", then "naive".
    """
    lengths = list(run.sizes.step_lengths)
    long_prompt = chat_prompt_of_length(run.tokenizer, max(lengths), Random(0))

    @torch.inference_mode()
    def one_step(length: int) -> torch.Tensor:
        ids = torch.tensor(long_prompt[:length], device=run.device)
        positions = torch.arange(length, device=run.device)
        hidden = run.model(ids, positions, CausalAttention([0, length]))
        return run.model.compute_logits(hidden[-1:])

    step_seconds = [best_time(partial(one_step, n), run.device, run.sizes.repeats) for n in lengths]
    workload = throughput_workload(
        run.tokenizer, run.sizes.naive_requests, (20, 300), run.sizes.naive_output
    )
    results = run.benchmark(run.context(), workload, ["hf", "naive"])

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    ax1.plot(lengths, np.array(step_seconds) * 1e3, "o-")
    ax1.set_xlabel("sequence length L (tokens)")
    ax1.set_ylabel("time of one no-cache step (ms)")
    ax1.set_ylim(bottom=0)
    ax1.set_title("a forward pass over the whole sequence, per new token")
    ax1.grid(alpha=0.3)
    plot_throughput(results, "", ax=ax2, baseline="naive")
    ax2.set_title("whole requests")
    fig.suptitle(run.title("Cost of generation without a KV cache", workload), fontsize=10)
    return Chapter(
        "01-cost-vs-length",
        workload,
        fig,
        results,
        dict(step_lengths=lengths, step_seconds=step_seconds),
    )


# --- chapter 01b: decoding ---------------------------------------------------------------------

SAMPLER_SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top-k 50": SamplingParams(temperature=0.8, top_k=50),
    "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "min-p 0.1": SamplingParams(temperature=0.8, min_p=0.1),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5),
    "seeded": SamplingParams(temperature=0.8, seed=0),
}


def measure_sampler_cost(run: Run) -> Chapter:
    """The sampler alone on random float32 logits over the model's vocabulary: milliseconds per
    call for each decoding setting and number of rows, each row with 64 tokens of history.

    JSON: results (empty); sampler_ms: [{"setting", "rows", "ms"}]; vocab_size.
    """
    vocab = run.model.config.vocab_size
    history = list(range(64))
    generator = torch.Generator(device=run.device).manual_seed(0)
    sampler = Sampler(default_generator=generator)
    rows_ms = []
    for rows in run.sizes.sampler_batches:
        logits = torch.randn(rows, vocab, device=run.device, generator=generator)
        for setting, params in SAMPLER_SETTINGS.items():
            sampling_rows = [
                SamplingRow(params, history, history, make_generator(0) if params.seed else None)
                for _ in range(rows)
            ]
            seconds = best_time(
                partial(sampler, logits, sampling_rows), run.device, run.sizes.repeats
            )
            rows_ms.append(dict(setting=setting, rows=rows, ms=1e3 * seconds))
    print("\n".join(f"{r['setting']:>16}, {r['rows']:>4} rows: {r['ms']:.3f} ms" for r in rows_ms))

    fig, ax = plt.subplots(figsize=(10, 4), layout="constrained")
    settings = list(SAMPLER_SETTINGS)
    width = 0.8 / len(run.sizes.sampler_batches)
    for i, rows in enumerate(run.sizes.sampler_batches):
        ms = [
            next(r["ms"] for r in rows_ms if r["setting"] == s and r["rows"] == rows)
            for s in settings
        ]
        ax.bar([x + i * width for x in range(len(settings))], ms, width, label=f"{rows} rows")
    ax.set_xticks(
        [x + width * (len(run.sizes.sampler_batches) - 1) / 2 for x in range(len(settings))],
        settings,
    )
    ax.set_ylabel("milliseconds per sampler call")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    workload = Workload(
        "sampler-rows", [], [], f"random logits over {vocab} tokens, 64 tokens of history a row"
    )
    fig.suptitle(
        run.title("The sampler's cost per step, by decoding setting", workload), fontsize=10
    )
    return Chapter(
        "01b-sampler-cost", workload, fig, [], dict(sampler_ms=rows_ms, vocab_size=vocab)
    )


# --- chapter 02: the KV cache ------------------------------------------------------------------


def measure_kv_cache(run: Run) -> Chapter:
    """Chapters 01-02's methods side by side; one decode step against the batch's rows; the KV
    memory of one static batch of varied-length requests.

    JSON: results ("hf", "naive", "kv-cache", "static" and "hf-static", one static batch of all
    requests); decode_rows, decode_step_seconds (the fastest of `repeats` decode steps with
    decode_context cached tokens per row); kv_bytes_per_token {dtype: bytes}; static_batch
    {workload, reserved_kv_bytes (rows x longest prompt + longest output), needed_kv_bytes (each
    request's final length), decode_steps, computed_rows, useful_rows}.
    """
    sizes = run.sizes
    workload = throughput_workload(
        run.tokenizer, sizes.speedup_requests, (20, 300), sizes.speedup_output
    )
    ctx = run.context(batch_size=workload.num_requests)
    results = run.benchmark(ctx, workload, ["hf", "naive", "kv-cache", "static", "hf-static"])
    decode_seconds = [decode_step_seconds(run, rows) for rows in sizes.decode_rows]
    static_batch = static_batch_memory(run, ctx)

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.4), layout="constrained")
    plot_throughput(results, "", ax=ax1, baseline="naive")
    ax1.set_title("whole requests, one static batch", fontsize=9)
    rows = list(sizes.decode_rows)
    ax2.plot(rows, [r / s for r, s in zip(rows, decode_seconds)], "o-", color="tab:green")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(rows, [str(r) for r in rows])
    ax2.set_xlabel("rows in the decode batch")
    ax2.set_ylabel("generated tokens per second")
    ax2.set_ylim(bottom=0)
    ax2.set_title(f"one decode step, {sizes.decode_context} cached tokens per row", fontsize=9)
    ax2.grid(alpha=0.3)
    reserved, needed = static_batch["reserved_kv_bytes"], static_batch["needed_kv_bytes"]
    ax3.bar(
        ["reserved\n(rows × longest)", "needed\n(each request's length)"],
        [reserved / MiB, needed / MiB],
        color=["tab:red", "tab:blue"],
    )
    ax3.set_ylabel("KV cache memory (MiB)")
    useful = static_batch["useful_rows"] / static_batch["computed_rows"]
    ax3.set_title(
        f"one static batch of {static_batch['workload']}\n{needed / reserved:.0%} of the reserved"
        f" memory needed, {useful:.0%} of the decode rows useful",
        fontsize=9,
    )
    fig.suptitle(run.title("The KV cache and static batching", workload), fontsize=10)
    per_token = {
        str(d).removeprefix("torch."): run.model.config.kv_bytes_per_token(d)
        for d in (torch.float32, torch.bfloat16)
    }
    return Chapter(
        "02-kv-cache",
        workload,
        fig,
        results,
        dict(
            decode_rows=rows,
            decode_context=sizes.decode_context,
            decode_step_seconds=decode_seconds,
            kv_bytes_per_token=per_token,
            static_batch=static_batch,
        ),
    )


@torch.inference_mode()
def decode_step_seconds(
    run: Run, rows: int, context: int | None = None, model: LlamaForCausalLM | None = None
) -> float:
    """The fastest of a few decode steps of `rows` rows over random stand-in K/V: `context`
    cached tokens per row (decode_context by default), `model` in its own dtype (the run's by
    default; chapter 07 times a bfloat16 copy)."""
    context = run.sizes.decode_context if context is None else context
    model = model or run.model
    config, dtype = model.config, model.model.embed_tokens.weight.dtype
    cache = ContiguousKVCache(config, rows, context + 1, dtype, run.device)
    cache.keys.normal_()
    cache.values.normal_()
    ids = torch.randint(0, config.vocab_size, (rows,), device=run.device)  # a new token per row
    positions = torch.full((rows,), context, device=run.device)
    seq_lens = positions + 1  # cached tokens and the new one

    def step():
        return model.compute_logits(model(ids, positions, cache.decode(seq_lens)))

    return best_time(step, run.device, run.sizes.repeats)


def static_batch_memory(run: Run, ctx: BenchmarkContext) -> dict:
    """Run the varied-output workload as one static batch and compare the KV memory it reserves
    with what its requests need at their final length."""
    workload = varied_output_workload(
        run.tokenizer, run.sizes.varied_requests, output_lengths=run.sizes.varied_outputs
    )
    stats = generate_static_batch(run.model, greedy_requests(ctx, workload), Sampler())
    final_lengths = [len(p) + n for p, n in zip(workload.prompts, workload.output_lengths)]
    return dict(
        workload=workload.description,
        reserved_kv_bytes=stats.reserved_kv_bytes,
        needed_kv_bytes=sum(final_lengths) * run.model.config.kv_bytes_per_token(DTYPE),
        decode_steps=stats.decode_steps,
        computed_rows=stats.computed_rows,
        useful_rows=stats.useful_rows,
    )


# --- chapter 03: paged KV blocks ---------------------------------------------------------------

# What a contiguous cache reserves per request when it cannot know the final length: the
# longest sequence allowed (the vLLM paper's 2048, or the model's context if shorter).
MAX_RESERVATION = 2048
BLOCK_SIZE = 16


def measure_memory_waste(run: Run) -> Chapter:
    """The engine (no prefix caching) runs the varied-output workload step by step; after each
    step we count the tokens its running requests hold, the slots of the blocks they hold, and
    what a contiguous cache would reserve for the same requests. Then paged decode attention
    against the block size.

    JSON: per_step {tokens_held, paged_slots, contiguous_final_slots (each request's final
    length), contiguous_max_slots (max_reservation per request)}; token_share {scheme: tokens
    held / slots reserved, summed over the steps}; kv_bytes_per_token; block_size;
    max_reservation;
    attention_block_sizes, attention_seconds (one decode-attention call of attention_seqs
    sequences of attention_seq_len tokens, one layer), attention_seqs, attention_seq_len.
    """
    workload = varied_output_workload(
        run.tokenizer, run.sizes.varied_requests, output_lengths=run.sizes.varied_outputs
    )
    max_reservation = min(MAX_RESERVATION, run.model.config.max_model_len)
    per_step = trace_kv_memory(run, workload, max_reservation)
    token_share = {
        scheme: sum(per_step["tokens_held"]) / sum(per_step[f"{scheme}_slots"])
        for scheme in ("paged", "contiguous_final", "contiguous_max")
    }
    print(
        "share of reserved KV memory holding tokens:",
        {k: f"{v:.1%}" for k, v in token_share.items()},
    )
    block_sizes = list(run.sizes.block_sizes)
    attention_seconds = [paged_attention_seconds(run, size) for size in block_sizes]

    per_token = run.model.config.kv_bytes_per_token(DTYPE)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.4), layout="constrained")
    steps = np.arange(1, len(per_step["tokens_held"]) + 1)
    mib = {name: np.array(values) * per_token / MiB for name, values in per_step.items()}
    ax1.fill_between(steps, mib["tokens_held"], step="post", alpha=0.5, label="holding tokens")
    ax1.step(steps, mib["paged_slots"], where="post", label=f"paged, blocks of {BLOCK_SIZE}")
    ax1.step(
        steps, mib["contiguous_final_slots"], where="post", label="contiguous, exact final length"
    )
    ax1.set_xlabel("engine step")
    ax1.set_ylabel("KV cache memory (MiB)")
    ax1.set_title("memory held by the running requests", fontsize=9)
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    labels = {
        "contiguous_max": f"contiguous,\nmax length {max_reservation}",
        "contiguous_final": "contiguous,\nexact final length",
        "paged": f"paged,\nblocks of {BLOCK_SIZE}",
    }
    bars = ax2.barh(
        [labels[k] for k in labels],
        [100 * token_share[k] for k in labels],
        color=["tab:red", "tab:orange", "tab:blue"],
    )
    ax2.bar_label(bars, [f" {token_share[k]:.1%}" for k in labels])
    ax2.set_xlim(0, 100)
    ax2.set_xlabel("reserved KV memory holding tokens (%)")
    ax2.set_title("over the whole run", fontsize=9)
    ax3.plot(block_sizes, np.array(attention_seconds) * 1e3, "o-", color="tab:green")
    ax3.set_xscale("log", base=2)
    ax3.set_xticks(block_sizes, [str(b) for b in block_sizes])
    ax3.set_xlabel("block size (tokens)")
    ax3.set_ylabel("time per call (ms)")
    ax3.set_ylim(bottom=0)
    ax3.set_title(
        f"torch paged decode attention: {run.sizes.attention_seqs} seqs × "
        f"{run.sizes.attention_seq_len} tokens, 1 layer",
        fontsize=9,
    )
    ax3.grid(alpha=0.3)
    fig.suptitle(run.title("KV memory: contiguous vs paged", workload), fontsize=10)
    return Chapter(
        "03-memory-waste",
        workload,
        fig,
        measured=dict(
            per_step=per_step,
            token_share=token_share,
            kv_bytes_per_token=per_token,
            block_size=BLOCK_SIZE,
            max_reservation=max_reservation,
            attention_block_sizes=block_sizes,
            attention_seconds=attention_seconds,
            attention_seqs=run.sizes.attention_seqs,
            attention_seq_len=run.sizes.attention_seq_len,
        ),
    )


def trace_kv_memory(run: Run, workload: Workload, max_reservation: int) -> dict[str, list[int]]:
    """Step an engine through the workload (all requests queued at once) and count, after each
    step, the KV slots in use: tokens held, paged blocks, contiguous reservations (of each
    request's final length, or of `max_reservation` tokens)."""
    config = EngineConfig(
        model=str(run.model_dir),
        dtype=DTYPE,
        device=run.device,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,  # chapter 05's sharing off: one owner per block
        kv_cache_memory_bytes=workload_kv_cache_bytes(
            workload, run.model.config, DTYPE, BLOCK_SIZE
        ),
    )
    engine = LLMEngine(config)
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lengths)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    manager = engine.kv_cache_manager
    per_step = {
        name: []
        for name in ("tokens_held", "paged_slots", "contiguous_final_slots", "contiguous_max_slots")
    }
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        per_step["tokens_held"].append(sum(r.num_computed_tokens for r in running))
        per_step["paged_slots"].append((manager.num_blocks - manager.num_free_blocks) * BLOCK_SIZE)
        per_step["contiguous_final_slots"].append(
            sum(len(r.prompt_token_ids) + r.max_tokens for r in running)
        )
        per_step["contiguous_max_slots"].append(len(running) * max_reservation)
    return per_step


@torch.inference_mode()
def paged_attention_seconds(run: Run, block_size: int) -> float:
    """One decode-attention call (one query per sequence) over a pool of `block_size` blocks,
    each sequence's blocks scattered at random, one layer of the model's shapes."""
    sizes, config = run.sizes, run.model.config
    num_seqs, seq_len = sizes.attention_seqs, sizes.attention_seq_len
    per_seq = cdiv(seq_len, block_size)
    one_layer = replace(config, num_layers=1)
    pool = PagedKVCache(one_layer, num_seqs * per_seq, block_size, DTYPE, run.device)
    order = torch.randperm(num_seqs * per_seq, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(num_seqs)]
    last_slots = [
        t[(seq_len - 1) // block_size] * block_size + (seq_len - 1) % block_size for t in tables
    ]
    metadata = AttentionMetadata.build(
        [1] * num_seqs, [seq_len] * num_seqs, tables, last_slots, device=run.device
    )
    attention = TorchPagedAttention(pool, metadata)
    q = torch.randn(num_seqs, config.num_heads, config.head_dim, dtype=DTYPE, device=run.device)
    k = torch.randn(num_seqs, config.num_kv_heads, config.head_dim, dtype=DTYPE, device=run.device)
    return best_time(lambda: attention(0, q, k, k), run.device, sizes.repeats)


# --- chapter 04: continuous batching -----------------------------------------------------------


def measure_throughput(run: Run) -> Chapter:
    """Static against continuous batching with the same number of seats, next to transformers'
    padded batches, on requests whose outputs vary in length.

    JSON: results ("hf-static:S", "static:S", "engine-no-prefix-cache",
    "engine-no-prefix-cache@bfloat16", S = seats; the engines run at most S sequences at once);
    seats.
    """
    seats = run.sizes.seats
    workload = varied_output_workload(
        run.tokenizer, run.sizes.varied_requests, output_lengths=run.sizes.varied_outputs
    )
    ctx = run.context(batch_size=seats, engine_args=dict(max_num_seqs=seats))
    methods = [
        f"hf-static:{seats}",
        f"static:{seats}",
        "engine-no-prefix-cache",
        "engine-no-prefix-cache@bfloat16",
    ]
    results = run.benchmark(ctx, workload, methods)

    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.7 * len(results)), layout="constrained")
    plot_throughput(results, "", ax=ax, baseline=f"static:{seats}")
    fig.suptitle(
        run.title(f"Static vs continuous batching, at most {seats} sequences at once", workload),
        fontsize=10,
    )
    return Chapter("04-throughput", workload, fig, results, dict(seats=seats))


# --- chapter 05: prefix caching ----------------------------------------------------------------


def measure_prefix_cache(run: Run) -> Chapter:
    """The engine with and without prefix caching, on requests sharing a long system prompt.

    JSON: results ("engine-no-prefix-cache", then "engine": median_ttft_s,
    prompt_tokens_computed, output_tokens_per_s among their fields); prefix_cache_hit_rate (prompt
    tokens found cached over those looked up, the warm-up request's included); ttft_ratio (off /
    on); throughput_ratio (on / off); prompt_tokens_computed {off, on}.
    """
    workload = shared_prefix_workload(
        run.tokenizer,
        run.sizes.prefix_requests,
        run.sizes.system_prompt_length,
        run.sizes.prefix_output,
    )
    ctx = run.context(engine_args=dict(max_num_batched_tokens=run.sizes.prefix_step_tokens))
    off, on = run.benchmark(ctx, workload, ["engine-no-prefix-cache", "engine"])
    metrics = {m.name: m.value for m in ctx.engines["engine"].get_metrics()}
    hit_rate = metrics["vllm:prefix_cache_hits"] / metrics["vllm:prefix_cache_queries"]

    panels = [
        ("time to first token, median (s)", off.median_ttft_s, on.median_ttft_s),
        ("output tokens per second", off.output_tokens_per_s, on.output_tokens_per_s),
        ("prompt tokens computed", off.prompt_tokens_computed, on.prompt_tokens_computed),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), layout="constrained")
    for ax, (label, without, with_cache) in zip(axes, panels):
        bars = ax.bar(
            ["prefix cache off", "prefix cache on"],
            [without, with_cache],
            color=["tab:gray", "tab:purple"],
        )
        ax.bar_label(bars, [f"{without:.3g}", f"{with_cache:.3g} ({with_cache / without:.2f}x)"])
        ax.set_ylabel(label)
        ax.set_ylim(0, max(without, with_cache) * 1.2)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(run.title(f"Prefix caching (hit rate {hit_rate:.0%})", workload), fontsize=10)
    return Chapter(
        "05-prefix-cache",
        workload,
        fig,
        [off, on],
        dict(
            prefix_cache_hit_rate=hit_rate,
            ttft_ratio=off.median_ttft_s / on.median_ttft_s,
            throughput_ratio=on.output_tokens_per_s / off.output_tokens_per_s,
            prompt_tokens_computed=dict(
                off=off.prompt_tokens_computed, on=on.prompt_tokens_computed
            ),
        ),
    )


# --- chapter 06: attention kernels ------------------------------------------------------------


def measure_attention_kernels(run: Run) -> Chapter:
    """The attention backends side by side: decode attention per step over batch x context, one
    prefill chunk after as many cached tokens, the Triton decode kernel's memory bandwidth
    against a device-to-device copy's, and the engine on each backend.

    JSON: results (the engine on each backend, varied-output workload: methods
    "engine-no-prefix-cache:NAME"); backends; decode_attention (a list of {batch, context, ms:
    {backend: ms of one step's attention, all layers}}); prefill_attention {chunk, cached, ms:
    {backend: ms}}; triton_decode_bandwidth ({batch, context, gb_per_s, copy_gb_per_s,
    share_of_copy} on CUDA, null elsewhere: the interpreter's speed means nothing).
    """
    sizes, config = run.sizes, run.model.config
    on_gpu = run.device.type == "cuda"
    backends = ["torch", "flex"] + (["triton"] if on_gpu or triton_paged.interpreting() else [])
    seconds = sweep_decode_attention(
        config, backends, list(sizes.kernel_batches), list(sizes.kernel_contexts), DTYPE,
        run.device, sizes.repeats,
    )  # fmt: skip
    decode_rows = [
        dict(batch=b, context=c, ms={name: seconds[name][b, c] * 1e3 for name in backends})
        for b in sizes.kernel_batches
        for c in sizes.kernel_contexts
    ]
    chunk = sizes.prefill_chunk
    pool = one_layer_pool(config, 1, 2 * chunk, 16, DTYPE, run.device)
    prefill = random_step(config, pool, [chunk], [2 * chunk])
    prefill_ms = {
        name: attention_step_seconds(name, pool, prefill, config.num_layers, sizes.repeats) * 1e3
        for name in backends
    }
    bandwidth = decode_bandwidth(run) if on_gpu else None

    workload = varied_output_workload(
        run.tokenizer, run.sizes.varied_requests, output_lengths=run.sizes.varied_outputs
    )
    # Triton's interpreter (a quick run without a GPU) runs the kernels above, too slowly for
    # an engine's workload.
    engine_backends = [name for name in backends if on_gpu or name != "triton"]
    methods = [f"engine-no-prefix-cache:{name}" for name in engine_backends]
    # A quick run keeps flex's shapes (compiled when an engine starts) few.
    limits = dict(max_num_seqs=sizes.seats, max_num_batched_tokens=64) if run.quick else {}
    results = run.benchmark(run.context(engine_args=limits), workload, methods)

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.5), layout="constrained")
    for name in backends:
        for b in sizes.kernel_batches:
            left.plot(
                sizes.kernel_contexts,
                [seconds[name][b, c] * 1e3 for c in sizes.kernel_contexts],
                "o-",
                label=f"{name}, batch {b}",
            )
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("context per sequence (tokens)")
    left.set_ylabel(f"attention per decode step, {config.num_layers} layers (ms)")
    left.legend(fontsize=7, ncol=len(backends))
    left.grid(alpha=0.3)
    plot_throughput(results, "the engine on each backend", ax=right, baseline=methods[0])
    fig.suptitle(run.title("Attention backends", workload), fontsize=10)
    return Chapter(
        "06-attention-kernels",
        workload,
        fig,
        results,
        dict(
            backends=backends,
            decode_attention=decode_rows,
            prefill_attention=dict(chunk=chunk, cached=chunk, ms=prefill_ms),
            triton_decode_bandwidth=bandwidth,
        ),
    )


@torch.inference_mode()
def decode_bandwidth(run: Run) -> dict:
    """The Triton decode kernel alone at the grid's largest batch and context: K/V bytes read per
    second, against a device-to-device copy of as many bytes (read once, written once)."""
    sizes, config = run.sizes, run.model.config
    batch, context = max(sizes.kernel_batches), max(sizes.kernel_contexts)
    pool = one_layer_pool(config, batch, context, 16, DTYPE, run.device)
    step = random_decode_step(config, pool, batch, context)
    kv = pool.layers[0]
    metadata = step.metadata
    splits = triton_paged.choose_num_splits(batch, config.num_kv_heads, context, run.device)
    kernel_s = best_time(
        lambda: triton_paged.paged_decode_attention(
            step.q, kv, metadata.block_tables, metadata.seq_lens, splits
        ),
        run.device,
        sizes.repeats,
    )
    bytes_read = 2 * batch * context * config.num_kv_heads * config.head_dim * kv.element_size()
    source = torch.empty(bytes_read, dtype=torch.uint8, device=run.device)
    target = torch.empty_like(source)
    copy_s = best_time(lambda: target.copy_(source), run.device, sizes.repeats)
    gb_per_s, copy_gb_per_s = bytes_read / kernel_s / 1e9, 2 * bytes_read / copy_s / 1e9
    return dict(
        batch=batch,
        context=context,
        num_splits=splits,
        gb_per_s=gb_per_s,
        copy_gb_per_s=copy_gb_per_s,
        share_of_copy=gb_per_s / copy_gb_per_s,
    )


# --- chapter 07: tensor and data parallelism ---------------------------------------------------

PROJECTION_DTYPE = torch.bfloat16  # what models are served in
PROJECTION_BATCHES = tuple(2**k for k in range(9))  # 1 to 256 sequences
# Each model is projected at those of these sizes that split its heads, as the engine would
# split them: SmolLM2's 9 query / 3 KV heads allow 1 and 3, Llama-3-8B's 32 / 8 allow 1, 2, 4, 8.
PROJECTION_TP_SIZES = (1, 2, 3, 4, 8)
DATA_PARALLEL_SIZE = 2  # fits any model: every replica holds all of it
NVLINK_NAME = "NVLink 4 (spec sheet, 450 GB/s each way; 10 µs latency assumed)"
TP_COLORS = {1: "tab:blue", 2: "tab:orange", 3: "tab:red", 4: "tab:green", 8: "tab:purple"}


def nvlink(tp: int) -> Link:
    """The projection's link: an all-reduce ring of `tp` GPUs over NVLink 4 (H100, H200) at the
    spec sheet's bandwidth. The latency is an assumption, not a measurement: NCCL's small
    all-reduces within one machine take some microseconds."""
    return ring_link(NVLINK_NAME, 10e-6, 450e9, tp)


def measure_parallelism(run: Run) -> Chapter:
    """Tensor and data parallelism where there are devices to split over, and otherwise what
    one device can say about them.

    With 2+ GPUs: the engine alone, at DP=2 and at the smallest TP that the model's heads and
    the GPUs allow, on chapter 04's workload (greedy tokens compared), and NCCL all-reduces
    between 2 GPUs. With one GPU no engine runs. On a CPU (--quick) the same engines, their
    ranks and replicas processes sharing the cores, and gloo all-reduces between 2 processes.
    On every device: its decode step (this model in bfloat16), matmul peak and memory
    bandwidth, and `projected_step` of this model and of a Llama-3-8B shape at TP = 1..8 over a
    spec-sheet NVLink ring.

    JSON: results ("engine", "engine:dp=2", "engine:tp=N"; empty when no engine ran); num_gpus;
    skipped (why no engine ran, else null); tensor_parallel_size (the engine's, else null) and
    tensor_parallel_skipped (why none ran, else null); notes; all_reduce (rows {bytes, seconds}:
    one float32 all-reduce between 2 ranks, the slower rank's median; empty on one GPU),
    all_reduce_backend; link {name, latency_s, bandwidth (bytes/s)} fitted to those rows, or
    null; machine {name, peak_flops, bandwidth}: this device in bfloat16, measured;
    decode_steps (rows {batch, measured_s, projected_s}: one step of this model with
    parallel_context cached tokens per row, and the projection at TP=1, the roofline);
    projection_dtype, projection_context, projection_links (rows {tp, name, latency_s,
    bandwidth}) and projection (rows {model, tp, batch, compute_s, communication_s, seconds,
    speedup: over TP=1 at the same batch}).
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
        workload = varied_output_workload(
            run.tokenizer, sizes.varied_requests, output_lengths=sizes.varied_outputs
        )
        results = compare_engines(run, workload, methods)
        if run.device.type == "cuda":  # LLM(device=...) is every replica's device
            notes.append(
                "the engine puts every data-parallel replica on the device it is given: "
                "DP=2 ran both replicas on the first GPU"
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
    return Chapter(
        "07-parallelism",
        workload,
        fig,
        results,
        dict(
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
            projection_dtype=str(PROJECTION_DTYPE).removeprefix("torch."),
            projection_context=sizes.parallel_context,
            projection_links=[dict(tp=n, **asdict(nvlink(n))) for n in tp_sizes],
            projection=projection,
        ),
    )


def tensor_parallel_sizes(config: ModelConfig, candidates) -> list[int]:
    """Those of `candidates` that split the model's heads and MLP evenly (the engine's rule)."""
    fitting = []
    for size in candidates:
        try:
            config.check_tensor_parallel_size(size)
        except ValueError:
            continue
        fitting.append(size)
    return fitting


def engine_tensor_parallel_size(run: Run, num_gpus: int) -> tuple[int | None, str | None]:
    """The smallest TP size above 1 that fits both the model and the machine, else None and
    why. On CUDA each rank needs a GPU of its own; on the CPU ranks are processes, and two of
    them already share its cores."""
    config = run.model.config
    usable = range(2, num_gpus + 1) if run.device.type == "cuda" else [2]
    fitting = tensor_parallel_sizes(config, usable)
    if fitting:
        return fitting[0], None
    needed = tensor_parallel_sizes(config, range(2, config.num_heads + 1))
    why = (
        f"tensor parallelism on {run.model_name} ({config.num_heads} query / "
        f"{config.num_kv_heads} KV heads) needs {needed[0] if needed else 'more'} GPUs; "
        f"this machine has {num_gpus}"
    )
    print(why)
    return None, why


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


def all_reduce_between_processes(backend: str, counts: list[int], repeats: int) -> list[dict]:
    """`measure_all_reduce`'s rows from 2 spawned processes in a `backend` group, under NCCL
    each rank on a GPU of its own (`RankPool`'s ranks speak gloo, on the CPU only)."""
    # A spawned rank finds `_time_all_reduces` by importing this script by its module name:
    # when the tests load it from scripts/, that folder must be on the path the ranks inherit.
    if str(SCRIPT_DIR) not in sys.path:
        sys.path.append(str(SCRIPT_DIR))
    medians = mp.get_context("spawn").SimpleQueue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_time_all_reduces, (2, backend, init_method, counts, repeats, medians), nprocs=2)
    per_rank = [medians.get() for _ in range(2)]
    # The slower rank's median: an all-reduce is done when every rank holds the sum.
    return [
        {"bytes": 4 * count, "seconds": max(rank[i] for rank in per_rank)}
        for i, count in enumerate(counts)
    ]


def _time_all_reduces(
    rank: int, size: int, backend: str, init_method: str, counts: list[int], repeats: int, medians
) -> None:
    """One rank of `all_reduce_between_processes`: the median seconds of `repeats` float32
    all-reduces of each size (single calls vary: a rank scheduled late holds up the others)."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    rank_medians = []
    for count in counts:
        x = torch.ones(count, device=device)
        for _ in range(5):  # the first calls set up the connections and their buffers
            dist.all_reduce(x)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # NCCL returns at once; the sum arrives later
            times.append(time.perf_counter() - start)
        rank_medians.append(sorted(times)[len(times) // 2])
    medians.put(rank_medians)
    dist.destroy_process_group()


def measure_machine(run: Run) -> Machine:
    """This device's two roofline numbers in the projection's dtype, measured: the best matrix
    product and a large copy."""
    dtype = str(PROJECTION_DTYPE).removeprefix("torch.")
    return Machine(
        f"{device_label()}, measured in {dtype}",
        peak_flops=measure_matmul_peak(PROJECTION_DTYPE, run.device, run.sizes.matmul_size),
        bandwidth=measure_memory_bandwidth(run.device, run.sizes.copy_megabytes),
    )


def measure_decode_steps(run: Run, machine: Machine) -> list[dict]:
    """One decode step of this model in the projection's dtype at each batch size, measured
    and projected at TP=1: how far eager PyTorch is from the roofline that the projection
    divides among the ranks."""
    model = load_model(run.model_dir, PROJECTION_DTYPE, run.device)
    context = run.sizes.parallel_context
    return [
        dict(
            batch=batch,
            measured_s=decode_step_seconds(run, batch, context, model),
            projected_s=projected_step(
                model.config, PROJECTION_DTYPE, batch, context, machine, 1, None
            ).seconds,
        )
        for batch in run.sizes.parallel_batches
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
    fig, axes = plt.subplots(
        1, 4 if results else 3, figsize=(22 if results else 17, 4.6), layout="constrained"
    )
    plot_all_reduce(axes[0], all_reduce, link)
    plot_decode_steps(axes[1], run, decode_steps, projection)
    plot_projected_speedup(axes[2], run, projection)
    if results:
        plot_throughput(results, "the engine, whole workload", ax=axes[3], baseline="engine")
    fig.suptitle(run.title("Tensor and data parallelism", workload), fontsize=10)
    return fig


def plot_all_reduce(ax, all_reduce: list[dict], link: Link | None) -> None:
    message = np.geomspace(2**8, 2**28, 60)  # bytes
    if all_reduce:
        ax.plot(
            [row["bytes"] for row in all_reduce],
            [row["seconds"] * 1e6 for row in all_reduce],
            "o",
            color="black",
            label=f"measured, {link.name.removesuffix(' (measured)')}",
        )
        ax.plot(
            message,
            [link.all_reduce_seconds(n) * 1e6 for n in message],
            color="black",
            label=f"fit: {link.latency_s * 1e6:.0f} µs + bytes / {link.bandwidth / 1e9:.2f} GB/s",
        )
    for tp in (2, 8):
        ax.plot(
            message,
            [nvlink(tp).all_reduce_seconds(n) * 1e6 for n in message],
            "--",
            color=TP_COLORS[tp],
            label=f"ring of {tp} GPUs, {NVLINK_NAME}",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("all-reduce message (bytes)")
    ax.set_ylabel("time of one all-reduce (µs)")
    measured = "measured between 2 ranks" if all_reduce else "none measured (one GPU)"
    ax.set_title(f"all-reduce: {measured}", fontsize=9)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)


def plot_decode_steps(ax, run: Run, decode_steps: list[dict], projection: list[dict]) -> None:
    where = "1 GPU" if run.device.type == "cuda" else "this CPU"
    ax.plot(
        [row["batch"] for row in decode_steps],
        [row["measured_s"] * 1e3 for row in decode_steps],
        "o-",
        color="black",
        label=f"measured, {where}",
    )
    ours = [row for row in projection if row["model"] == run.model_name]
    for tp in sorted({row["tp"] for row in ours}):
        rows = [row for row in ours if row["tp"] == tp]
        ax.plot(
            [row["batch"] for row in rows],
            [row["seconds"] * 1e3 for row in rows],
            "--",
            color=TP_COLORS[tp],
            label=f"projected, TP={tp}" + (" (roofline)" if tp == 1 else " (+ all-reduces)"),
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequences in the decode batch")
    ax.set_ylabel("time of one decode step (ms)")
    dtype = str(PROJECTION_DTYPE).removeprefix("torch.")
    ax.set_title(
        f"{run.model_name}, {dtype}, {run.sizes.parallel_context} cached tokens per sequence",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def plot_projected_speedup(ax, run: Run, projection: list[dict]) -> None:
    for model, style in ((run.model_name, ":"), ("Llama-3-8B shape", "-")):
        rows = [row for row in projection if row["model"] == model]
        for tp in sorted({row["tp"] for row in rows} - {1}):
            ax.plot(
                [row["batch"] for row in rows if row["tp"] == tp],
                [row["speedup"] for row in rows if row["tp"] == tp],
                style,
                color=TP_COLORS[tp],
                marker="o",
                markersize=3,
                label=f"{model}, TP={tp}",
            )
    ax.axhline(1, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequences in the decode batch")
    ax.set_ylabel("projected decode-step speedup over 1 GPU (×)")
    dtype = str(PROJECTION_DTYPE).removeprefix("torch.")
    ax.set_title(
        f"projection, {dtype}: this device's roofline / TP + NVLink all-reduces", fontsize=9
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


# --- chapter 08: speculative decoding ----------------------------------------------------------

# The notebook's requests: a paragraph to copy word for word (the n-gram proposer finds the
# next words in the prompt) and free writing (it finds little to copy).
PARAGRAPHS = (
    "The committee met on Tuesday to review the budget for the new library. After a long "
    "discussion, the members agreed to fund the children's section, the reading room and a small "
    "cafe, and to postpone the renovation of the archive until next year.",
    "To reset the router, unplug it for thirty seconds, plug it back in, and wait until the green "
    "light stops blinking. If the light stays orange, hold the reset button for ten seconds and "
    "try again.",
    "Mix the flour, the sugar and a pinch of salt in a large bowl. Add the eggs one at a time, "
    "then the melted butter, and stir until the batter is smooth. Bake for twenty-five minutes at "
    "180 degrees.",
    "The museum opens at nine in the morning and closes at six in the evening, except on Mondays. "
    "Tickets can be bought at the entrance or online, and children under twelve enter for free.",
)
STORIES = (
    "Write a short story about a lighthouse keeper.",
    "Describe a walk through a forest in autumn.",
    "Tell me about the history of bicycles.",
    "Write a poem about the sea at night.",
)
# The notebook's settings: n-gram drafts of k tokens (matches of 2-4 tokens, the defaults), and
# a layer-skip draft of the first 80% of the target's layers (24 of SmolLM2-135M's 30).
SPECULATIVE = {f"ngram k={k}": {"method": "ngram", "num_speculative_tokens": k} for k in (3, 5)}
SPECULATIVE["layer skip 80% k=3"] = {"method": "layer_skip", "num_speculative_tokens": 3}
LAYER_SKIP_SHARE = 0.8
SWEEP_METHOD = "ngram k=3"  # the one the batch sweep runs against plain decoding


def measure_speculative_decoding(run: Run) -> Chapter:
    """Plain decoding against n-gram speculation (k = 3 and 5 draft tokens), greedy.

    At batch 1 (each request alone) on copying and free-writing requests, then the copying
    requests at growing batch sizes, plain against k=3. The engines run without prefix caching:
    the copies of a paragraph in a batch would otherwise share their prompt, and what is
    measured here is decoding.

    JSON: results (empty); max_tokens; batch1 (rows {workload, method, tokens_per_s, speedup:
    over plain on the same workload, same_tokens: as plain's}); acceptance_per_position
    {"method/workload": [share of verification steps that kept the draft at position 0, 1, ..]}
    from the engine's counters; verification_steps {"method/workload": steps that checked
    drafts (0 where the proposer found no match, as on the quick run's random model)};
    batch_sweep (rows {batch, plain_tokens_per_s, speculative_tokens_per_s, ratio});
    speculative_method (the sweep's).
    """
    sizes = run.sizes
    workloads = {
        "copying": chat_requests(
            run, ["Copy this text exactly, word for word:\n\n" + text for text in PARAGRAPHS]
        ),
        "free writing": chat_requests(run, list(STORIES)),
    }
    largest = max(sizes.spec_batches)
    sweep_prompts = {b: (workloads["copying"] * largest)[:b] for b in sizes.spec_batches}
    engines = speculative_engines(run, sweep_prompts[largest])

    batch1, acceptance, verification_steps = [], {}, {}
    for workload, prompts in workloads.items():
        plain_rate, plain_tokens = None, None
        for method, llm in engines.items():
            warm_up(llm)  # before the counters are read: its drafts are not the workload's
            before = spec_counters(llm)
            rate, tokens = tokens_per_s_alone(llm, prompts, sizes.spec_output)
            if method == "plain":
                plain_rate, plain_tokens = rate, tokens
            else:
                after, k = spec_counters(llm), SPECULATIVE[method]["num_speculative_tokens"]
                acceptance[f"{method}/{workload}"] = acceptance_per_position(before, after, k)
                verification_steps[f"{method}/{workload}"] = counter_delta(before, after, DRAFTS)
            batch1.append(
                dict(
                    workload=workload,
                    method=method,
                    tokens_per_s=rate,
                    speedup=rate / plain_rate,
                    same_tokens=tokens == plain_tokens,
                )
            )
            print(f"batch 1, {workload}, {method}: {rate:.1f} tokens/s ({rate / plain_rate:.2f}x)")

    batch_sweep = []
    for batch, prompts in sweep_prompts.items():
        plain = tokens_per_s_batched(engines["plain"], prompts, sizes.spec_output)
        speculative = tokens_per_s_batched(engines[SWEEP_METHOD], prompts, sizes.spec_output)
        batch_sweep.append(
            dict(
                batch=batch,
                plain_tokens_per_s=plain,
                speculative_tokens_per_s=speculative,
                ratio=speculative / plain,
            )
        )
        print(f"batch {batch}: plain {plain:.1f}, {SWEEP_METHOD} {speculative:.1f} tokens/s")

    n = len(PARAGRAPHS)
    workload = Workload(
        "copy-and-free-write",
        [p["prompt_token_ids"] for prompts in workloads.values() for p in prompts],
        [sizes.spec_output] * (n + len(STORIES)),
        f"{n} chat requests to copy a paragraph word for word and {len(STORIES)} to write "
        f"freely, greedy, at most {sizes.spec_output} tokens each",
    )
    return Chapter(
        "08-speculative-decoding",
        workload,
        plot_speculative_decoding(run, workload, batch1, batch_sweep),
        measured=dict(
            max_tokens=sizes.spec_output,
            batch1=batch1,
            acceptance_per_position=acceptance,
            verification_steps=verification_steps,
            batch_sweep=batch_sweep,
            speculative_method=SWEEP_METHOD,
        ),
    )


def chat_requests(run: Run, messages: list[str]) -> list[dict]:
    """Each message as a one-turn chat prompt, in the run's tokenizer's template."""
    return [
        {"prompt_token_ids": apply_chat_template(run.tokenizer, [{"role": "user", "content": m}])}
        for m in messages
    ]


def speculative_engines(run: Run, largest_batch: list[dict]) -> dict[str, LLM]:
    """A plain engine and one per speculative setting, by name, each with a KV pool sized for
    the largest batch (every engine loads its own copy of the model: left to themselves, they
    would each take most of a GPU, or 2 GiB of zeroed CPU memory)."""
    most_drafts = max(s["num_speculative_tokens"] for s in SPECULATIVE.values())
    largest = Workload(
        "largest-batch",
        [p["prompt_token_ids"] for p in largest_batch],
        # The verification step writes the drafts' KV too: room for them past the last token.
        [run.sizes.spec_output + most_drafts] * len(largest_batch),
        "",
    )
    budget = workload_kv_cache_bytes(largest, run.model.config, DTYPE, EngineConfig.block_size)
    engine = partial(
        LLM,
        run.model_dir,
        dtype=DTYPE,
        device=run.device,
        kv_cache_memory_bytes=budget,
        enable_prefix_caching=False,
    )
    engines = {"plain": engine()}
    num_layers = run.model.config.num_layers
    for name, config in SPECULATIVE.items():
        if config["method"] == "layer_skip":
            # The draft's layers keep K/V of their own: a block costs that much more.
            draft_layers = min(max(1, round(LAYER_SKIP_SHARE * num_layers)), num_layers - 1)
            config = config | {"num_draft_layers": draft_layers}
            extra = dict(kv_cache_memory_bytes=budget * (num_layers + draft_layers) // num_layers)
            engines[name] = engine(speculative_config=config, **extra)
        else:
            engines[name] = engine(speculative_config=config)
    return engines


def spec_counters(llm: LLM) -> dict[str, float]:
    """The engine's speculative-decoding counters (cumulative since it was built)."""
    return {m.name: m.value for m in llm.get_metrics() if "spec_decode" in m.name}


DRAFTS = "vllm:spec_decode_num_drafts"  # verification steps: steps that checked drafts
ACCEPTED_AT = 'vllm:spec_decode_num_accepted_tokens_per_pos{{position="{}"}}'  # drafts kept at i


def counter_delta(before: dict, after: dict, name: str) -> float:
    """What a counter gained between two readings (absent: not counted yet)."""
    return after.get(name, 0) - before.get(name, 0)


def acceptance_per_position(before: dict, after: dict, k: int) -> list[float]:
    """Of the verification steps between the two readings, the share that kept draft i. A
    draft is kept only after every earlier one was, so the shares cannot grow with i."""
    drafts = counter_delta(before, after, DRAFTS)
    return [counter_delta(before, after, ACCEPTED_AT.format(i)) / max(drafts, 1) for i in range(k)]


def warm_up(llm: LLM) -> None:
    """A first request, untimed; its prompt shares nothing with the workloads'."""
    llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=2), use_tqdm=False)


def tokens_per_s_alone(
    llm: LLM, prompts: list[dict], max_tokens: int
) -> tuple[float, list[list[int]]]:
    """Output tokens per second with each request run alone (batch 1), and their tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens, seconds = [], 0.0
    for prompt in prompts:
        start = time.perf_counter()
        output = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - start  # `generate` returns tokens: the device synced
        tokens.append(list(output.token_ids))
    return sum(len(t) for t in tokens) / seconds, tokens


def tokens_per_s_batched(llm: LLM, prompts: list[dict], max_tokens: int) -> float:
    """Output tokens per second with all the requests submitted at once."""
    warm_up(llm)
    start = time.perf_counter()
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
    )
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def plot_speculative_decoding(
    run: Run, workload: Workload, batch1: list[dict], batch_sweep: list[dict]
) -> plt.Figure:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    workloads = list(dict.fromkeys(row["workload"] for row in batch1))
    methods = list(SPECULATIVE)
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        rows = {row["workload"]: row for row in batch1 if row["method"] == method}
        x = np.arange(len(workloads)) + (i - (len(methods) - 1) / 2) * width
        bars = ax1.bar(x, [rows[w]["speedup"] for w in workloads], width, label=method)
        ax1.bar_label(bars, [f"{rows[w]['speedup']:.2f}x" for w in workloads], fontsize=8)
    ax1.axhline(1, color="gray", linewidth=0.8)
    ax1.set_ylim(0, max(row["speedup"] for row in batch1) * 1.15)  # room for the labels
    ax1.set_xticks(range(len(workloads)), [f"{w} requests" for w in workloads])
    ax1.set_ylabel("output tokens/s, speculative / plain (×)")
    ax1.set_title("batch 1: each request alone")
    ax1.legend(fontsize=8)
    ax1.grid(axis="y", alpha=0.3)

    batches = [row["batch"] for row in batch_sweep]
    ax2.plot(batches, [row["ratio"] for row in batch_sweep], "o-", label=f"{SWEEP_METHOD} / plain")
    ax2.axhline(1, color="gray", linewidth=0.8)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(batches, [str(b) for b in batches])
    ax2.set_xlabel("copying requests in the batch")
    ax2.set_ylabel("output tokens/s, speculative / plain (×)")
    ax2.set_title("copying requests, all submitted at once")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.suptitle(
        run.title("Speculative decoding with n-gram drafts, greedy", workload), fontsize=10
    )
    return fig


# --- chapter 10: structured outputs -----------------------------------------------------------

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def measure_structured_outputs(run: Run) -> Chapter:
    """The same chat requests (greedy) answered freely and under a JSON schema, one batch each
    on one engine: the grammar's cost is the bitmask each sampled row gets and the matchers
    advanced by each token. The schema's first compile is timed apart (xgrammar caches it).

    JSON: results (empty); rows: [{"mode", "requests", "output_tokens", "seconds",
    "tokens_per_s"}] for "free" and "json schema"; ratio (schema / free tokens/s);
    compile_seconds.
    """
    messages = [f"Describe person number {i} as JSON with a name and an age." for i in range(8)]
    prompts = (chat_requests(run, messages) * run.sizes.grammar_requests)[
        : run.sizes.grammar_requests
    ]
    llm = LLM(str(run.model_dir), dtype="float32", device=str(run.device), enforce_eager=run.quick)
    schema = StructuredOutputsParams(json=PERSON_SCHEMA)
    compile_start = time.perf_counter()
    llm.generate(
        prompts[:1], SamplingParams(max_tokens=1, structured_outputs=schema), use_tqdm=False
    )
    compile_seconds = time.perf_counter() - compile_start
    rows = []
    for mode, constraint in (("free", None), ("json schema", schema)):
        params = SamplingParams(
            temperature=0.0, max_tokens=run.sizes.grammar_output, structured_outputs=constraint
        )
        start = time.perf_counter()  # generate returns tokens on the host: no sync needed
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append(
            dict(
                mode=mode,
                requests=len(prompts),
                output_tokens=tokens,
                seconds=seconds,
                tokens_per_s=tokens / seconds,
            )
        )
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    print(
        f"schema compile {compile_seconds:.2f} s; "
        + ", ".join(f"{r['mode']} {r['tokens_per_s']:.1f} tok/s" for r in rows)
        + f" ({ratio:.2f}x)"
    )

    fig, ax = plt.subplots(figsize=(8, 3), layout="constrained")
    bars = ax.barh([r["mode"] for r in rows], [r["tokens_per_s"] for r in rows], color="tab:purple")
    ax.bar_label(bars, [f" {r['tokens_per_s']:.1f}" for r in rows])
    ax.set_xlabel("output tokens per second")
    ax.invert_yaxis()
    workload = Workload(
        "json-person",
        [p["prompt_token_ids"] for p in prompts],
        [run.sizes.grammar_output] * len(prompts),
        f"{len(prompts)} chat requests for a person as JSON, greedy, at most "
        f"{run.sizes.grammar_output} tokens",
    )
    fig.suptitle(run.title("Structured outputs: the grammar's cost", workload), fontsize=10)
    del llm
    return Chapter(
        "10-structured-outputs",
        workload,
        fig,
        [],
        dict(rows=rows, ratio=ratio, compile_seconds=compile_seconds),
    )


# --- chapter 11: the compiled step -------------------------------------------------------------


def measure_compiled_step(run: Run) -> Chapter:
    """The eager engine against the compiled one, which on a GPU also replays its decode steps
    from CUDA graphs, in float32 and bfloat16: a single request decoding (batch 1) and the
    varied-output workload.

    JSON: results (the varied-output workload: "engine-no-prefix-cache:eager",
    "engine-no-prefix-cache:compiled" and both "@bfloat16"); batch1 (the same four methods on one
    request, each a result record); speedups {"batch1", "varied"} -> dtype -> compiled / eager.
    """
    # A quick run checks the plumbing in float32 only: each compiled engine costs a compile.
    dtypes = ("",) if run.quick else ("", "@bfloat16")
    methods = [
        f"engine-no-prefix-cache:{setting}{dtype}"
        for dtype in dtypes
        for setting in ("eager", "compiled")
    ]
    single = throughput_workload(run.tokenizer, 1, output_length=run.sizes.single_output)
    varied = varied_output_workload(
        run.tokenizer, run.sizes.varied_requests, output_lengths=run.sizes.varied_outputs
    )
    batch1 = run.benchmark(run.context(), single, methods)
    results = run.benchmark(run.context(), varied, methods)

    def speedups(rows: list[MethodResult]) -> dict[str, float]:
        rate = {r.method: r.output_tokens_per_s for r in rows}
        return {
            dtype.removeprefix("@") or "float32": rate[f"engine-no-prefix-cache:compiled{dtype}"]
            / rate[f"engine-no-prefix-cache:eager{dtype}"]
            for dtype in dtypes
        }

    fig, axes = plt.subplots(2, 1, figsize=(10, 7), layout="constrained")
    for ax, rows, workload in ((axes[0], batch1, single), (axes[1], results, varied)):
        plot_throughput(rows, f"{workload.name}: {workload.description}", ax=ax)
    fig.suptitle(run.title("Eager against compiled (CUDA graphs on a GPU)"), fontsize=10)
    return Chapter(
        "11-compiled-step",
        varied,
        fig,
        results,
        dict(
            batch1=[asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in batch1],
            speedups=dict(batch1=speedups(batch1), varied=speedups(results)),
        ),
    )


# --- shared by the chapters --------------------------------------------------------------------


# Chapter number -> its measurement, in the order they run.
CHAPTERS = {
    "00": measure_logits,
    "01": measure_naive_cost,
    "01b": measure_sampler_cost,
    "02": measure_kv_cache,
    "03": measure_memory_waste,
    "04": measure_throughput,
    "05": measure_prefix_cache,
    "06": measure_attention_kernels,
    "07": measure_parallelism,
    "08": measure_speculative_decoding,
    "10": measure_structured_outputs,
    "11": measure_compiled_step,
}


def run_chapter(run: Run, number: str, out_dir: Path) -> bool:
    """Measure one chapter and save it; on any error, write NN.error.json (the error and its
    traceback) instead, free what the chapter held, and go on: one chapter's failure must not
    cost the others' measurements. Returns whether it succeeded."""
    start = time.perf_counter()
    try:
        chapter = CHAPTERS[number](run)
        save(run, chapter, out_dir, time.perf_counter() - start)
    except Exception as error:  # noqa: BLE001 -- recorded, and the run goes on
        record = dict(
            chapter=int(number),
            device=device_label(),
            error=f"{type(error).__name__}: {error}",
            traceback=traceback.format_exc(),
            seconds=time.perf_counter() - start,
        )
        (out_dir / f"{number}.error.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"== chapter {number} FAILED: {record['error']}\n", file=sys.stderr)
        plt.close("all")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return False
    print(f"== {chapter.stem}: {time.perf_counter() - start:.1f} s\n")
    return True


def device_slug() -> str:
    """The device's name as a directory name: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", device_label().lower()).strip("-")


def load_run(quick: bool, device: torch.device, scratch: Path) -> Run:
    """The embedded SmolLM2-135M-Instruct, or for --quick a tiny random model written to
    `scratch` that shares its tokenizer (two layers: every chapter runs in seconds on a CPU)."""
    model_dir, model_name = embedded_model_dir(), "SmolLM2-135M-Instruct"
    if quick:
        model_dir = make_tiny_model("llama", scratch, seed=0, tokenizer_dir=model_dir)
        model_name = "tiny random llama (2 layers)"
    model = load_model(model_dir, DTYPE, device)
    sizes = QUICK_SIZES if quick else GPU_SIZES
    return Run(model_dir, model_name, model, load_tokenizer(model_dir), sizes, quick)


def save(run: Run, chapter: Chapter, out_dir: Path, seconds: float) -> None:
    """NN-name.json (write_json's record and the chapter's numbers) and NN-name.png."""
    write_json(
        out_dir / f"{chapter.stem}.json",
        chapter.workload,
        chapter.results,
        chapter=chapter.number,
        model=run.model_name,
        dtype=str(DTYPE).removeprefix("torch."),
        quick=run.quick,
        seconds=seconds,
        **chapter.measured,
    )
    chapter.figure.savefig(out_dir / f"{chapter.stem}.png", dpi=120, bbox_inches="tight")
    plt.close(chapter.figure)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny model and sizes, any device (a check, not a measurement)",
    )
    parser.add_argument(
        "--chapters",
        default=",".join(CHAPTERS),
        help="comma-separated chapter numbers to measure (default: all)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"where results go, in a folder per device (default: {DEFAULT_OUT}; "
        "with --quick, a temporary directory)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Measure every chapter (or those of --chapters), each in isolation; returns the folder
    the files went to, or exits with status 1 naming the chapters that failed."""
    args = parse_args(argv)
    numbers = args.chapters.split(",")
    unknown = [number for number in numbers if number not in CHAPTERS]
    if unknown:
        raise SystemExit(f"no chapter {unknown} in gpu_bench; it measures {list(CHAPTERS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        raise SystemExit(
            "gpu_bench.py measures on a CUDA GPU and found none. On a CPU the notebooks' full "
            "mode is the measurement (make notebooks); --quick checks this script at tiny sizes."
        )
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu-bench-")) if args.quick else DEFAULT_OUT)
    out_dir = out / device_slug()
    out_dir.mkdir(parents=True, exist_ok=True)
    plt.switch_backend("agg")  # figures go to files only
    torch.manual_seed(0)
    start = time.perf_counter()
    # The tiny model's directory must outlive the run: every engine loads the model from it.
    with tempfile.TemporaryDirectory(prefix="minivllm-tiny-") as scratch:
        run = load_run(args.quick, device, Path(scratch))
        print(f"{device_label()}, {run.model_name}, {DTYPE}; results in {out_dir}")
        failed = [number for number in numbers if not run_chapter(run, number, out_dir)]
    print(f"{len(numbers)} chapters in {time.perf_counter() - start:.0f} s: {out_dir}")
    if failed:
        raise SystemExit(f"chapters {failed} failed: see their NN.error.json in {out_dir}")
    return out_dir


if __name__ == "__main__":
    main()
