"""What every chapter's measurement shares: the sizes, the run (the model loaded once), the
chapter's record and how it is saved, what the figures of the chapters that draw one share, and
the helpers two or more chapters use (a decode step over random K/V, chat requests,
tensor-parallel sizes, all-reduces between processes).
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from matplotlib.axes import Axes

from minivllm.attention.backend import PagedKVCache
from minivllm.baselines.kv_cache import ContiguousKVCache
from minivllm.bench.attention import AttentionStep, one_layer_pool, random_decode_step, random_step
from minivllm.bench.benchmark import (
    BenchmarkContext,
    MethodResult,
    device_label,
    format_table,
    run_benchmark,
    speedup_of,
    synchronize,
    workload_kv_cache_bytes,
    write_json,
)
from minivllm.bench.measure import Spread, Timings, interleaved, rate_spread, ratio_spread
from minivllm.bench.workloads import Workload, varied_output_workload
from minivllm.config import EngineConfig, ModelConfig
from minivllm.entrypoints.llm import LLM
from minivllm.executor.multiproc import free_port
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.loader import embedded_model_dir, load_model, load_tokenizer
from minivllm.models.tiny import make_tiny_model
from minivllm.sample.sampling_params import SamplingParams
from minivllm.tokenizer import apply_chat_template

DTYPE = torch.float32
MiB = 2**20
Result = TypeVar("Result")


def size(full, quick):
    """A measurement's size in a full run on a GPU and in a quick run (a field of `Sizes`)."""
    return field(default=full, metadata={"quick": quick})


# Every size twice, `size(a full run on a GPU, a quick run)`. The quick ones run every chapter in
# seconds on a CPU; the full ones take minutes a chapter on an H200 (the README says how long).
@dataclass(frozen=True)
class Sizes:
    """How much each chapter measures."""

    # ch00: chat prompts whose logits are compared with transformers'
    logit_prompts: int = size(8, 3)
    # shortest and longest of them, tokens
    logit_prompt_lengths: tuple[int, int] = size((20, 1000), (20, 120))
    # ch01: sequence lengths of one no-cache step
    step_lengths: tuple[int, ...] = size((16, 64, 128, 256, 512, 1024, 2048), (16, 64, 128))
    naive_requests: int = size(4, 2)  # ch01: requests of the no-cache loop against `generate`
    naive_output: int = size(128, 6)  # ch01: tokens each of them generates
    # ch02: requests of the methods side by side (one static batch)
    speedup_requests: int = size(16, 3)
    speedup_output: int = size(32, 6)
    # ch02: rows of the decode-step sweep
    decode_rows: tuple[int, ...] = size((1, 2, 4, 8, 16, 32, 64, 128, 256, 512), (1, 2, 4))
    decode_context: int = size(128, 32)  # ch02: cached tokens per row in that sweep
    varied_requests: int = size(64, 6)  # ch02-04: the varied-output workload
    varied_outputs: tuple[int, int] = size((16, 256), (4, 16))
    seats: int = size(16, 3)  # ch04: sequences at once, static batches and the engine alike
    # ch03: block sizes of the paged decode-attention sweep
    block_sizes: tuple[int, ...] = size((1, 2, 4, 8, 16, 32, 64, 128, 256), (1, 4, 16))
    attention_seqs: int = size(64, 4)  # ch03: sequences in that sweep
    attention_seq_len: int = size(1024, 64)  # ch03: tokens of each
    prefix_requests: int = size(64, 4)  # ch05: the shared-prefix workload
    system_prompt_length: int = size(1000, 200)
    prefix_output: int = size(16, 4)
    # ch05: the engines' token budget per step (the engine's default: one or two of the
    # ~1030-token prompts). Requests admitted in the same step cannot hit each other's blocks
    # (they are cached once computed), so the budget must not admit them all.
    prefix_step_tokens: int = size(2048, 128)
    # ch06: decode batches of the attention-backend grid
    kernel_batches: tuple[int, ...] = size((1, 16, 64), (1, 2))
    # ch06: context lengths of that grid, tokens
    kernel_contexts: tuple[int, ...] = size((512, 2048, 4096), (32, 64))
    # ch06: new tokens of the timed prefill chunk (after as many cached)
    prefill_chunk: int = size(2048, 32)
    # ch07: float32 values of each timed all-reduce, 1 KiB to 256 MiB. Quick: up to 16 MiB: on
    # a 2-core CPU a small all-reduce's median varies from 0.3 to 3.5 ms, and the largest
    # (~14 ms) must stand clear of that for the fit to find a bandwidth.
    all_reduce_elements: tuple[int, ...] = size(
        tuple(4**k for k in range(4, 14)), (2**8, 2**12, 2**16, 2**20, 2**22)
    )
    all_reduce_repeats: int = size(20, 20)  # ch07: all-reduces per size; the median counts
    # ch07: rows of the measured decode steps
    parallel_batches: tuple[int, ...] = size((1, 4, 16, 64, 256), (1, 4))
    # ch07: cached tokens per row, there and in the projection
    parallel_context: int = size(1024, 32)
    # ch07: side of the square products that measure the matmul peak (1 TFLOP a product: long
    # enough for the clock, as a 2048 one is not)
    matmul_size: int = size(8192, 256)
    # ch07: size of the copy that measures the memory bandwidth
    copy_megabytes: int = size(1024, 16)
    # ch08: most tokens each request generates (a copy ends on its own: a paragraph's copy is
    # 40-60 tokens, it ends before)
    spec_output: int = size(96, 8)
    # ch08: copying requests at once in the batch sweep
    spec_batches: tuple[int, ...] = size((1, 4, 16, 32, 64), (1, 2))
    # From well below the engine's capacity to past it; 64 requests take 16 s at the lowest.
    # ch09: offered request rates, requests/s (inf: all at once)
    serve_rates: tuple[float, ...] = size(
        (4.0, 16.0, 64.0, 256.0, float("inf")), (8.0, float("inf"))
    )
    serve_requests: int = size(64, 3)  # ch09: requests sent at each rate, fresh prompts every rate
    serve_output: int = size(64, 4)  # ch09: tokens each of them generates
    serve_seats: int = size(64, 4)  # ch09: the server's max_num_seqs
    serve_seconds: float = size(30.0, 20.0)  # ch09: most seconds a rate may take
    single_output: int = size(128, 8)  # ch11: tokens the one batch-1 request decodes
    # ch01b: rows of logits the sampler picks from at once
    sampler_batches: tuple[int, ...] = size((1, 32, 256), (1, 4))
    grammar_requests: int = size(32, 2)  # ch10: requests answered with and without a JSON schema
    grammar_output: int = size(64, 12)  # ch10: most tokens each of them generates
    smoke_output: int = size(16, 4)  # smoke: tokens each engine of the smoke generates
    # Timed rounds of a micro-benchmark, after one untimed: the median counts.
    repeats: int = size(5, 2)
    # Timed rounds of a whole workload on engines side by side (one untimed round first where
    # there are more than one): the median counts, ratios taken round by round. Quick: one
    # round, no warm-up (each round costs a whole workload).
    engine_repeats: int = size(3, 1)


GPU_SIZES = Sizes()
QUICK_SIZES = Sizes(**{each.name: each.metadata["quick"] for each in fields(Sizes)})


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
        return self.model.device

    def context(self, **settings) -> BenchmarkContext:
        """A fresh benchmark context on the shared model: its own engines, its own settings."""
        return BenchmarkContext(self.model_dir, self.model, self.tokenizer, DTYPE, **settings)

    def benchmark(
        self, ctx: BenchmarkContext, workload: Workload, methods: list[str]
    ) -> list[MethodResult]:
        """`run_benchmark` in `engine_repeats` rounds, with the table printed. The matmul peak
        (for MFU) is measured in a full run only: a quick run is a check, and the peak takes
        seconds on a CPU."""
        if self.device.type == "cpu":
            # On CUDA the benchmark sizes each engine's KV pool for the workload itself; on the
            # CPU an engine takes a default of 2 GiB, zeroed as it is allocated: most of a
            # quick run's time. The same sizing keeps it small.
            budget = self.kv_budget(workload, DTYPE, ctx.engine_args.get("block_size"))
            ctx.engine_args.setdefault("kv_cache_memory_bytes", budget)
        repeats = self.sizes.engine_repeats
        results = run_benchmark(
            ctx, workload, methods, not self.quick, repeats, warmups=int(repeats > 1)
        )
        print(format_table(results))
        return results

    def engine(self, workload: Workload, dtype: torch.dtype = DTYPE, **settings) -> LLM:
        """An engine on the run's model and device in `dtype`, its KV pool sized for
        `workload` (`kv_budget`), with the engine settings `settings`."""
        budget = self.kv_budget(workload, dtype)
        settings = (
            dict(dtype=dtype, device=str(self.device), kv_cache_memory_bytes=budget) | settings
        )
        return LLM(str(self.model_dir), **settings)

    def varied_workload(self) -> Workload:
        """The varied-output workload at the run's sizes: chapters 02-04's, 06's, 07's, 11's."""
        sizes = self.sizes
        return varied_output_workload(
            self.tokenizer, sizes.varied_requests, output_lengths=sizes.varied_outputs
        )

    def kv_budget(
        self, workload: Workload, dtype: torch.dtype = DTYPE, block_size: int | None = None
    ) -> int:
        """Bytes of a KV pool that holds every request of `workload` at once: an engine left to
        itself takes most of a GPU that this process already uses, or 2 GiB of CPU memory,
        zeroed as it is allocated."""
        block_size = block_size or EngineConfig.block_size
        return workload_kv_cache_bytes(workload, self.model.config, dtype, block_size)

    def rounds(
        self,
        runs: Mapping[str, Callable[[], Result]],
        repeats: int | None = None,
        warmups: int = 1,
        prepare: Mapping[str, Callable[[], None]] | None = None,
    ) -> Timings[Result]:
        """`interleaved` on the run's device: the methods in `repeats` rounds (`sizes.repeats`
        by default) after `warmups` untimed ones, `prepare[name]` untimed before each call of
        that method, the device synchronized around each call (a GPU returns before its work
        is done)."""
        repeats = self.sizes.repeats if repeats is None else repeats
        sync = partial(synchronize, self.device)
        return interleaved(runs, repeats, warmups, prepare, synchronize=sync)

    def sweep(self, runs: Mapping[object, Callable[[], object]]) -> list[Spread]:
        """Seconds of each of `runs`, keyed by what varies (a length, a batch), the calls
        interleaved in `rounds`: a spread per key, in the keys' order."""
        timings = self.rounds({str(key): call for key, call in runs.items()})
        return [timings.spread(str(key)) for key in runs]

    def engine_rounds(
        self,
        runs: Mapping[str, Callable[[], Result]],
        prepare: Mapping[str, Callable[[], None]] | None = None,
    ) -> Timings[Result]:
        """`rounds` of whole workloads on engines: `engine_repeats` rounds, one untimed first
        where there are more than one (as `benchmark` runs them)."""
        repeats = self.sizes.engine_repeats
        return self.rounds(runs, repeats, int(repeats > 1), prepare)

    def figure(
        self, what: str, workload: Workload | None, size: tuple[float, float], *grid: int
    ) -> tuple[plt.Figure, Any]:
        """A figure of `grid` (rows, columns) panels, one by default, titled with the
        measurement, model, dtype, device and workload."""
        fig, axes = plt.subplots(*grid, figsize=size, layout="constrained")
        title = f"{what} · {self.model_name} · {dtype_name(DTYPE)} · {device_label()}"
        if workload is not None:
            title += f"\n{workload.name}: {workload.description}"
        fig.suptitle(title, fontsize=10)
        return fig, axes


@dataclass
class Chapter:
    """One chapter's measurement, ready to be written out."""

    stem: str  # "04-throughput": the names of its JSON and its figure
    workload: Workload  # what it measured on (for chapter 00, the prompts it compared on)
    results: list[MethodResult] = field(default_factory=list)  # methods timed side by side
    measured: dict = field(default_factory=dict)  # the chapter's own numbers
    # What the chapter's notebook does not draw of the record; None where it draws all of it
    # (its section "On a GPU": the plotting lives there) and for the smoke.
    figure: plt.Figure | None = None
    # What went wrong although the record could be written (the smoke's failing branches):
    # the record is saved, and the run counts the chapter as failed.
    failures: list[str] = field(default_factory=list)


def chapter_number(key: str) -> int | None:
    """The book chapter a key or stem feeds: "01b" and "01b-sampler-cost" -> 1; None for the
    smoke, which feeds none."""
    return int(key[:2]) if key[:2].isdigit() else None


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as the records and method names spell a dtype."""
    return str(dtype).removeprefix("torch.")


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


def spread_record(spread: Spread, scale: float = 1.0) -> dict[str, float]:
    """Rounds as the JSON records keep them, next to the median they quote: {median, low,
    high}, times `scale` (1e3: milliseconds), for a figure's error bars."""
    return dict(median=spread.median * scale, low=spread.low * scale, high=spread.high * scale)


def quoted(key: str, spreads: Spread | list[Spread], scale: float = 1.0) -> dict:
    """How a record quotes rounds: under `key` the median (a list of them, for a list of
    spreads), under `key`_spread each one's `spread_record`, all times `scale`."""
    if isinstance(spreads, Spread):
        return {key: spreads.median * scale, f"{key}_spread": spread_record(spreads, scale)}
    records = [spread_record(spread, scale) for spread in spreads]
    return {key: [record["median"] for record in records], f"{key}_spread": records}


def plot_spreads(ax: Axes, xs: list, records: list[dict], scale: float = 1.0, **look) -> None:
    """Medians joined by a line, each with its rounds' range as an error bar: `spread_record`s,
    times `scale`."""
    records = [{name: value * scale for name, value in record.items()} for record in records]
    medians = [record["median"] for record in records]
    ax.errorbar(xs, medians, yerr=error_bars(records), fmt="o-", capsize=3, **look)


def error_bars(records: list[dict[str, float]]) -> list[list[float]]:
    """The rounds' range about each median of `spread_record`s, as matplotlib's yerr."""
    below = [record["median"] - record["low"] for record in records]
    return [below, [record["high"] - record["median"] for record in records]]


def style(
    ax: Axes,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    log2_ticks: Sequence | None = None,
    log_y: bool = False,
    legend: int | None = None,
    grid: str | None = "both",
) -> None:
    """What the panels set alike: the axes' labels, a title, a log2 x axis ticked at
    `log2_ticks`, a log y axis, a legend in `legend`-point type, a light grid (on `grid`:
    "both", "x" or "y"; None: none)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title, fontsize=9)
    if log2_ticks is not None:
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(log2_ticks), [str(tick) for tick in log2_ticks])
    if log_y:
        ax.set_yscale("log")
    if legend:
        ax.legend(fontsize=legend)
    if grid:
        ax.grid(axis=grid, alpha=0.3)


def result_speedup(results: list[MethodResult], method: str, baseline: str) -> Spread:
    """`method`'s output tokens/s over `baseline`'s among `results`, round by round."""
    by_name = {result.method: result for result in results}
    return speedup_of(by_name[method], by_name[baseline])


def speedup_records(
    results: Mapping[str, list[MethodResult]], pairs: Mapping[str, tuple[str, str]]
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, dict[str, float]]]]:
    """Each (method, baseline) of `pairs` compared in each list of `results` (`result_speedup`:
    round by round), as a record keeps them: results' key -> pair's key -> the median it
    quotes, and beside them each speedup's {median, low, high}."""
    spreads = {
        key: {name: result_speedup(rows, *pair) for name, pair in pairs.items()}
        for key, rows in results.items()
    }
    medians = {key: {k: s.median for k, s in inner.items()} for key, inner in spreads.items()}
    records = {
        key: {k: spread_record(s) for k, s in inner.items()} for key, inner in spreads.items()
    }
    return medians, records


def generate_tokens(
    llm: LLM, prompts: list[dict], params: SamplingParams, alone: bool = False
) -> list[list[int]]:
    """Each request's tokens, all submitted at once or, `alone`, each run by itself (batch 1).
    `generate` returns tokens on the host: the device is done when it returns."""
    batches = [[prompt] for prompt in prompts] if alone else [prompts]
    return [
        list(output.outputs[0].token_ids)
        for batch in batches
        for output in llm.generate(batch, params, use_tqdm=False)
    ]


def rate_and_ratio(timings: Timings, method: str, baseline: str) -> tuple[Spread, Spread]:
    """`method`'s output tokens per second (its calls return their tokens), and its rate over
    `baseline`'s, both round by round (greedy: the same tokens every round)."""
    rates = {
        name: rate_spread(sum(map(len, timings.results[name])), timings.spread(name))
        for name in (method, baseline)
    }
    return rates[method], ratio_spread(rates[method], rates[baseline])


def save(run: Run, chapter: Chapter, out_dir: Path, seconds: float) -> None:
    """NN-name.json (write_json's record and the chapter's numbers), and NN-name.png where the
    chapter draws a figure."""
    write_json(
        out_dir / f"{chapter.stem}.json",
        chapter.workload,
        chapter.results,
        chapter=chapter_number(chapter.stem),
        model=run.model_name,
        dtype=dtype_name(DTYPE),
        quick=run.quick,
        seconds=seconds,
        **chapter.measured,
    )
    if chapter.figure is not None:
        chapter.figure.savefig(out_dir / f"{chapter.stem}.png", dpi=120, bbox_inches="tight")
        plt.close(chapter.figure)


# --- shared by two or more chapters --------------------------------------------------------


def time_decode_steps(
    run: Run, batches: Iterable[int], context: int, model: LlamaForCausalLM | None = None
) -> list[Spread]:
    """Seconds of one decode step at each of `batches`, the batches interleaved in rounds
    (`Run.sweep`): that many rows over random stand-in K/V, `context` cached tokens per row,
    `model` in its own dtype (the run's by default; chapter 07 times a bfloat16 copy)."""
    model = model or run.model
    config, device = model.config, run.device
    steps = {}
    for rows in batches:
        cache = ContiguousKVCache(config, rows, context + 1, model.dtype, device)
        cache.keys.normal_()
        cache.values.normal_()
        ids = torch.randint(0, config.vocab_size, (rows,), device=device)  # a new token per row
        positions = torch.full((rows,), context, device=device)
        seq_lens = positions + 1  # cached tokens and the new one
        steps[rows] = partial(_decode_step, model, ids, positions, cache, seq_lens)
    return run.sweep(steps)


@torch.inference_mode()
def _decode_step(model: LlamaForCausalLM, ids, positions, cache, seq_lens) -> torch.Tensor:
    return model.compute_logits(model(ids, positions, cache.decode(seq_lens)))


def decode_attention_step(
    run: Run, seqs: int, context: int, block_size: int = 16, pool_seqs: int | None = None
) -> tuple[PagedKVCache, AttentionStep]:
    """A decode step of `seqs` sequences of `context` tokens over random K/V, their blocks
    scattered over a one-layer pool of the model's shapes with room for `pool_seqs` (`seqs` by
    default) such sequences: bench/attention.py's pool and step, in the run's dtype."""
    config = run.model.config
    pool = one_layer_pool(config, pool_seqs or seqs, context, block_size, DTYPE, run.device)
    return pool, random_decode_step(config, pool, seqs, context)


def prefill_chunk(run: Run) -> tuple[PagedKVCache, AttentionStep]:
    """Chapter 06's prefill chunk: `prefill_chunk` new tokens after as many cached."""
    config, chunk = run.model.config, run.sizes.prefill_chunk
    pool = one_layer_pool(config, 1, 2 * chunk, 16, DTYPE, run.device)
    return pool, random_step(config, pool, [chunk], [2 * chunk])


def chat_requests(run: Run, messages: list[str]) -> list[dict]:
    """Each message as a one-turn chat prompt, in the run's tokenizer's template."""
    return [
        {"prompt_token_ids": apply_chat_template(run.tokenizer, [{"role": "user", "content": m}])}
        for m in messages
    ]


def chat_workload(name: str, prompts: list[dict], output: int, description: str) -> Workload:
    """A workload of `chat_requests` prompts, each generating at most `output` tokens."""
    ids = [prompt["prompt_token_ids"] for prompt in prompts]
    return Workload(name, ids, [output] * len(ids), description)


def free_memory() -> None:
    """Collect what the last measurement dropped, and give its GPU memory back to the device:
    the next engine then finds it free (and memory readings count it as free)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


def all_reduce_between_processes(backend: str, counts: list[int], repeats: int) -> list[dict]:
    """`measure_all_reduce`'s rows from 2 spawned processes in a `backend` group, under NCCL
    each rank on a GPU of its own (`RankPool`'s ranks speak gloo, on the CPU only)."""
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
        # Five untimed calls set up the connections and their buffers; NCCL returns at once and
        # the sum arrives later, hence the synchronize.
        runs = {"all_reduce": partial(dist.all_reduce, x)}
        timings = interleaved(runs, repeats, 5, synchronize=partial(synchronize, device))
        rank_medians.append(timings.spread("all_reduce").median)
    medians.put(rank_medians)
    dist.destroy_process_group()
