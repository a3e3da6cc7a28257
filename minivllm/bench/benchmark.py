"""The benchmark harness: run generation methods side by side on one workload, print ratios.

These machines are noisy, so an absolute tokens/s only means something next to another
method measured in the same run. Each method generates exactly the workload's output lengths
(greedy, EOS ignored), and we also report whether its tokens equal the first method's: a
faster method that changes the answer is not an optimization.

Methods are registered by name with the chapter that introduced them; later chapters add
theirs to `METHODS`.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from minivllm.baselines.kv_cache import generate_static_batch
from minivllm.baselines.naive import generate_with_transformers, generate_without_cache
from minivllm.bench.measure import Spread, interleaved, ratio_within_rounds, synchronize
from minivllm.bench.roofline import weight_count
from minivllm.bench.workloads import Workload
from minivllm.config import QUANTIZATION_METHODS, EngineConfig, ModelConfig, resolve_dtype
from minivllm.core.request import Request
from minivllm.models.linear import linear, pack_weight
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.loader import load_model, load_tokenizer, resolve_model_path
from minivllm.sample.sampler import Sampler
from minivllm.sample.sampling_params import SamplingParams
from minivllm.utils import cdiv
from minivllm.worker.cpu_allocator import keep_freed_memory_in_process


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
    # What follows "engine:" in a method's name: an attention backend (chapter 06), tp=N,
    # dp=M (chapter 07), eager or compiled (chapter 11), a quantization (chapter 12),
    # comma-separated; see `engine_overrides`.
    engine_setting: str = ""
    # method name (with ":setting" when there is one) -> its LLM
    engines: dict = field(default_factory=dict, repr=False)
    _hf_model: object = field(default=None, repr=False)
    _other_dtypes: dict = field(default_factory=dict, repr=False)  # dtype -> sibling context

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

    def with_dtype(self, dtype: torch.dtype) -> BenchmarkContext:
        """The same context with the model in another dtype, loaded on first use."""
        if dtype == self.dtype:
            return self
        if dtype not in self._other_dtypes:
            self._other_dtypes[dtype] = replace(
                self,
                model=load_model(self.model_dir, dtype, self.device),
                dtype=dtype,
                engines={},
                _hf_model=None,
                _other_dtypes={},
            )
        return self._other_dtypes[dtype]

    def close_engines(self) -> None:
        """Let go of every engine the methods built, in this dtype and the others: vLLM's
        processes are stopped and our engines' pools freed, so that the next methods start
        with the machine's memory."""
        for ctx in [self, *self._other_dtypes.values()]:
            for engine in ctx.engines.values():
                if hasattr(engine, "close"):  # a peer's process (vllm_peer.py, llamacpp_peer.py)
                    engine.close()
            ctx.engines.clear()

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
        return self.model.device


@dataclass
class MethodOutput:
    """What a method produced: tokens per request, and for our engine a few extras."""

    token_ids: list[list[int]]
    ttft_s: list[float] | None = None  # time to first token per request (engine only)
    # Per request, the prompt tokens the prefix cache served (engine only): work not computed.
    cached_prompt_tokens: list[int] | None = None


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
    seconds: float  # the median of the timed rounds
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    same_tokens_as_first: float  # share of requests whose tokens equal the first method's
    # Share of output tokens that equal the first method's before the request's first
    # difference (1.0: identical; a lower dtype typically drifts after a while).
    matching_tokens: float = 1.0
    dtype: str = "float32"
    # FLOPs computed (`model_flops` without the tokens the prefix cache served): the MFU's.
    model_flops: float = 0.0
    # FLOPs the whole workload needs, cached tokens included: the work delivered.
    workload_flops: float = 0.0
    matmul_peak_flops: float | None = None  # measured peak of this dtype, FLOP/s
    median_ttft_s: float | None = None
    prompt_tokens_computed: int | None = None
    # Seconds of each timed round (interleaved with the other methods'); empty when unknown.
    round_seconds: list[float] = field(default_factory=list)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def mfu(self) -> float | None:
        """Model-FLOPs utilisation: the FLOPs computed per second over the matmul peak. Tokens
        the prefix cache served are not computed, so they do not count; it cannot exceed 1."""
        if not self.matmul_peak_flops:
            return None
        return self.model_flops / self.seconds / self.matmul_peak_flops


def _transformers_method(name: str, label: str, chapter: int, run: Callable) -> Method:
    """A method of transformers' (its label after "transformers "), its model loaded before
    the clock starts."""

    def load_transformers(ctx: BenchmarkContext, workload: Workload) -> None:
        ctx.hf_model  # noqa: B018 (the property loads it)

    return Method(name, f"transformers {label}", chapter, run, setup=load_transformers)


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
    # Room for every request at once, as our engine's pool has. Left to itself, generate_batch
    # sizes its cache from the memory this process has not used yet (on CPU: total RAM minus
    # the resident size), which depends on whatever the benchmark ran before.
    batching = ContinuousBatchingConfig(max_batch_tokens=ctx.hf_cb_max_batch_tokens)
    batching.num_blocks = sum(
        cdiv(len(prompt) + output, batching.page_size)
        for prompt, output in zip(workload.prompts, workload.output_lengths)
    )
    results = ctx.hf_model.generate_batch(
        workload.prompts, generation_config=config, continuous_batching_config=batching
    )
    return [results[f"req_{i}"].generated_tokens for i in range(workload.num_requests)]


def _run_without_cache(ctx: BenchmarkContext, workload: Workload) -> list[list[int]]:
    return [
        generate_without_cache(ctx.model, prompt, n, eos_token_id=None)
        for prompt, n in zip(workload.prompts, workload.output_lengths)
    ]


def greedy_params(workload: Workload) -> list[SamplingParams]:
    """Each request's sampling: greedy, exactly its output length (EOS ignored)."""
    return [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        for n in workload.output_lengths
    ]


def greedy_requests(ctx: BenchmarkContext, workload: Workload) -> list[Request]:
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
        for i, (prompt, params) in enumerate(zip(workload.prompts, greedy_params(workload)))
    ]


def _run_static_batches(
    ctx: BenchmarkContext, workload: Workload, batch_size: int
) -> list[list[int]]:
    requests = greedy_requests(ctx, workload)
    sampler = Sampler()
    for start in range(0, len(requests), batch_size):
        generate_static_batch(ctx.model, requests[start : start + batch_size], sampler)
    return [r.output_token_ids for r in requests]


def _engine_method(name: str, label: str, chapter: int, **engine_args) -> Method:
    """Our engine, built once per method (untimed) with `engine_args` on top of the context's."""

    def engine_key(ctx: BenchmarkContext) -> str:
        return f"{name}:{ctx.engine_setting}" if ctx.engine_setting else name

    def setup(ctx: BenchmarkContext, workload: Workload) -> None:
        from minivllm.entrypoints.llm import LLM

        key = engine_key(ctx)
        args = ctx.engine_args | engine_args | engine_overrides(ctx.engine_setting)
        if ctx.device.type == "cuda" and "kv_cache_memory_bytes" not in args:
            # Left to itself, an engine on CUDA takes gpu_memory_utilization (90%) of the GPU,
            # minus what this process already holds: the next method's engine (each LLM loads
            # its own copy of the model) would find nothing left. A pool sized for the workload
            # lets every engine of a run sit side by side. The CPU keeps its default budget.
            block_size = args.get("block_size", EngineConfig.block_size)
            budget = workload_kv_cache_bytes(workload, ctx.model.config, ctx.dtype, block_size)
            args["kv_cache_memory_bytes"] = budget
            built = ctx.engines.get(key)
            if built is not None and built.llm_engine.config.kv_cache_memory_bytes < budget:
                del ctx.engines[key]  # built for a smaller workload: build it again
        if key not in ctx.engines:
            ctx.engines[key] = LLM(ctx.model_dir, dtype=ctx.dtype, device=ctx.device, **args)
            check_attention_backend(ctx.engines[key], args.get("attention_backend", "auto"), key)
        warm_up = [{"prompt_token_ids": [1, 2, 3, 4]}]  # shares no block with the workload
        ctx.engines[key].generate(warm_up, SamplingParams(max_tokens=2), use_tqdm=False)
        # Every run starts cold: an engine reused for a second workload would otherwise find
        # the first one's prompts in its prefix cache.
        ctx.engines[key].reset_prefix_cache()

    def run(ctx: BenchmarkContext, workload: Workload) -> MethodOutput:
        llm = ctx.engines[engine_key(ctx)]
        params = greedy_params(workload)
        outputs = []
        for wave in workload.waves():
            prompts = [{"prompt_token_ids": workload.prompts[i]} for i in wave]
            outputs += llm.generate(prompts, [params[i] for i in wave], use_tqdm=False)
        return MethodOutput(
            token_ids=[o.outputs[0].token_ids for o in outputs],
            ttft_s=[o.metrics.time_to_first_token for o in outputs],
            cached_prompt_tokens=[o.num_cached_tokens for o in outputs],
        )

    return Method(name, label, chapter, run, setup)


def check_attention_backend(llm, requested: str, method: str) -> None:
    """A row named after an attention backend must run it: a backend that cannot run on the
    device falls back to the torch reference (with a warning), which would otherwise be timed
    under the name asked for. Engines whose workers live in other processes (data
    parallelism) are not looked into."""
    worker = getattr(getattr(llm.llm_engine, "executor", None), "driver_worker", None)
    if requested == "auto" or worker is None:
        return
    running = worker.attention_backend.name
    if running != requested:
        raise ValueError(
            f"method {method!r} asked for the {requested!r} attention backend, and the engine "
            f"fell back to {running!r} (its warning says why): not a measurement of {requested!r}"
        )


def _vllm_method(name: str, label: str, tuned: bool) -> Method:
    """The real vLLM (chapter 11) in a process of its own, started once per method and dtype
    (untimed): `bench/vllm_peer.py`."""

    def setup(ctx: BenchmarkContext, workload: Workload) -> None:
        from minivllm.bench.vllm_peer import VLLMPeer

        if name not in ctx.engines:
            longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lengths))
            ctx.engines[name] = VLLMPeer(
                ctx.model_dir,
                dtype=str(ctx.dtype).removeprefix("torch."),
                tuned=tuned,
                max_model_len=min(max(2048, longest), ctx.model.config.max_model_len),
                enable_prefix_caching=True,  # vLLM's default, as our "engine" method's
            )

    def run(ctx: BenchmarkContext, workload: Workload) -> list[list[int]]:
        token_ids: list[list[int]] = [[] for _ in workload.prompts]
        for number, wave in enumerate(workload.waves()):
            outputs = ctx.engines[name].generate(
                [workload.prompts[i] for i in wave],
                [workload.output_lengths[i] for i in wave],
                reset_prefix_cache=number == 0,  # every run starts cold, later waves share
            )
            for i, tokens in zip(wave, outputs):
                token_ids[i] = tokens
        return token_ids

    return Method(name, label, 11, run, setup)


def _llamacpp_method() -> Method:
    """llama.cpp on the model's GGUF file (chapter 12), in a process of its own, started once
    (untimed): `bench/llamacpp_peer.py`. One request at a time, on as many threads as torch's."""

    def setup(ctx: BenchmarkContext, workload: Workload) -> None:
        from minivllm.bench.llamacpp_peer import LlamaCppPeer
        from minivllm.models.loader import gguf_file_of

        if "llamacpp" not in ctx.engines:
            longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lengths))
            ctx.engines["llamacpp"] = LlamaCppPeer(
                gguf_file_of(ctx.model_dir), longest, torch.get_num_threads()
            )

    def run(ctx: BenchmarkContext, workload: Workload) -> list[list[int]]:
        return ctx.engines["llamacpp"].generate(workload.prompts, workload.output_lengths)

    return Method("llamacpp", "llama.cpp, the GGUF file (Q4_1)", 12, run, setup)


def workload_kv_cache_bytes(
    workload: Workload, config: ModelConfig, dtype: torch.dtype, block_size: int
) -> int:
    """Bytes of a KV pool that holds every request of `workload` at once: each request's prompt
    and output rounded up to whole blocks, plus an eighth (at least one block) as a margin, for
    the warm-up request and so that no run sits at the edge of preemption."""
    blocks = sum(
        cdiv(len(prompt) + output, block_size)
        for prompt, output in zip(workload.prompts, workload.output_lengths)
    )
    blocks += cdiv(blocks, 8)
    return blocks * block_size * config.kv_bytes_per_token(dtype)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        _transformers_method("hf", "generate, 1 at a time", 1, _run_transformers_one_at_a_time),
        _transformers_method(
            "hf-static", "generate, padded batches", 2, _run_transformers_static_batches
        ),
        _transformers_method(
            "hf-cb", "generate_batch (paged)", 4, _run_transformers_generate_batch
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
        _vllm_method("vllm", "vLLM (CPU build), its default", tuned=False),
        _vllm_method("vllm-tuned", "vLLM (CPU build), tuned as its docs say", tuned=True),
        _llamacpp_method(),
    )
}


def run_benchmark(
    ctx: BenchmarkContext,
    workload: Workload,
    method_names: list[str],
    measure_peak: bool = True,
    repeats: int = 1,
    warmups: int = 0,
) -> list[MethodResult]:
    """Run each method on the workload and time it, the methods interleaved in rounds
    (`bench/measure.py`): `warmups` rounds untimed, then `repeats` timed ones; a result's
    `seconds` is the median of its rounds.

    A batched method can be given a batch size after a colon ("hf-static:64"); for "hf-cb"
    the number is generate_batch's token budget per step; for an engine, the setting names its
    attention backend ("engine:flex", chapter 06) and how it is parallel ("engine:tp=3",
    "engine:dp=2,flex", chapter 07). A dtype after an "@" runs the
    method with the model in that dtype ("engine@bfloat16"), so that dtypes compare side by
    side in one run. With `measure_peak`, each dtype's matmul peak is measured once, for the
    model-FLOPs utilisation column.
    """
    repeated = sorted({name for name in method_names if method_names.count(name) > 1})
    if repeated:
        raise ValueError(
            f"benchmark method(s) {', '.join(repeated)} given more than once: to run a method"
            " several times, interleaved with the others, ask for repeats"
        )
    specs = [_parse_method(name, ctx.device) for name in method_names]
    keep_freed_memory_in_process()  # process-wide: the same allocator for every method
    prompt_lengths = [len(prompt) for prompt in workload.prompts]
    workload_flops = model_flops(ctx.model.config, prompt_lengths, workload.output_lengths)
    peaks: dict[torch.dtype, float] = {}
    runs, prepare, contexts, labels = {}, {}, {}, {}
    for name, (method, setting, dtype) in zip(method_names, specs):
        run_ctx = ctx.with_dtype(dtype or ctx.dtype)
        if setting:
            if method.name == "hf-cb":
                run_ctx.hf_cb_max_batch_tokens = int(setting)
            elif method.name.startswith("engine"):
                run_ctx = replace(run_ctx, engine_setting=setting)
            else:
                run_ctx.batch_size = int(setting)
        label = method.label + (f" [{setting}]" if setting else "")
        labels[name] = label + (f" {_short_dtype(run_ctx.dtype)}" if dtype else "")
        if measure_peak and run_ctx.dtype not in peaks:
            peaks[run_ctx.dtype] = measure_matmul_peak(run_ctx.dtype, run_ctx.device)
        contexts[name] = run_ctx
        runs[name] = functools.partial(method.run, run_ctx, workload)
        if method.setup is not None:  # untimed, before every timed run
            prepare[name] = functools.partial(method.setup, run_ctx, workload)
    timings = interleaved(
        runs, repeats, warmups, prepare, synchronize=lambda: synchronize(ctx.device)
    )
    results, first_outputs = [], None
    for name, (method, _, _) in zip(method_names, specs):
        output = timings.results[name]
        if not isinstance(output, MethodOutput):
            output = MethodOutput(output)
        outputs = output.token_ids
        cached = output.cached_prompt_tokens
        # Less the prompt tokens a prefix cache served (None: all computed, the workload's FLOPs).
        computed_flops = model_flops(
            ctx.model.config, prompt_lengths, workload.output_lengths, cached
        )
        first_outputs = first_outputs or outputs
        same = sum(a == b for a, b in zip(outputs, first_outputs)) / workload.num_requests
        results.append(
            MethodResult(
                method=name,
                label=labels[name],
                chapter=method.chapter,
                seconds=timings.spread(name).median,
                round_seconds=timings.seconds[name],
                num_requests=workload.num_requests,
                prompt_tokens=workload.num_prompt_tokens,
                output_tokens=sum(len(o) for o in outputs),
                same_tokens_as_first=same,
                matching_tokens=matching_token_share(outputs, first_outputs),
                dtype=str(contexts[name].dtype).removeprefix("torch."),
                model_flops=computed_flops,
                workload_flops=workload_flops,
                matmul_peak_flops=peaks.get(contexts[name].dtype),
                median_ttft_s=statistics.median(output.ttft_s) if output.ttft_s else None,
                prompt_tokens_computed=None
                if cached is None
                else workload.num_prompt_tokens - sum(cached),
            )
        )
    return results


ENGINE_SETTING_NAMES = {"tp": "tensor_parallel_size", "dp": "data_parallel_size"}


def engine_overrides(setting: str) -> dict:
    """ "dp=2,flex" -> {"data_parallel_size": 2, "attention_backend": "flex"}: the LLM
    arguments an engine method's setting asks for ("eager" and "compiled" choose
    enforce_eager, chapter 11; "int8", "int4" and "gguf" the quantization, chapter 12)."""
    overrides = {}
    for item in filter(None, setting.split(",")):
        key, equals, value = item.partition("=")
        if item in ("eager", "compiled"):
            overrides["enforce_eager"] = item == "eager"
        elif item in QUANTIZATION_METHODS:
            overrides["quantization"] = item
        elif not equals:
            overrides["attention_backend"] = item
        elif key in ENGINE_SETTING_NAMES:
            overrides[ENGINE_SETTING_NAMES[key]] = int(value)
        else:
            raise ValueError(
                f"unknown engine setting {item!r}; use an attention backend name, eager, "
                "compiled, int8, int4, gguf, tp=N or dp=M"
            )
    return overrides


def _parse_method(spec: str, device: torch.device | str) -> tuple[Method, str, torch.dtype | None]:
    """ "hf-static:64@bfloat16" -> (the hf-static method, "64", torch.bfloat16)."""
    name_and_setting, _, dtype_name = spec.partition("@")
    name, _, setting = name_and_setting.partition(":")
    if name not in METHODS:
        raise ValueError(f"unknown benchmark method {spec!r}; choose from {list(METHODS)}")
    try:
        dtype = resolve_dtype(dtype_name, torch.device(device)) if dtype_name else None
        if name.startswith("engine"):
            engine_overrides(setting)  # raises on a setting no engine knows
    except ValueError as error:
        raise ValueError(f"benchmark method {spec!r}: {error}") from None
    return METHODS[name], setting, dtype


def _short_dtype(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype)
    )


def matching_token_share(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Share of the reference's tokens that `outputs` reproduces before its first difference
    in each request. Greedy decoding in a lower precision agrees for a while, then one near
    tie flips and the rest of that request follows another path."""
    matched = total = 0
    for got, expected in zip(outputs, reference):
        for a, b in zip(got, expected):
            if a != b:
                break
            matched += 1
        total += len(expected)
    return matched / total if total else 1.0


def model_flops(
    config: ModelConfig,
    prompt_lengths: list[int],
    output_lengths: list[int],
    cached_lengths: list[int] | None = None,
) -> float:
    """Floating-point operations a workload needs, counted the usual way (a multiply-add is 2).

    Per token fed through the model (every prompt token, and every generated token but the
    last): 2 per weight of each linear layer. Per sampled token: 2 per weight of the LM head
    (logits are only computed where a token is sampled). Attention: a query at position t
    meets t + 1 keys, and QK^T and PV cost 2 each per head dimension. The same count serves
    every method: padding or recomputation is work a method chose, not work the task needs.

    `cached_lengths` (per request, the leading prompt tokens a prefix cache served) leaves
    out the work those tokens would have needed: their linear layers and their own queries.
    Later tokens still attend over them, so those pairs count.
    """
    linear_weights, head_weights = weight_count(config)
    q_size = config.num_heads * config.head_dim
    attention_per_pair = 4 * q_size * config.num_layers
    cached_lengths = cached_lengths or [0] * len(prompt_lengths)
    flops = 0
    for prompt_length, output_length, cached in zip(prompt_lengths, output_lengths, cached_lengths):
        tokens = prompt_length + output_length - 1
        flops += 2 * linear_weights * (tokens - cached)
        flops += 2 * head_weights * output_length
        # Queries at positions cached..tokens-1 meet t + 1 keys each.
        flops += attention_per_pair * (tokens * (tokens + 1) - cached * (cached + 1)) // 2
    return float(flops)


def measure_matmul_peak(dtype: torch.dtype, device: torch.device | str, size: int = 2048) -> float:
    """The machine's matrix-multiply speed in FLOP/s on a large square product.

    Every way the code can multiply is timed, PyTorch's `torch.mm` and the model's `linear`
    (oneDNN for CPU float32 and bfloat16, on a plain and on a packed weight: see
    models/linear.py), interleaved in rounds after a warm-up (`bench/measure.py`), and the
    fastest way's median counts: the peak is what the machine reaches, not what one library
    reaches on it. Measured once per process for each dtype, device and size (benchmarks ask
    for it again and again), so that every MFU of a run divides by the same peak.
    """
    key = (dtype, str(device), size)
    if key not in _MATMUL_PEAKS:
        _MATMUL_PEAKS[key] = _measure_matmul_peak(dtype, device, size)
    return _MATMUL_PEAKS[key]


_MATMUL_PEAKS: dict[tuple[torch.dtype, str, int], float] = {}


def _measure_matmul_peak(dtype: torch.dtype, device: torch.device | str, size: int) -> float:
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    products = {"torch.mm": lambda: torch.mm(a, b), "linear": lambda: linear(a, b)}
    packed = pack_weight(b)
    if packed is not None:  # only where the product runs on oneDNN
        products["linear, packed"] = lambda: linear(a, b, packed_weight=packed)
    timings = interleaved(products, repeats=5, synchronize=lambda: synchronize(device))
    return 2 * size**3 / min(timings.spread(name).median for name in products)


def format_table(results: list[MethodResult], baseline: str | None = None) -> str:
    """A plain-text table: time, output tokens/s, speedup over the baseline method, agreement
    with the first method (whole requests, and tokens before the first difference), model-FLOPs
    utilisation, and for our engine the median time to first token and the prompt tokens it
    computed. With repeated rounds, time is the median and its range, and the speedup is the
    median and range of the ratios taken round by round."""
    base = next((r for r in results if r.method == baseline), results[0])
    lines = [
        f"{'method':<53} {'seconds':>19} {'out tok/s':>10} {'speedup':>19} {'same reqs':>9}"
        f" {'same toks':>9} {'MFU':>5} {'TTFT p50':>9} {'prefill tok':>11}"
    ]
    for r in results:
        mfu = "" if r.mfu is None else f"{r.mfu:.0%}"
        ttft = "" if r.median_ttft_s is None else f"{r.median_ttft_s:.2f}s"
        prefill = "" if r.prompt_tokens_computed is None else str(r.prompt_tokens_computed)
        lines.append(
            f"{r.label:<53} {seconds_of(r).format():>19} {r.output_tokens_per_s:>10.1f}"
            f" {speedup_of(r, base).format(unit='x'):>19} {r.same_tokens_as_first:>9.0%}"
            f" {r.matching_tokens:>9.1%} {mfu:>5} {ttft:>9} {prefill:>11}"
        )
    rounds = len(base.round_seconds)
    lines.append(
        f"(speedup relative to: {base.label}; prompt tokens in all: {base.prompt_tokens}"
        + (f"; {rounds} rounds, methods interleaved: median (range))" if rounds > 1 else ")")
    )
    peaks = {r.dtype: r.matmul_peak_flops for r in results if r.matmul_peak_flops}
    if peaks:
        measured = ", ".join(f"{dtype} {peak / 1e9:.0f} GFLOP/s" for dtype, peak in peaks.items())
        lines.append(
            f"(MFU: the FLOPs each method computed per second over the measured matmul peak:"
            f" {measured}; the workload needs {base.workload_flops / 1e12:.2f} TFLOP, less"
            f" what a prefix cache serves)"
        )
    return "\n".join(lines)


def seconds_of(result: MethodResult) -> Spread:
    """A result's seconds, round by round where they were kept."""
    return Spread(tuple(result.round_seconds or [result.seconds]))


def speedup_of(result: MethodResult, base: MethodResult) -> Spread:
    """How many times faster than `base` (in output tokens per second), round by round where
    both kept their rounds (`bench/measure.py`), else from the two medians."""
    if len(result.round_seconds) == len(base.round_seconds) > 0:
        return ratio_within_rounds(
            [result.output_tokens / s for s in result.round_seconds],
            [base.output_tokens / s for s in base.round_seconds],
        )
    return Spread((result.output_tokens_per_s / base.output_tokens_per_s,))


def write_json(path: str | Path, workload: Workload, results: list[MethodResult], **extra) -> None:
    """Results with their workload and device, for plots and later comparison."""
    record = {
        "workload": {"name": workload.name, "description": workload.description},
        "device": device_label(),
        "results": [asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in results],
        **extra,
    }
    Path(path).write_text(json.dumps(record, indent=2))


# What runs when a notebook runs: the package, the one script a notebook starts, the
# dependencies. Prose, tests, the notebooks' own outputs and figures, the tools that only run
# from the command line (mutation testing, the notebook runner) and the GPU benchmark, whose
# records the notebooks read as committed data, can change without changing a number.
CODE_PATHS = (
    "minivllm",
    ":(exclude)minivllm/bench/gpu",
    "scripts/serve_vs_vllm.py",
    "pyproject.toml",
)


def code_version(root: Path | None = None) -> str:
    """The last commit that changed the code (short hash, "+changes" when the checked-out code
    differs from it), so a notebook's printed numbers say which code made them; the package
    version outside a git checkout. Only `CODE_PATHS` count: a later commit of a chapter, of
    the notebooks' outputs or of the GPU benchmark leaves the version alone, so a book run spread over several sittings,
    with its finished notebooks committed in between, still names one version."""
    import subprocess
    from importlib.metadata import version

    root = root or Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        command = ["git", "-C", str(root), *args]
        return subprocess.run(
            command, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        commit = git("log", "-1", "--format=%h", "--", *CODE_PATHS)
        changed = git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
    except (OSError, subprocess.SubprocessError):
        return f"minivllm {version('minivllm')}"
    return f"commit {commit}" + ("+changes" if changed else "")


def device_label() -> str:
    """A short name of the device, for figure titles and tables."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores)"


def machine_label() -> str:
    """The machine a notebook ran on, for its first output: the processor's model, its cores,
    the GPU if there is one, and PyTorch's version (numbers from two machines do not compare)."""
    import platform

    processor = platform.processor() or "unknown processor"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")]  # fmt: skip
        processor = models[0] if models else processor
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{processor}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}"
