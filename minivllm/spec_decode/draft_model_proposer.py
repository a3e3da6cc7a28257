"""Chapter 08 — the draft-model proposer: a smaller model guesses the next k tokens, one cheap
forward per guess, and the target verifies them all in one forward of its own.

The draft is a model in its own right, so it needs K/V for every token it reads. It keeps them
in a paged pool of its own (its layers, its KV heads) with as many blocks as the target's, and
it borrows the target's block tables: a token's draft K/V sit at the same slot as its target
K/V, one pool over. No second allocator is needed; the scheduler only reserves k lookahead
slots past each grant, where the draft writes the K/V of its own guesses.

One proposal, for a request whose last verification left n tokens:

    forward 0: the tokens the draft has not read yet       -> guess 1   (the whole prompt the
               (positions num_draft_cached .. n-1)                       first time; after that
                                                                         the emitted tokens)
    forward j: guess j, at position n + j - 1              -> guess j + 1

Afterwards the draft holds K/V for the n known tokens. Its K/V of the guesses are never
trusted: next time it rereads whatever was accepted (a chunk of at most k + 1 tokens, as cheap
as one decode step on small batches).

Forward 0 is bounded by the step's token budget (`max_num_batched_tokens`), like the target's
own forward. It usually reads a few tokens per request, but a prompt the target found in the
prefix cache, prefilled in chunks, or recomputed after a preemption is new to the draft: the
draft then reads it in chunks, over several steps, and guesses nothing for that request until
it has caught up (the target decodes it alone meanwhile).

Each guess is drawn from the draft's distribution q, shaped by the request's own sampling
settings (temperature, top-p, penalties), and q is kept for the rejection rule; a greedy
request's draft simply takes the argmax.

Two drafts use this class. `draft_model`: a smaller model with the same vocabulary (SmolLM2-
135M drafting for SmolLM2-1.7B). `layer_skip`: the target's own first layers, final norm and LM
head (self-speculation: no extra weights, only a pool for the first layers' K/V).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from minivllm.attention.backend import (
    AttentionMetadata,
    PagedAttentionBackend,
    PagedKVCache,
    slot_mapping,
)
from minivllm.models.llama import LlamaForCausalLM
from minivllm.sample.sampler import Sampler
from minivllm.spec_decode.proposal import Proposal, ProposalRequest
from minivllm.spec_decode.rejection_sampler import NothingToSample, draw


class DraftModelProposer:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: PagedKVCache,
        attention_backend: type[PagedAttentionBackend],
        sampler: Sampler,
        num_speculative_tokens: int,
        num_layers: int | None = None,
        max_num_tokens: int | None = None,
    ):
        self.model = model
        self.num_layers = num_layers  # layer_skip: run only the first layers; None: all
        self.kv_cache = kv_cache
        self.attention_backend = attention_backend
        self.sampler = sampler
        self.k = num_speculative_tokens
        # The most tokens one catch-up forward reads (the step's budget); None: no bound.
        self.max_num_tokens = max_num_tokens
        self.device = model.device

    @torch.inference_mode()
    def propose_batch(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Up to k guesses for each request the draft has caught up with; each proposal says
        how many of the request's tokens the draft holds K/V for afterwards."""
        reads = self.catch_up_lengths(requests)
        num_read = [request.num_draft_cached + n for request, n in zip(requests, reads)]
        num_guesses = [
            self.num_guesses_that_fit(request) if read == len(request.token_ids) else 0
            for request, read in zip(requests, num_read)
        ]
        guesses: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        # Forward 0: each request reads its share of the tokens it has not read yet; those that
        # have caught up draw guess 1.
        reading = [i for i, n in enumerate(reads) if n]
        if reading:
            chunks = []
            for i in reading:
                start = requests[i].num_draft_cached
                chunks.append((requests[i].token_ids[start : num_read[i]], start))
            logits = self.forward([requests[i].block_ids for i in reading], chunks)
            guessing = [j for j, i in enumerate(reading) if num_guesses[i]]
            self.guess([reading[j] for j in guessing], logits[guessing], requests, guesses, probs)
        # Forward j: read guess j, at position n + j - 1, and draw guess j + 1.
        for step in range(1, max(num_guesses, default=0)):
            active = [
                i for i, count in enumerate(num_guesses) if count > step and len(guesses[i]) == step
            ]
            if not active:
                break
            chunks = [([guesses[i][-1]], len(requests[i].token_ids) + step - 1) for i in active]
            logits = self.forward([requests[i].block_ids for i in active], chunks)
            self.guess(active, logits, requests, guesses, probs)
        return [
            Proposal(tokens, None if request.row.params.is_greedy else torch.stack(q), read)
            if tokens
            else Proposal([], num_draft_cached=read)
            for request, tokens, q, read in zip(requests, guesses, probs, num_read)
        ]

    def guess(
        self,
        active: list[int],
        logits: torch.Tensor,
        requests: list[ProposalRequest],
        guesses: list[list[int]],
        probs: list[list[torch.Tensor]],
    ) -> None:
        """Draw the next guess of each active request (row j of the logits is active[j]'s)
        from the draft's distribution q, shaped by the request's own sampling settings, and
        keep q for the rejection rule."""
        if not active:
            return
        rows = [
            replace(requests[i].row, output_token_ids=requests[i].row.output_token_ids + guesses[i])
            for i in active
        ]
        q = self.sampler.probabilities(logits, rows)
        for row_q, row, i in zip(q, rows, active):
            generator = row.generator or self.sampler.default_generator
            try:
                guesses[i].append(draw(row_q, generator))
            except NothingToSample:  # the draft's logits are NaN there: its guesses end
                continue
            probs[i].append(row_q)

    def catch_up_lengths(self, requests: list[ProposalRequest]) -> list[int]:
        """How many of its unread tokens each request reads in forward 0: all of them while
        the token budget lasts, in batch order, then what is left of it, then none."""
        left = self.max_num_tokens
        lengths = []
        for request in requests:
            unread = len(request.token_ids) - request.num_draft_cached
            lengths.append(unread if left is None else min(unread, left))
            if left is not None:
                left -= lengths[-1]
        return lengths

    def num_guesses_that_fit(self, request: ProposalRequest) -> int:
        """Guess j's K/V go at position n + j - 1 (the last guess is never read), so the
        request's blocks must reach that far: the scheduler's lookahead slots make room for k
        guesses, except near the end of the context."""
        slots = len(request.block_ids) * self.kv_cache.block_size
        return max(0, min(self.k, slots - len(request.token_ids) + 1))

    def forward(
        self, block_tables: list[list[int]], chunks: list[tuple[list[int], int]]
    ) -> torch.Tensor:
        """One draft forward over each request's chunk (its tokens, the position of the first),
        reading and writing the draft's pool; the logits after each chunk's last token."""
        block_size = self.kv_cache.block_size
        input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for table, (tokens, start) in zip(block_tables, chunks):
            end = start + len(tokens)
            input_ids += tokens
            positions += range(start, end)
            slots += slot_mapping(table, block_size, start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
        metadata = AttentionMetadata.build(
            query_lens, seq_lens, block_tables, slots, device=self.device
        )
        hidden = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.attention_backend(self.kv_cache, metadata),
            self.num_layers,
        )
        last_rows = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        return self.model.compute_logits(hidden[last_rows])
