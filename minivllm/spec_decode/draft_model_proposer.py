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
from minivllm.spec_decode.rejection_sampler import draw


class DraftModelProposer:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: PagedKVCache,
        attention_backend: type[PagedAttentionBackend],
        sampler: Sampler,
        num_speculative_tokens: int,
        num_layers: int | None = None,
    ):
        self.model = model
        self.num_layers = num_layers  # layer_skip: run only the first layers; None: all
        self.kv_cache = kv_cache
        self.attention_backend = attention_backend
        self.sampler = sampler
        self.k = num_speculative_tokens
        self.device = model.model.embed_tokens.weight.device

    @torch.inference_mode()
    def propose_batch(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Up to k guesses per request; after the call the draft holds K/V for all of each
        request's token_ids."""
        num_guesses = [self.num_guesses_that_fit(request) for request in requests]
        guesses: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        for step in range(max(num_guesses, default=0)):
            active = [i for i, count in enumerate(num_guesses) if count > step]
            if step == 0:  # catch up on the tokens not read yet
                chunks = [
                    (
                        requests[i].token_ids[requests[i].num_draft_cached :],
                        requests[i].num_draft_cached,
                    )
                    for i in active
                ]
            else:  # read the latest guess
                chunks = [([guesses[i][-1]], len(requests[i].token_ids) + step - 1) for i in active]
            logits = self.forward([requests[i].block_ids for i in active], chunks)
            rows = [
                replace(
                    requests[i].row,
                    output_token_ids=requests[i].row.output_token_ids + guesses[i],
                )
                for i in active
            ]
            q = self.sampler.probabilities(logits, rows)
            for row_q, row, i in zip(q, rows, active):
                generator = row.generator or self.sampler.default_generator
                guesses[i].append(draw(row_q, generator))
                probs[i].append(row_q)
        return [
            Proposal(tokens, None if request.row.params.is_greedy else torch.stack(q))
            if tokens
            else Proposal([])
            for request, tokens, q in zip(requests, guesses, probs)
        ]

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
