"""Chapter 04 — the model runner: turn the scheduler's decision into one forward pass.

The scheduler says "request A: 1 token, request B: tokens 512..1023 of its prompt, ...", as
plain data (`core/scheduler_output.py`). The runner first brings its own copy of each request
up to date (new requests, new tokens and blocks, preemptions, finished ones), then lays the
scheduled tokens side by side in one flat batch (`worker/input_batch.py`), runs the model once
with the attention backend reading and writing the paged pool, and samples a token for every
request whose step reached the end of its known tokens. It returns plain data too: request
id -> sampled token ids and logprobs, and the prompt logprobs of the chunks it computed.
"""

from __future__ import annotations

import torch

from minivllm.attention.backend import AttentionMetadata, PagedAttentionBackend, PagedKVCache
from minivllm.compilation.compiled_model import CompiledModel
from minivllm.compilation.cuda_graphs import CUDAGraphRunner
from minivllm.core.scheduler_output import SchedulerOutput
from minivllm.models.llama import LlamaForCausalLM
from minivllm.outputs import ModelRunnerOutput, PromptLogprobsChunk
from minivllm.sample.sampler import Sampler, prompt_token_logprobs
from minivllm.sequence import own_generator
from minivllm.spec_decode.draft_model_proposer import DraftModelProposer
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.spec_decode.proposal import ProposalRequest
from minivllm.spec_decode.rejection_sampler import NothingToSample, rejection_sample
from minivllm.structured_output.manager import apply_token_bitmasks
from minivllm.worker.input_batch import (
    CachedRequestState,
    InputBatch,
    PromptLogprobRows,
    prepare_inputs,
)

# Prompt logprobs project at most this many positions onto the vocabulary at once, so a long
# prompt chunk holds [512, vocab] float32 logits (96 MiB for a 49k vocabulary), never more.
PROMPT_LOGITS_ROWS = 512


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: PagedKVCache,
        attention_backend: type[PagedAttentionBackend],
        sampler: Sampler,
        proposer: NgramProposer | DraftModelProposer | None = None,
        forward: CompiledModel | None = None,
    ):
        self.model = model
        # The forward a step runs: the model compiled (chapter 11) or the model itself; and on
        # a GPU the decode steps recorded as CUDA graphs (`capture_cuda_graphs`), or None.
        self.forward = model if forward is None else forward
        self.cuda_graphs: CUDAGraphRunner | None = None
        self.kv_cache = kv_cache
        self.attention_backend = attention_backend
        self.sampler = sampler
        self.proposer = proposer  # chapter 08: drafts for the next step, or None
        self.device = model.device
        self.requests: dict[str, CachedRequestState] = {}  # every request the runner holds

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns request id -> [sampled token] and its logprobs."""
        self.update_states(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput()
        batch = prepare_inputs(
            self.requests,
            scheduler_output.num_scheduled_tokens,
            self.kv_cache.block_size,
            scheduler_output.scheduled_spec_decode_tokens,
        )
        hidden = self.run_forward(batch)
        output = ModelRunnerOutput()
        for req_id, rows in batch.prompt_logprob_rows.items():
            chunk = self.score_prompt(self.requests[req_id], hidden, rows)
            if chunk is not None:  # None on a tensor-parallel follower
                output.prompt_logprobs[req_id] = chunk
        spec_rows = [row for rows in batch.spec_rows.values() for row in rows]
        if not batch.sample_req_ids and not spec_rows:
            return output
        logits = self.model.compute_logits(hidden[batch.sample_rows + spec_rows])
        if logits is None:  # a tensor-parallel follower (chapter 07): rank 0 samples
            return ModelRunnerOutput()
        if scheduler_output.grammar_bitmasks:  # chapter 10
            self.apply_grammars(logits, batch, scheduler_output.grammar_bitmasks)
        num_plain = len(batch.sample_rows)
        if num_plain:
            rows = [self.requests[req_id].sampling_row() for req_id in batch.sample_req_ids]
            sampled = self.sampler(logits[:num_plain], rows)
            for req_id, token_id, token_logprobs, error in zip(
                batch.sample_req_ids, sampled.token_ids, sampled.logprobs, sampled.errors
            ):
                if error is not None:  # this request alone ends
                    output.errors[req_id] = error
                    continue
                output.sampled_token_ids[req_id] = [token_id]
                output.logprobs[req_id] = None if token_logprobs is None else [token_logprobs]
        # Chapter 08: verify each request's drafts against its rows of logits.
        offset = num_plain
        for req_id, rows in batch.spec_rows.items():
            drafts = scheduler_output.scheduled_spec_decode_tokens[req_id]
            request_logits = logits[offset : offset + len(rows)]
            try:
                tokens, logprobs = self.verify(req_id, drafts, request_logits)
            except NothingToSample as error:  # this request alone ends
                output.errors[req_id] = str(error)
            else:
                output.sampled_token_ids[req_id], output.logprobs[req_id] = tokens, logprobs
            offset += len(rows)
        if self.proposer is not None:
            output.spec_token_ids = self.propose(output.sampled_token_ids)
        return output

    def run_forward(self, batch: InputBatch) -> torch.Tensor:
        """Hidden states of the step's tokens: replayed from a CUDA graph when one holds the
        step (chapter 11), otherwise a forward with this step's attention metadata."""
        size = None if self.cuda_graphs is None else self.cuda_graphs.bucket(batch.query_lens)
        if size is not None:
            return self.cuda_graphs.run(
                size,
                batch.input_ids,
                batch.positions,
                batch.slot_mapping,
                batch.seq_lens,
                batch.block_tables,
            )
        metadata = AttentionMetadata.build(
            batch.query_lens,
            batch.seq_lens,
            batch.block_tables,
            batch.slot_mapping,
            device=self.device,
        )
        return self.forward(
            torch.tensor(batch.input_ids, device=self.device),
            torch.tensor(batch.positions, device=self.device),
            self.attention_backend(self.kv_cache, metadata),
        )

    def score_prompt(
        self, state: CachedRequestState, hidden: torch.Tensor, prompt_rows: PromptLogprobRows
    ) -> PromptLogprobsChunk | None:
        """The prompt logprobs of one request's chunk: each prompt token's logprob and rank and
        the top tokens before it, under the model's own distribution, top-k taken here so that
        only those few numbers leave the runner. Every rank of a tensor-parallel group runs
        it (each logits gather needs them all); the followers get None."""
        state.num_prompt_tokens_scored = prompt_rows.first_token + len(prompt_rows.rows)
        first, tokens = prompt_rows.first_token, []
        for offset in range(0, len(prompt_rows.rows), PROMPT_LOGITS_ROWS):
            rows = prompt_rows.rows[offset : offset + PROMPT_LOGITS_ROWS]
            logits = self.model.compute_logits(hidden[rows.start : rows.stop])
            if logits is None:
                continue
            next_tokens = state.prompt_token_ids[first + offset : first + offset + len(rows)]
            tokens += prompt_token_logprobs(logits, next_tokens, state.params.prompt_logprobs)
        return PromptLogprobsChunk(first, tokens) if tokens else None

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Chapter 11: record a decode step of every batch-size bucket; the pool's last block
        must be one the scheduler never hands out (padding rows write there)."""
        self.cuda_graphs = CUDAGraphRunner(
            self.forward, self.kv_cache, self.attention_backend, max_num_seqs, max_model_len
        )
        self.cuda_graphs.capture()

    @staticmethod
    def apply_grammars(
        logits: torch.Tensor, batch: InputBatch, bitmasks: dict[str, torch.Tensor]
    ) -> None:
        """Chapter 10: forbid, in each constrained request's logits rows, the tokens its
        grammar does not allow there. Rows are laid out as `execute_model` samples them: one
        per plain request, then each speculative request's rows."""
        rows, masks = [], []
        for row, req_id in enumerate(batch.sample_req_ids):
            if req_id in bitmasks:
                rows.append(row)
                masks.append(bitmasks[req_id])
        offset = len(batch.sample_rows)
        for req_id, spec_rows in batch.spec_rows.items():
            if req_id in bitmasks:
                rows += range(offset, offset + len(spec_rows))
                masks.append(bitmasks[req_id])
            offset += len(spec_rows)
        apply_token_bitmasks(logits, rows, torch.cat(masks))

    def verify(
        self, req_id: str, drafts: list[int], logits: torch.Tensor
    ) -> tuple[list[int], list | None]:
        """Chapter 08: the tokens a request emits from its drafts, and their logprobs if it
        asked. Row i is scored as if drafts 0..i-1 had been sampled (penalties and min_tokens
        see them), then the rejection sampler keeps drafts while the target agrees and adds one
        token of its own. Emitted token i came from row i, as it would have without drafts."""
        state = self.requests[req_id]
        rows = []
        for i in range(len(drafts) + 1):
            row = state.sampling_row()
            row.output_token_ids = state.output_token_ids + drafts[:i]
            rows.append(row)
        target_probs = self.sampler.probabilities(logits, rows)
        draft_probs = None if state.draft_probs is None else state.draft_probs[: len(drafts)]
        generator = state.generator or self.sampler.default_generator
        tokens = rejection_sample(target_probs, drafts, draft_probs, generator)
        if state.params.logprobs is None:
            return tokens, None
        emitted = slice(0, len(tokens))
        return tokens, self.sampler.logprobs(logits[emitted], tokens, rows[emitted])

    def propose(self, sampled_token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        """Chapter 08: drafts for the next step of every request that just got tokens."""
        requests = []
        for req_id, new_tokens in sampled_token_ids.items():
            state = self.requests[req_id]
            row = state.sampling_row()
            row.output_token_ids = state.output_token_ids + new_tokens
            requests.append(
                ProposalRequest(
                    req_id=req_id,
                    token_ids=state.prompt_token_ids + row.output_token_ids,
                    block_ids=state.block_ids,
                    num_draft_cached=state.num_draft_cached,
                    row=row,
                )
            )
        drafts = {}
        for request, proposal in zip(requests, self.proposer.propose_batch(requests)):
            state = self.requests[request.req_id]
            if proposal.num_draft_cached is not None:
                state.num_draft_cached = proposal.num_draft_cached
            state.draft_probs = proposal.probs
            drafts[request.req_id] = proposal.token_ids
        return drafts

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
            state.block_ids = state.block_ids[: cached.num_kept_block_ids] + cached.new_block_ids
            state.num_computed_tokens = cached.num_computed_tokens
            # Chapter 08: a draft model's K/V are only as safe as the blocks they sit in. A
            # step keeps the blocks of the computed tokens (the last token's slot may have gone
            # back with the lookahead slots), and a preemption takes them all.
            state.num_draft_cached = min(state.num_draft_cached, state.num_computed_tokens)
            if cached.resumed_from_preemption:
                state.num_draft_cached = 0
