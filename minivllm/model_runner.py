"""Chapter 04 — the model runner: turn the scheduler's decision into one forward pass.

The scheduler says "request A: 1 token, request B: tokens 512..1023 of its prompt, ...". The
runner lays those tokens side by side in one flat batch, computes where each token's K/V go
in the paged cache (the slot mapping) and which blocks each sequence reads (the block
tables), runs the model once, and samples a token for every request whose step reached the
end of its known tokens.
"""

from __future__ import annotations

import torch

from minivllm.attention import AttentionMetadata, PagedKVCache, TorchPagedAttention
from minivllm.block_manager import KVCacheManager
from minivllm.models.llama import LlamaForCausalLM
from minivllm.sampling import Sampler, TokenLogprobs
from minivllm.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: PagedKVCache,
        kv_cache_manager: KVCacheManager,
        sampler: Sampler,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.kv_cache_manager = kv_cache_manager
        self.sampler = sampler
        self.device = model.model.embed_tokens.weight.device

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, tuple[int, TokenLogprobs | None]]:
        """Run one step; returns request id -> (sampled token, its logprobs)."""
        input_ids, positions, slot_mapping = [], [], []
        query_lens, seq_lens, block_tables = [], [], []
        sample_rows, sampling_requests = [], []
        for scheduled in output.scheduled:
            request = scheduled.request
            start = request.num_computed_tokens
            end = start + scheduled.num_new_tokens
            table = self.kv_cache_manager.block_tables[request.request_id]
            input_ids += request.token_ids_between(start, end)
            positions += range(start, end)
            slot_mapping += self.kv_cache_manager.slot_mapping(request.request_id, start, end)
            query_lens.append(end - start)
            seq_lens.append(end)
            block_tables.append(table)
            if scheduled.samples:
                sample_rows.append(len(input_ids) - 1)  # the logits of the last token
                sampling_requests.append(request)

        metadata = AttentionMetadata.build(
            query_lens, seq_lens, block_tables, slot_mapping, device=self.device
        )
        hidden = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            TorchPagedAttention(self.kv_cache, metadata),
        )
        if not sampling_requests:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])
        sampled = self.sampler(logits, [r.sampling_row() for r in sampling_requests])
        return {
            request.request_id: (token_id, token_logprobs)
            for request, token_id, token_logprobs in zip(
                sampling_requests, sampled.token_ids, sampled.logprobs
            )
        }
