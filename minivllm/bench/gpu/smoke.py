"""The CUDA smoke, run before the chapters: every CUDA-specific branch of the engine once.

The chapters measure; the smoke checks, in under two minutes on a GPU, that what they measure
runs at all on this machine, and runs right: Triton kernels that compile for this GPU and agree
with the torch reference, a flex backend that did not quietly fall back to it, a bfloat16
engine, CUDA graphs whose tokens are the eager engine's, and with 2+ GPUs an NCCL all-reduce
and parallel engines whose ranks each sit on a GPU of their own. Each branch is recorded as
"ok", "skipped: <why>" (it cannot run here: no CUDA device, one GPU) or "error: <message>".
A failing branch does not stop the others, so one run lists everything broken; the run then
counts the smoke as failed, and the chapters still run. On a CPU (--quick) the branches that
need CUDA are skipped and the others (the torch and flex backends, bfloat16) run.

The record is smoke.json (no figure): "branches" {name: status}, "details" {name: what the
branch checked, for those that ran}, "tracebacks" {name: the failing branch's traceback}.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from minivllm.attention import triton_paged
from minivllm.attention.backend import PagedAttentionBackend, PagedKVCache, get_attention_backend
from minivllm.attention.torch_paged import TorchPagedAttention
from minivllm.bench.attention import AttentionStep
from minivllm.bench.benchmark import matching_token_share
from minivllm.bench.gpu.common import (
    Chapter,
    Run,
    all_reduce_between_processes,
    chat_requests,
    chat_workload,
    decode_attention_step,
    engine_tensor_parallel_size,
    free_memory,
    generate_tokens,
    prefill_chunk,
)
from minivllm.bench.workloads import Workload
from minivllm.entrypoints.llm import LLM
from minivllm.sample.sampling_params import SamplingParams

# The largest difference allowed between a backend's float32 attention and the reference's:
# both compute in float32 (Triton's products in full IEEE precision), in another order.
ATTENTION_TOLERANCE = 1e-4
PARALLEL_SIZE = 2  # data parallelism and the all-reduce: every machine with 2+ GPUs has 2


class Skipped(Exception):
    """A branch that cannot run on this machine; the message says why."""


@dataclass
class Smoke:
    """What the branches share: the run, two chat prompts, greedy parameters, and the eager
    engine's tokens (made once, by the first branch that compares with them)."""

    run: Run
    workload: Workload  # every engine's KV pool is sized for it
    prompts: list[dict]
    params: SamplingParams
    _eager_tokens: list[list[int]] | None = field(default=None, repr=False)

    @contextmanager
    def engine(self, **settings) -> Iterator[LLM]:
        """An engine on the run's model, eager and in the run's dtype unless `settings` say
        otherwise, shut down afterwards (parallel engines hold processes and GPUs)."""
        args = dict(enforce_eager=True, max_num_seqs=len(self.prompts)) | settings
        llm = self.run.engine(self.workload, **args)
        try:
            yield llm
        finally:
            llm.llm_engine.shutdown()

    def generate(self, llm: LLM) -> list[list[int]]:
        """Each prompt's tokens, checked to be as many as asked for (EOS is ignored)."""
        tokens = generate_tokens(llm, self.prompts, self.params)
        if any(len(t) != self.params.max_tokens for t in tokens):
            raise AssertionError(
                f"asked for {self.params.max_tokens} tokens, got {[len(t) for t in tokens]}"
            )
        return tokens

    def eager_tokens(self) -> list[list[int]]:
        """The tokens of the eager engine on the device's default backend, float32 greedy: what
        CUDA graphs and the parallel engines are compared with."""
        if self._eager_tokens is None:
            with self.engine() as llm:
                self._eager_tokens = self.generate(llm)
        return self._eager_tokens


def measure_smoke(run: Run) -> Chapter:
    """Every branch of BRANCHES in turn, each in isolation.

    JSON: results (empty); branches {name: "ok" | "skipped: why" | "error: Type: message"};
    details {name: the branch's own numbers, for those that ran (max_abs_diff of attention
    outputs against the torch reference, num_splits of the Triton decode, captured batch
    sizes, GPU memory each rank took and matching_token_share against the eager engine)};
    tracebacks {name: traceback, for the failed ones}; num_gpus.
    """
    prompts = chat_requests(
        run, ["Write a haiku about a lighthouse.", "What is the capital of France?"]
    )
    output = run.sizes.smoke_output
    description = (
        f"{len(prompts)} chat requests, {output} new tokens each, greedy; one decode step and "
        "one prefill chunk of random attention inputs"
    )
    workload = chat_workload("smoke", prompts, output, description)
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    smoke = Smoke(run, workload, prompts, params)

    branches, details, tracebacks = {}, {}, {}
    for name, check in BRANCHES.items():
        try:
            details[name] = check(smoke)
            branches[name] = "ok"
        except Skipped as why:
            branches[name] = f"skipped: {why}"
        except Exception as error:  # noqa: BLE001 -- recorded; the other branches still run
            branches[name] = f"error: {type(error).__name__}: {error}"
            tracebacks[name] = traceback.format_exc()
        finally:
            free_memory()  # the branch's engines, before the next one measures GPU memory
        print(f"smoke: {name}: {branches[name]}")
    num_gpus = torch.cuda.device_count()
    measured = dict(branches=branches, details=details, tracebacks=tracebacks, num_gpus=num_gpus)
    failed = [
        f"{name}: {status}" for name, status in branches.items() if status.startswith("error")
    ]
    return Chapter("smoke", workload, measured=measured, failures=failed)


# --- the branches ------------------------------------------------------------------------------


def require_cuda(run: Run, num_gpus: int = 1) -> None:
    if run.device.type != "cuda":
        raise Skipped("no CUDA device")
    if torch.cuda.device_count() < num_gpus:
        raise Skipped(f"needs {num_gpus} GPUs, this machine has {torch.cuda.device_count()}")


def torch_engine(smoke: Smoke) -> dict:
    """The engine on the torch reference backend generates every token asked for."""
    with smoke.engine(attention_backend="torch") as llm:
        tokens = smoke.generate(llm)
    return dict(output_tokens=sum(len(t) for t in tokens))


def triton_attention(smoke: Smoke) -> dict:
    """The engine's Triton backend against the torch reference on one decode step long enough
    to be split (the decode kernel, then the combine of its splits) and on one prefill chunk
    after as many cached tokens (the prefill kernel); the store kernel writes each step's K/V
    where the reference writes them."""
    run = smoke.run
    require_cuda(run)
    triton = get_attention_backend("triton").for_device(run.device)
    # Two splits' worth of context at least, whatever the sizes: a shorter one is not split.
    context = max(max(run.sizes.kernel_contexts), 2 * triton_paged.MIN_TOKENS_PER_SPLIT)
    decode_diff, attention = against_torch(triton, *decode_step(run, context))
    if attention.num_splits < 2:
        raise AssertionError(
            f"the decode step ran in {attention.num_splits} split: there was nothing to combine"
        )
    prefill_diff, _ = against_torch(triton, *prefill_chunk(run))
    splits = attention.num_splits
    return dict(
        decode_max_abs_diff=decode_diff, num_splits=splits, prefill_max_abs_diff=prefill_diff
    )


def flex_attention(smoke: Smoke) -> dict:
    """The flex backend, which falls back to the torch reference where flex_attention does not
    compile: it must not have, and it must agree with the reference on a decode step and a
    prefill chunk."""
    run = smoke.run
    flex = get_attention_backend("flex").for_device(run.device)
    if flex.name != "flex":
        raise AssertionError(f"the flex backend fell back to {flex.name!r} (its warning says why)")
    decode_diff, _ = against_torch(flex, *decode_step(run))
    prefill_diff, _ = against_torch(flex, *prefill_chunk(run))
    return dict(decode_max_abs_diff=decode_diff, prefill_max_abs_diff=prefill_diff)


def bfloat16_engine(smoke: Smoke) -> dict:
    """An engine in bfloat16 (on CUDA the Triton kernels in bfloat16) generates its tokens."""
    with smoke.engine(dtype=torch.bfloat16) as llm:
        worker_dtype = llm.llm_engine.executor.driver_worker.dtype
        if worker_dtype != torch.bfloat16:
            raise AssertionError(f"asked for bfloat16, the engine runs {worker_dtype}")
        tokens = smoke.generate(llm)
    return dict(output_tokens=sum(len(t) for t in tokens))


def cuda_graphs_engine(smoke: Smoke) -> dict:
    """The compiled engine, which on CUDA replays its decode steps from CUDA graphs, gives the
    eager engine's greedy tokens."""
    require_cuda(smoke.run)
    eager = smoke.eager_tokens()
    with smoke.engine(enforce_eager=False) as llm:
        graphs = llm.llm_engine.executor.driver_worker.model_runner.cuda_graphs
        if graphs is None or not graphs.graphs:
            raise AssertionError("enforce_eager=False on CUDA captured no CUDA graph")
        if smoke.generate(llm) != eager:
            raise AssertionError("the engine replaying CUDA graphs gave other tokens than eager")
    return dict(captured_batch_sizes=sorted(graphs.graphs))


def nccl_all_reduce(smoke: Smoke) -> dict:
    """An NCCL all-reduce between 2 processes, each on a GPU of its own."""
    require_cuda(smoke.run, PARALLEL_SIZE)
    rows = all_reduce_between_processes("nccl", [2**8, 2**20], repeats=3)
    return dict(all_reduce=rows)


def tensor_parallel_engine(smoke: Smoke) -> dict:
    """An engine split over the smallest TP size that the model's heads and the GPUs allow,
    each rank on a GPU of its own (see `parallel_engine`)."""
    run = smoke.run
    require_cuda(run, PARALLEL_SIZE)
    tp, why = engine_tensor_parallel_size(run, torch.cuda.device_count())
    if tp is None:
        raise Skipped(why)
    return parallel_engine(smoke, tensor_parallel_size=tp)


def data_parallel_engine(smoke: Smoke) -> dict:
    """Two replicas of the engine, each in a process and on a GPU of its own (see
    `parallel_engine`)."""
    require_cuda(smoke.run, PARALLEL_SIZE)
    return parallel_engine(smoke, data_parallel_size=PARALLEL_SIZE)


# Name -> the branch, in the order they run: the single-device ones first.
BRANCHES: dict[str, Callable[[Smoke], dict]] = {
    "torch_engine": torch_engine,
    "triton_attention": triton_attention,
    "flex_attention": flex_attention,
    "bfloat16_engine": bfloat16_engine,
    "cuda_graphs_engine": cuda_graphs_engine,
    "nccl_all_reduce": nccl_all_reduce,
    "tensor_parallel_engine": tensor_parallel_engine,
    "data_parallel_engine": data_parallel_engine,
}


# --- what the branches use ---------------------------------------------------------------------


def decode_step(run: Run, context: int | None = None) -> tuple[PagedKVCache, AttentionStep]:
    """Chapter 06's decode step with the longest context of its grid (or `context` tokens), at
    its smallest batch (the most splits), in a pool of the grid's size: chapter 06 then finds
    flex's kernels for it compiled."""
    batches, context = run.sizes.kernel_batches, context or max(run.sizes.kernel_contexts)
    return decode_attention_step(run, min(batches), context, pool_seqs=max(batches))


def against_torch(
    backend: type[PagedAttentionBackend], pool: PagedKVCache, step: AttentionStep
) -> tuple[float, PagedAttentionBackend]:
    """`backend` and the torch reference on the same step, each on its own copy of the pool:
    the largest difference of their outputs, and the backend as built for the step. Raises
    if that difference passes ATTENTION_TOLERANCE or if the two stored other K/V."""
    reference_pool, backend_pool = copy_pool(pool), copy_pool(pool)
    expected = TorchPagedAttention(reference_pool, step.metadata)(0, step.q, step.k, step.v)
    attention = backend(backend_pool, step.metadata)
    out = attention(0, step.q, step.k, step.v)
    if not torch.equal(backend_pool.layers[0], reference_pool.layers[0]):
        raise AssertionError(f"{backend.name} stored other K/V than the torch reference")
    diff = (out.float() - expected.float()).abs().max().item()
    if not diff <= ATTENTION_TOLERANCE:  # also catches NaN
        raise AssertionError(
            f"{backend.name}'s attention differs from the torch reference's by {diff:.2e} "
            f"(more than {ATTENTION_TOLERANCE:g})"
        )
    return diff, attention


def copy_pool(pool: PagedKVCache) -> PagedKVCache:
    copied = copy.copy(pool)
    copied.layers = [layer.clone() for layer in pool.layers]
    return copied


def parallel_engine(smoke: Smoke, **parallel: int) -> dict:
    """Start an engine with one `parallel` setting (data_parallel_size=2, say: as many GPUs)
    and generate. Its ranks must each sit on a GPU of their own: each holds at least its share
    of the weights, so a GPU of cuda:0..size-1 that lost less than half of that meanwhile holds
    none, and its rank sits on another one. Its
    first tokens must be the eager engine's (a rank computing on the wrong GPU gives garbage);
    later ones may drift, as the sums are split and batched otherwise (the share that matches
    is recorded). Returns the setting, gpu_bytes_taken per GPU and matching_token_share."""
    (size,) = parallel.values()  # the one setting's value: the GPUs the engine spans
    eager = smoke.eager_tokens()  # made first: its engine's memory is not the parallel one's
    free_memory()  # memory this process freed counts as free again
    free_before = [torch.cuda.mem_get_info(i)[0] for i in range(size)]
    with smoke.engine(**parallel) as llm:
        tokens = smoke.generate(llm)
        taken = [before - torch.cuda.mem_get_info(i)[0] for i, before in enumerate(free_before)]
    weights = sum(p.numel() * p.element_size() for p in smoke.run.model.parameters())
    empty = [f"cuda:{i}" for i, bytes_taken in enumerate(taken) if bytes_taken < weights / size / 2]
    if empty:
        raise AssertionError(
            f"{', '.join(empty)} took almost no memory for the engine with {parallel} (GPU "
            f"bytes taken: {taken}): its ranks are not each on a GPU of their own"
        )
    if [t[0] for t in tokens] != [t[0] for t in eager]:
        raise AssertionError(f"the engine with {parallel} starts with other tokens than eager's")
    share = matching_token_share(tokens, eager)
    return parallel | dict(gpu_bytes_taken=taken, matching_token_share=share)
