"""Chapter 04 — the worker: one device's share of the engine (the model, its KV pool, its runner).

The engine never touches the model or the pool directly; it asks its executor, which asks every
worker (one here; one per device with tensor parallelism):

    num_blocks = min(worker.determine_num_kv_blocks() for every worker)
    worker.initialize_kv_cache(num_blocks)               # on every worker
    output = worker.execute_model(scheduler_output)      # every step, on every worker

Sizing the pool is the worker's job because only it knows its device's memory: on the CPU the
budget is `kv_cache_memory_bytes` (or a default); on CUDA, what `gpu_memory_utilization` leaves
after a forward pass of the largest batch.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from minivllm.attention.backend import (
    AttentionMetadata,
    PagedAttentionBackend,
    PagedKVCache,
    get_attention_backend,
    resolve_attention_backend_name,
    slot_mapping,
)
from minivllm.compilation.compiled_model import CompiledModel, compilable
from minivllm.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    EngineConfig,
    ModelConfig,
    resolve_device,
    resolve_dtype,
)
from minivllm.core.scheduler_output import SchedulerOutput
from minivllm.distributed.parallel_state import SINGLE_PROCESS, TensorParallelGroup
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.loader import load_model, resolve_model_path
from minivllm.outputs import ModelRunnerOutput
from minivllm.sample.sampler import Sampler, SamplingRow, make_generator
from minivllm.sample.sampling_params import SamplingParams
from minivllm.spec_decode.draft_model_proposer import DraftModelProposer
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.utils import cdiv
from minivllm.worker.cpu_allocator import keep_freed_memory_in_process, release_freed_memory
from minivllm.worker.model_runner import ModelRunner


def kv_cache_budget(
    total: int, free: int, torch_reserved: int, torch_peak: int, utilization: float
) -> int:
    """Bytes the KV cache may take on a GPU of `total` bytes, `free` of them free now.

    The engine may use `utilization` of the whole GPU. Out of that come the peak of PyTorch's
    allocator during the profiling run (weights, activations, logits, the sampler) and every
    byte in use that PyTorch did not allocate: the CUDA context, cuBLAS and NCCL workspaces,
    other processes on the same GPU. The last is what the device reports in use beyond what
    PyTorch's allocator holds."""
    outside_torch = max(0, (total - free) - torch_reserved)
    return int(total * utilization) - torch_peak - outside_torch


def engine_max_model_len(config: EngineConfig, model_max_model_len: int, num_blocks: int) -> int:
    """The longest sequence the engine serves with a pool of `num_blocks` blocks. A sequence
    must fit in the context *and* in the pool on its own; otherwise it could preempt everybody
    and still not run."""
    max_model_len = min(model_max_model_len, num_blocks * config.block_size)
    if config.max_model_len is not None:
        max_model_len = min(max_model_len, config.max_model_len)
    if not config.enable_chunked_prefill:
        # Without chunking a prompt (or a preempted sequence) is computed in one step, so it
        # must fit in one step's token budget.
        max_model_len = min(max_model_len, config.max_num_batched_tokens)
    return max_model_len


def bind_to_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device. Tensors go where `device` says, but a
    Triton kernel launches on the *current* device and an NCCL communicator binds to it: a
    rank on cuda:1 left on the default cuda:0 would launch its kernels on the wrong GPU, with
    pointers into another one's memory. Nothing to do on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


class Worker:
    """One device's share: the whole model, or with tensor parallelism (chapter 07) one rank's
    shard of every layer, `tp` naming the group and this worker's rank in it."""

    def __init__(
        self, config: EngineConfig, model_path: Path, tp: TensorParallelGroup = SINGLE_PROCESS
    ):
        self.config = config
        self.tp = tp
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, config.quantization)
        bind_to_device(self.device)
        if self.device.type == "cpu":
            keep_freed_memory_in_process()  # steps reuse activation memory without page faults
        backend_name = resolve_attention_backend_name(config.attention_backend, self.device)
        # Decided before the model takes memory: a backend may refuse the device or fall back.
        self.attention_backend = get_attention_backend(backend_name).for_device(self.device)
        self.model = load_model(model_path, self.dtype, self.device, tp, config.quantization)
        # This rank's KV pool holds its own KV heads only.
        self.rank_model_config = self.model.config.per_rank(tp.size)
        # Chapter 08: a draft model and the shapes of its own KV pool, or None.
        self.draft_model, self.draft_config = self._load_draft_model()
        self.model_runner: ModelRunner | None = None  # built once the pool's size is known

    def _load_draft_model(self) -> tuple[LlamaForCausalLM | None, ModelConfig | None]:
        """Chapter 08: the draft of `draft_model` (its own weights) or of `layer_skip` (the
        target itself, of which the draft runs the first layers); None for n-gram drafts."""
        speculative = self.config.speculative
        if speculative is None or not speculative.uses_draft_model:
            return None, None
        target = self.model.config
        if speculative.method == "layer_skip":
            if speculative.num_draft_layers >= target.num_layers:
                raise ValueError(
                    f"speculative_config.num_draft_layers must be below the target's "
                    f"{target.num_layers} layers, got {speculative.num_draft_layers}"
                )
            return self.model, replace(target, num_layers=speculative.num_draft_layers)
        draft = load_model(resolve_model_path(speculative.model), self.dtype, self.device)
        if draft.config.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model {speculative.model} has a vocabulary of "
                f"{draft.config.vocab_size} tokens, the target {target.vocab_size}: a draft "
                "must share the target's tokenizer"
            )
        return draft, draft.config

    def determine_num_kv_blocks(self) -> int:
        """Blocks that fit the KV budget: kv_cache_memory_bytes, or on CUDA what is left of
        gpu_memory_utilization after a profiling forward at the largest batch."""
        config = self.config
        budget = config.kv_cache_memory_bytes
        if budget is None and self.device.type == "cuda":
            budget = self._profile_free_gpu_memory()
        if budget is None:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = PagedKVCache.num_blocks_for_budget(
            self.kv_pool_configs, config.block_size, self.dtype, budget
        )
        if num_blocks < 1:
            bytes_per_block = self.kv_cache_bytes_per_block()
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no KV block; one block of "
                f"{config.block_size} tokens needs {bytes_per_block} bytes"
            )
        return num_blocks

    @property
    def kv_pool_configs(self) -> list[ModelConfig]:
        """The shapes of this rank's KV pools: the model's, and a draft model's (chapter 08)."""
        return [self.rank_model_config] + ([self.draft_config] if self.draft_config else [])

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes in this rank's pools."""
        return self.config.block_size * sum(
            pool.kv_bytes_per_token(self.dtype) for pool in self.kv_pool_configs
        )

    @property
    def uses_cuda_graphs(self) -> bool:
        """Chapter 11: decode steps replayed from CUDA graphs, on one GPU with the Triton
        backend (whose decode kernel reads the step from the device) unless enforce_eager.
        Ranks of a tensor-parallel group run without them."""
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and self.attention_backend.name == "triton"
            and self.tp.size == 1
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the pool and the runner that reads and writes it (with CUDA graphs, one
        block more than the scheduler's pool: the padding rows' block)."""
        padding_blocks = 1 if self.uses_cuda_graphs else 0
        kv_cache = PagedKVCache(
            self.rank_model_config,
            num_blocks + padding_blocks,
            self.config.block_size,
            self.dtype,
            self.device,
        )
        sampler = Sampler(
            default_generator=make_generator(self.config.seed, self.device),
            logprobs_mode=self.config.logprobs_mode,
        )
        proposer = self._make_proposer(num_blocks, sampler)
        max_num_tokens = min(self.config.max_num_batched_tokens, self.model.config.max_model_len)
        self.attention_backend.warm_up(
            kv_cache, self.rank_model_config.num_heads, self.config.max_num_seqs, max_num_tokens
        )
        self.model_runner = ModelRunner(
            self.model, kv_cache, self.attention_backend, sampler, proposer, self._compile()
        )
        if self.uses_cuda_graphs:  # block tables as wide as the engine's longest sequence
            max_model_len = engine_max_model_len(
                self.config, self.model.config.max_model_len, num_blocks
            )
            self.model_runner.capture_cuda_graphs(self.config.max_num_seqs, max_model_len)
        if self.device.type == "cpu":
            # Start-up freed what steps never need again (the plain weights once packed, the
            # profiling batch's activations): hand that back, once; steps then keep theirs.
            release_freed_memory()

    def _compile(self) -> CompiledModel | None:
        """Chapter 11: the model compiled for every step's shape, before the first request
        (None with enforce_eager, or where the model does not compile)."""
        if self.config.enforce_eager or not compilable(self.model):
            return None
        compiled = CompiledModel(self.model)
        compiled.compile(
            lambda num_tokens: self.scratch_attention(self.rank_model_config, num_tokens)
        )
        return compiled

    def scratch_attention(
        self, model_config: ModelConfig, num_tokens: int
    ) -> PagedAttentionBackend:
        """The attention backend for one sequence of `num_tokens` new tokens, on a pool just
        big enough for it: for forwards that only measure or compile."""
        table = list(range(cdiv(num_tokens, self.config.block_size)))
        pool = PagedKVCache(
            model_config, len(table), self.config.block_size, self.dtype, self.device
        )
        metadata = AttentionMetadata.build(
            [num_tokens],
            [num_tokens],
            [table],
            slot_mapping(table, self.config.block_size, 0, num_tokens),
            device=self.device,
        )
        return self.attention_backend(pool, metadata)

    def _make_proposer(
        self, num_blocks: int, sampler: Sampler
    ) -> NgramProposer | DraftModelProposer | None:
        """Chapter 08: what guesses the drafts, and (for a draft model) its own KV pool."""
        speculative = self.config.speculative
        if speculative is None:
            return None
        if not speculative.uses_draft_model:
            return NgramProposer(
                speculative.num_speculative_tokens,
                speculative.prompt_lookup_min,
                speculative.prompt_lookup_max,
            )
        draft_cache = PagedKVCache(
            self.draft_config, num_blocks, self.config.block_size, self.dtype, self.device
        )
        return DraftModelProposer(
            self.draft_model,
            draft_cache,
            self.attention_backend,
            sampler,
            speculative.num_speculative_tokens,
            speculative.num_draft_layers,
            max_num_tokens=self.config.max_num_batched_tokens,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    @torch.inference_mode()
    def _profile_free_gpu_memory(self) -> int:
        """Run the largest batch once, measure the peak memory, and give the KV cache whatever
        gpu_memory_utilization leaves (`kv_cache_budget`)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run_largest_batch()
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return kv_cache_budget(
            total=total,
            free=free,
            torch_reserved=torch.cuda.memory_reserved(self.device),
            torch_peak=torch.cuda.max_memory_allocated(self.device),
            utilization=self.config.gpu_memory_utilization,
        )

    @torch.inference_mode()
    def run_largest_batch(self) -> None:
        """A forward of max_num_batched_tokens tokens through the real attention backend (on a
        pool just big enough for it), with logits for max_num_seqs rows, and the sampler on them
        at its most expensive (temperature, top-k, top-p and a penalty: sorts and copies of the
        vocabulary per row). With speculation every sequence scores k + 1 rows, and the
        rejection sampler's distributions are made for all of them. Chapter 08: then the same
        forward through the draft model, whose catch-up forward may be as large."""
        config = self.config
        runs = [(self.model, self.rank_model_config, None)]
        if self.draft_model is not None:
            runs.append((self.draft_model, self.draft_config, config.speculative.num_draft_layers))
        speculative = config.speculative
        rows_per_seq = 1 + (speculative.num_speculative_tokens if speculative else 0)
        for is_target, (model, model_config, num_layers) in zip((True, False), runs):
            num_tokens = min(config.max_num_batched_tokens, model_config.max_model_len)
            dummy = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            positions = torch.arange(num_tokens, device=self.device)
            attention = self.scratch_attention(model_config, num_tokens)
            hidden = model(dummy, positions, attention, num_layers)
            if not is_target:  # the draft's guesses: one row per sequence
                model.compute_logits(hidden[-config.max_num_seqs :])
                continue
            num_rows = min(num_tokens, config.max_num_seqs * rows_per_seq)
            logits = model.compute_logits(hidden[-num_rows:])
            if logits is not None:  # None on a tensor-parallel follower: rank 0 samples
                self.profile_sampler(logits, speculative is not None)

    @staticmethod
    def profile_sampler(logits: torch.Tensor, speculative: bool) -> None:
        """The sampler's most expensive pass over `logits`, for the memory it takes."""
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1)
        rows = [SamplingRow(params, [0], [0], None) for _ in range(len(logits))]
        sampler = Sampler()
        sampler(logits, rows)
        if speculative:
            sampler.probabilities(logits, rows)
