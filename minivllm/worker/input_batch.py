"""Chapter 04 — the model runner's own view of its requests, and the flat batch of one step.

The runner never sees the scheduler's `Request` objects (chapter 04's scheduler output is plain
data, `core/scheduler_output.py`). It keeps, per request, just what a forward pass and the
sampler need: the token ids, the block table, the sampling parameters and the random
generator. Each step it lays the scheduled tokens side by side:

    scheduled:      A: 1 token (decode)      B: 3 tokens (a prompt chunk, 4 cached before)
    input_ids       [a9,                     b4, b5, b6]
    positions       [9,                      4,  5,  6]       each token's place in its sequence
    slot_mapping    [A.table[2]*16+9,        B.table[0]*16+4, ...]   where its K/V are written
    sample_rows     [0,                      3]               last row of each sequence that
                                                              reached the end of its tokens

A request that asks for prompt logprobs also has the rows of its prompt chunk scored: the row
at position p gives the distribution of prompt token p + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.attention.backend import slot_mapping
from minivllm.sample.sampling_params import SamplingParams
from minivllm.sequence import SequenceTokens


@dataclass
class CachedRequestState(SequenceTokens):
    """One request as the runner holds it, between the steps it runs in."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]
    num_computed_tokens: int
    # A seeded request owns its generator, so its samples do not depend on what else is in
    # the batch; it lives as long as the request, across preemptions.
    generator: torch.Generator | None
    # Chapter 08: leading tokens whose K/V a draft model holds, and the distributions its last
    # drafts were drawn from (None: certain drafts).
    num_draft_cached: int = 0
    draft_probs: torch.Tensor | None = None
    # Prompt logprobs: prompt tokens 1 .. this - 1 are scored already. A prompt recomputed
    # after a preemption is not scored again.
    num_prompt_tokens_scored: int = 1


@dataclass
class PromptLogprobRows:
    """The rows of one request's prompt chunk whose logits score the prompt tokens after them:
    rows[j] scores prompt token first_token + j."""

    first_token: int
    rows: range


@dataclass
class InputBatch:
    """One step's tokens laid out flat, with what attention and sampling need to know."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]  # new tokens of each sequence
    seq_lens: list[int]  # context + new tokens of each sequence
    block_tables: list[list[int]]
    sample_rows: list[int]  # the row whose logits give each sampling request's next token
    sample_req_ids: list[str]
    # Chapter 08: request id -> the rows of its last known token and of its draft tokens (the
    # target's distribution at each draft position, and after the last one).
    spec_rows: dict[str, list[int]]
    # Requests with prompt_logprobs whose chunk holds prompt tokens not scored yet.
    prompt_logprob_rows: dict[str, PromptLogprobRows]


def prepare_inputs(
    requests: dict[str, CachedRequestState],
    num_scheduled_tokens: dict[str, int],
    block_size: int,
    spec_tokens: dict[str, list[int]] | None = None,
) -> InputBatch:
    """Lay out the scheduled tokens of every request side by side, in the scheduler's order.

    A request computes its tokens num_computed..num_computed + n - 1; it samples when that
    reaches its last known token (a prefill chunk that stops mid-prompt does not). With draft
    tokens (chapter 08) the grant runs past the last known token over the drafts, and every
    row from the last known token on is scored.
    """
    spec_tokens = spec_tokens or {}
    batch = InputBatch([], [], [], [], [], [], [], [], {}, {})
    for req_id, num_new in num_scheduled_tokens.items():
        state = requests[req_id]
        drafts = spec_tokens.get(req_id, [])
        start, end = state.num_computed_tokens, state.num_computed_tokens + num_new
        first_row = len(batch.input_ids)
        batch.input_ids += state.token_ids_between(start, end - len(drafts)) + drafts
        batch.positions += range(start, end)
        batch.slot_mapping += slot_mapping(state.block_ids, block_size, start, end)
        batch.query_lens.append(num_new)
        batch.seq_lens.append(end)
        batch.block_tables.append(state.block_ids)
        if drafts:
            last_known = first_row + (state.num_tokens - 1 - start)
            batch.spec_rows[req_id] = list(range(last_known, first_row + num_new))
        elif end == state.num_tokens:
            batch.sample_rows.append(len(batch.input_ids) - 1)
            batch.sample_req_ids.append(req_id)
        if state.params.prompt_logprobs is not None:
            rows = _prompt_logprob_rows(state, start, end, first_row)
            if rows is not None:
                batch.prompt_logprob_rows[req_id] = rows
    return batch


def _prompt_logprob_rows(
    state: CachedRequestState, start: int, end: int, first_row: int
) -> PromptLogprobRows | None:
    """The rows of positions start..end-1 that score prompt tokens not scored yet: position
    p scores token p + 1, for the tokens num_prompt_tokens_scored .. end (within the prompt)."""
    first_token = max(start + 1, state.num_prompt_tokens_scored)
    last_token = min(end, len(state.prompt_token_ids) - 1)
    if first_token > last_token:
        return None
    rows = range(first_row + first_token - 1 - start, first_row + last_token - start)
    return PromptLogprobRows(first_token, rows)
