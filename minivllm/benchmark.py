"""The benchmark harness: run generation methods side by side on one workload, print ratios.

These machines are noisy, so an absolute tokens/s only means something next to another
method measured in the same run. Each method generates exactly the workload's output lengths
(greedy, EOS ignored), and we also report whether its tokens equal the first method's: a
faster method that changes the answer is not an optimization.

Methods are registered by name with the chapter that introduced them; later chapters add
theirs to `METHODS`.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from minivllm.kv_cache import generate_static_batch
from minivllm.model_loader import load_model, load_tokenizer, resolve_model_path
from minivllm.models.llama import LlamaForCausalLM
from minivllm.naive import generate_with_transformers, generate_without_cache
from minivllm.request import Request
from minivllm.sampling import Sampler, SamplingParams
from minivllm.workloads import Workload


@dataclass
class BenchmarkContext:
    """The model loaded once and shared by every method of a run."""

    model_dir: Path
    model: LlamaForCausalLM
    tokenizer: object
    dtype: torch.dtype
    batch_size: int = 16  # rows per static batch
    hf_cb_max_batch_tokens: int | None = None  # generate_batch's budget (None: its default)
    engine_args: dict = field(default_factory=dict)  # extra LLM(...) arguments for engines
    engines: dict = field(default_factory=dict, repr=False)  # method name -> its LLM
    _hf_model: object = field(default=None, repr=False)

    @classmethod
    def load(
        cls,
        model=None,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 16,
        device: torch.device | str = "cpu",
    ) -> BenchmarkContext:
        model_dir = resolve_model_path(model)
        our_model = load_model(model_dir, dtype, device)
        return cls(model_dir, our_model, load_tokenizer(model_dir), dtype, batch_size)

    @property
    def hf_model(self):
        """transformers' model of the same directory, loaded on first use."""
        if self._hf_model is None:
            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
            self._hf_model = hf_model.to(self.device).eval()
        return self._hf_model

    @property
    def device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device


@dataclass
class MethodOutput:
    """What a method produced: tokens per request, and for our engine a few extras."""

    token_ids: list[list[int]]
    ttft_s: list[float] | None = None  # time to first token per request (engine only)
    prompt_tokens_computed: int | None = None  # prompt tokens not served by the prefix cache


@dataclass
class Method:
    name: str
    label: str
    chapter: int
    run: Callable[[BenchmarkContext, Workload], list[list[int]] | MethodOutput]
    # Untimed preparation (building an engine, a warm-up pass) before `run` is timed.
    setup: Callable[[BenchmarkContext, Workload], None] | None = None


@dataclass
class MethodResult:
    method: str
    label: str
    chapter: int
    seconds: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    same_tokens_as_first: float  # share of requests whose tokens equal the first method's
    median_ttft_s: float | None = None
    prompt_tokens_computed: int | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds


def _load_transformers(ctx: BenchmarkContext, workload: Workload) -> None:
    """Load transformers' model before the clock starts."""
    ctx.hf_model  # noqa: B018 (the property loads it)


def _run_transformers_one_at_a_time(ctx: BenchmarkContext, workload: Workload) -> list[list[int]]:
    # eos_token_id=None: never stop early, generate exactly the requested length.
    return [
        generate_with_transformers(ctx.hf_model, prompt, n, eos_token_id=None)
        for prompt, n in zip(workload.prompts, workload.output_lengths)
    ]


@torch.inference_mode()
def _run_transformers_static_batches(ctx: BenchmarkContext, workload: Workload) -> list[list[int]]:
    """transformers `generate` on left-padded batches: each batch runs to its longest output."""
    outputs = []
    pad_id = ctx.tokenizer.pad_token_id or 0
    for start in range(0, workload.num_requests, ctx.batch_size):
        prompts = workload.prompts[start : start + ctx.batch_size]
        lengths = workload.output_lengths[start : start + ctx.batch_size]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        generated = ctx.hf_model.generate(
            input_ids.to(ctx.device),
            attention_mask=attention_mask.to(ctx.device),
            max_new_tokens=max(lengths),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
        outputs += [row[width : width + n].tolist() for row, n in zip(generated, lengths)]
    return outputs


def _run_transformers_generate_batch(ctx: BenchmarkContext, workload: Workload) -> list[list[int]]:
    """transformers' own continuous batching (`generate_batch`, paged KV cache)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if len(set(workload.output_lengths)) != 1:
        raise ValueError("generate_batch takes one max_new_tokens for all requests")
    config = GenerationConfig(
        max_new_tokens=workload.output_lengths[0],
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    batching = ContinuousBatchingConfig(max_batch_tokens=ctx.hf_cb_max_batch_tokens)
    results = ctx.hf_model.generate_batch(
        workload.prompts, generation_config=config, continuous_batching_config=batching
    )
    return [results[f"req_{i}"].generated_tokens for i in range(workload.num_requests)]


def _run_without_cache(ctx: BenchmarkContext, workload: Workload) -> list[list[int]]:
    return [
        generate_without_cache(ctx.model, prompt, n, eos_token_id=None)
        for prompt, n in zip(workload.prompts, workload.output_lengths)
    ]


def _greedy_params(workload: Workload) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        for n in workload.output_lengths
    ]


def _greedy_requests(ctx: BenchmarkContext, workload: Workload) -> list[Request]:
    return [
        Request.create(
            str(i),
            None,
            prompt,
            params,
            ctx.tokenizer,
            eos_token_ids=(),
            max_model_len=ctx.model.config.max_model_len,
        )
        for i, (prompt, params) in enumerate(zip(workload.prompts, _greedy_params(workload)))
    ]


def _run_static_batches(
    ctx: BenchmarkContext, workload: Workload, batch_size: int
) -> list[list[int]]:
    requests = _greedy_requests(ctx, workload)
    sampler = Sampler()
    for start in range(0, len(requests), batch_size):
        generate_static_batch(ctx.model, requests[start : start + batch_size], sampler)
    return [r.output_token_ids for r in requests]


def _engine_method(name: str, label: str, chapter: int, **engine_args) -> Method:
    """Our engine, built once per method (untimed) with `engine_args` on top of the context's."""

    def setup(ctx: BenchmarkContext, workload: Workload) -> None:
        from minivllm.llm import LLM

        if name not in ctx.engines:
            args = ctx.engine_args | engine_args
            ctx.engines[name] = LLM(ctx.model_dir, dtype=ctx.dtype, device=ctx.device, **args)
        warm_up = [{"prompt_token_ids": [1, 2, 3, 4]}]  # shares no block with the workload
        ctx.engines[name].generate(warm_up, SamplingParams(max_tokens=2), use_tqdm=False)

    def run(ctx: BenchmarkContext, workload: Workload) -> MethodOutput:
        llm = ctx.engines[name]
        params = _greedy_params(workload)
        outputs = []
        for wave in workload.waves():
            prompts = [{"prompt_token_ids": workload.prompts[i]} for i in wave]
            outputs += llm.generate(prompts, [params[i] for i in wave], use_tqdm=False)
        return MethodOutput(
            token_ids=[o.outputs[0].token_ids for o in outputs],
            ttft_s=[o.metrics.time_to_first_token for o in outputs],
            prompt_tokens_computed=sum(
                len(o.prompt_token_ids) - o.num_cached_tokens for o in outputs
            ),
        )

    return Method(name, label, chapter, run, setup)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "hf",
            "transformers generate, 1 at a time",
            1,
            _run_transformers_one_at_a_time,
            setup=_load_transformers,
        ),
        Method(
            "hf-static",
            "transformers generate, padded batches",
            2,
            _run_transformers_static_batches,
            setup=_load_transformers,
        ),
        Method(
            "hf-cb",
            "transformers generate_batch (paged)",
            4,
            _run_transformers_generate_batch,
            setup=_load_transformers,
        ),
        Method("naive", "no-cache loop (ch01)", 1, _run_without_cache),
        Method(
            "kv-cache",
            "KV-cache loop, 1 at a time (ch02)",
            2,
            lambda ctx, w: _run_static_batches(ctx, w, batch_size=1),
        ),
        Method(
            "static",
            "static batching (ch02)",
            2,
            lambda ctx, w: _run_static_batches(ctx, w, batch_size=ctx.batch_size),
        ),
        _engine_method(
            "engine-no-prefix-cache",
            "continuous batching, no prefix cache (ch04)",
            4,
            enable_prefix_caching=False,
        ),
        _engine_method("engine", "paged continuous batching + prefix cache (ch05)", 5),
    )
}


def run_benchmark(
    ctx: BenchmarkContext, workload: Workload, method_names: list[str]
) -> list[MethodResult]:
    """Run each method on the workload, in order, and time it.

    A batched method can be given a batch size after a colon ("hf-static:64"); for "hf-cb"
    the number is generate_batch's token budget per step.
    """
    unknown = [name for name in method_names if name.partition(":")[0] not in METHODS]
    if unknown:
        raise ValueError(f"unknown benchmark methods {unknown}; choose from {list(METHODS)}")
    results, first_outputs = [], None
    for name in method_names:
        method, setting = METHODS[name.partition(":")[0]], name.partition(":")[2]
        if setting:
            if method.name == "hf-cb":
                ctx.hf_cb_max_batch_tokens = int(setting)
            else:
                ctx.batch_size = int(setting)
            method = replace(method, name=name, label=f"{method.label} [{setting}]")
        if method.setup is not None:
            method.setup(ctx, workload)
        start = time.perf_counter()
        output = method.run(ctx, workload)
        seconds = time.perf_counter() - start
        if not isinstance(output, MethodOutput):
            output = MethodOutput(output)
        outputs = output.token_ids
        first_outputs = first_outputs or outputs
        same = sum(a == b for a, b in zip(outputs, first_outputs)) / workload.num_requests
        results.append(
            MethodResult(
                method=name,
                label=method.label,
                chapter=method.chapter,
                seconds=seconds,
                num_requests=workload.num_requests,
                prompt_tokens=workload.num_prompt_tokens,
                output_tokens=sum(len(o) for o in outputs),
                same_tokens_as_first=same,
                median_ttft_s=statistics.median(output.ttft_s) if output.ttft_s else None,
                prompt_tokens_computed=output.prompt_tokens_computed,
            )
        )
    return results


def format_table(results: list[MethodResult], baseline: str | None = None) -> str:
    """A plain-text table: time, output tokens/s, speedup over the baseline method, and for
    our engine the median time to first token and the prompt tokens it computed."""
    base = next((r for r in results if r.method == baseline), results[0])
    lines = [
        f"{'method':<48} {'seconds':>8} {'out tok/s':>10} {'speedup':>8} {'same tokens':>11}"
        f" {'TTFT p50':>9} {'prefill tok':>11}"
    ]
    for r in results:
        speedup = r.output_tokens_per_s / base.output_tokens_per_s
        ttft = "" if r.median_ttft_s is None else f"{r.median_ttft_s:.2f}s"
        prefill = "" if r.prompt_tokens_computed is None else str(r.prompt_tokens_computed)
        lines.append(
            f"{r.label:<48} {r.seconds:>8.2f} {r.output_tokens_per_s:>10.1f} {speedup:>7.2f}x"
            f" {r.same_tokens_as_first:>10.0%} {ttft:>9} {prefill:>11}"
        )
    lines.append(f"(speedup relative to: {base.label}; prompt tokens in all: {base.prompt_tokens})")
    return "\n".join(lines)


def write_json(path: str | Path, workload: Workload, results: list[MethodResult], **extra) -> None:
    """Results with their workload and device, for plots and later comparison."""
    record = {
        "workload": {"name": workload.name, "description": workload.description},
        "device": device_label(),
        "results": [asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in results],
        **extra,
    }
    Path(path).write_text(json.dumps(record, indent=2))


def device_label() -> str:
    """A short name of the device, for figure titles and tables."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores)"
