"""Chapter 04 — the model runner: turn the scheduler's decision into one forward pass.

The scheduler says "request A: 1 token, request B: tokens 512..1023 of its prompt, ...", as
plain data (`core/scheduler_output.py`). The runner first brings its own copy of each request
up to date (new requests, new tokens and blocks, preemptions, finished ones), then lays the
scheduled tokens side by side in one flat batch (`worker/input_batch.py`), runs the model once
with the attention backend reading and writing the paged pool, and samples a token for every
request whose step reached the end of its known tokens. It returns plain data too: request
id -> sampled token ids and logprobs.
"""

from __future__ import annotations

import torch

from minivllm.attention.backend import AttentionMetadata, PagedAttentionBackend, PagedKVCache
from minivllm.core.scheduler_output import SchedulerOutput
from minivllm.models.llama import LlamaForCausalLM
from minivllm.outputs import ModelRunnerOutput
from minivllm.sample.sampler import Sampler
from minivllm.sequence import own_generator
from minivllm.worker.input_batch import CachedRequestState, prepare_inputs


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: PagedKVCache,
        attention_backend: type[PagedAttentionBackend],
        sampler: Sampler,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.attention_backend = attention_backend
        self.sampler = sampler
        self.device = model.model.embed_tokens.weight.device
        self.requests: dict[str, CachedRequestState] = {}  # every request the runner holds

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns request id -> [sampled token] and its logprobs."""
        self.update_states(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput()
        batch = prepare_inputs(
            self.requests, scheduler_output.num_scheduled_tokens, self.kv_cache.block_size
        )
        metadata = AttentionMetadata.build(
            batch.query_lens,
            batch.seq_lens,
            batch.block_tables,
            batch.slot_mapping,
            device=self.device,
        )
        hidden = self.model(
            torch.tensor(batch.input_ids, device=self.device),
            torch.tensor(batch.positions, device=self.device),
            self.attention_backend(self.kv_cache, metadata),
        )
        if not batch.sample_req_ids:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        if logits is None:  # a tensor-parallel follower (chapter 07): rank 0 samples
            return ModelRunnerOutput()
        rows = [self.requests[req_id].sampling_row() for req_id in batch.sample_req_ids]
        sampled = self.sampler(logits, rows)
        return ModelRunnerOutput(
            sampled_token_ids={
                req_id: [token_id]
                for req_id, token_id in zip(batch.sample_req_ids, sampled.token_ids)
            },
            logprobs={
                req_id: None if token_logprobs is None else [token_logprobs]
                for req_id, token_logprobs in zip(batch.sample_req_ids, sampled.logprobs)
            },
        )

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Bring the runner's copy of each request up to date with the scheduler's."""
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=[],
                params=new.sampling_params,
                eos_token_ids=new.eos_token_ids,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=own_generator(new.sampling_params),
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.output_token_ids += cached.new_token_ids
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids += cached.new_block_ids
            state.num_computed_tokens = cached.num_computed_tokens
