"""A request's state while it is being generated, shared by every chapter's engine.

A `Request` is one sequence: its prompt ids, the tokens generated so far, its sampling
parameters, its own random generator (when seeded) and its incremental detokenizer. The
engine appends one token at a time and asks `check_stop` whether the sequence is done; the
rules (EOS, stop token ids, stop strings, a completed grammar, max_tokens, the model's context)
are the same whichever engine produced the token, so they live here once.

With `params.detokenize` False there is no detokenizer: the sequence has token ids only, and
only the token-level rules apply. The server's engine core runs requests so; its front end
makes the text and checks the stop strings (chapter 09, engine/output_processor.py).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from minivllm.outputs import CompletionOutput, Logprob, PromptLogprobsChunk, RequestMetrics
from minivllm.sample.sampler import TokenLogprobs
from minivllm.sample.sampling_params import SamplingParams
from minivllm.sequence import SequenceTokens, own_generator
from minivllm.structured_output.manager import RequestGrammar
from minivllm.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FINISHED = "finished"


@dataclass
class Request(SequenceTokens):
    """One sequence being generated."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    detokenizer: IncrementalDetokenizer | None  # None with params.detokenize False
    tokenizer: Any = None  # decodes the logprobs' tokens (with a detokenizer)
    index: int = 0  # which of the parent request's n completions this is
    parent_request_id: str | None = None  # the user's id; request_id is this sequence's own
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # With params.prompt_logprobs: one entry per prompt token scored so far (None for the first).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # with finish_reason "error": what went wrong, in one line
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    # Scheduling state (chapter 04): tokens whose K/V are in the cache, and the queue position.
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    priority: int = 0  # with the "priority" policy, lower runs first (vLLM's convention)
    num_preemptions: int = 0
    # Prefix caching (chapter 05): requests with different salts never share KV blocks.
    cache_salt: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    # Speculative decoding (chapter 08): draft tokens proposed after the last step, to be
    # verified by the next one (not part of the output until accepted).
    spec_token_ids: list[int] = field(default_factory=list)
    # Structured outputs (chapter 10): the sequence's place in its grammar, or None.
    grammar: RequestGrammar | None = None

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        index: int = 0,
    ) -> Request:
        # (Completion i of an n > 1 request comes with params.for_completion(i), its own seed.)
        generator = own_generator(params)
        detokenizer = None
        if params.detokenize:
            detokenizer = IncrementalDetokenizer.for_params(tokenizer, prompt_token_ids, params)
        request = cls(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            eos_token_ids=eos_token_ids,
            max_model_len=max_model_len,
            tokenizer=tokenizer,
            detokenizer=detokenizer,
            index=index,
            generator=generator,
        )
        request.metrics.num_prompt_tokens = len(prompt_token_ids)
        if params.logprobs is not None:
            request.logprobs, request.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # nothing predicts the first prompt token
        return request

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def max_tokens(self) -> int:
        """The output budget: max_tokens, or whatever the context leaves when it is None."""
        room = self.max_model_len - len(self.prompt_token_ids)
        return room if self.params.max_tokens is None else min(self.params.max_tokens, room)

    def append_token(self, token_id: int, token_logprobs: TokenLogprobs | None = None) -> None:
        """Record a sampled token, its logprobs, and whether it ends the sequence. A token the
        sequence's grammar forbids (chapter 10; its mask should have stopped it) is not
        recorded: the sequence ends with an error instead."""
        if self.grammar is not None and not self.grammar.accept(token_id):
            self.finish_with_error(f"token {token_id} was emitted although the grammar forbids it")
            return
        now = time.monotonic()
        if not self.output_token_ids:
            self.metrics.first_token_time = now
        self.output_token_ids.append(token_id)
        self.metrics.num_generation_tokens += 1
        if token_logprobs is not None:
            self._record_logprobs(token_logprobs)
        self._check_stop(token_id)
        if self.is_finished:
            self.metrics.finished_time = now

    def finish_with_error(self, message: str) -> None:
        """End this sequence alone, finish_reason "error" (vLLM's FinishReason.ERROR): a fault
        of its own (its grammar, its logits) must not stop the engine or its batch."""
        self.finish_reason, self.error = "error", message
        self.metrics.finished_time = time.monotonic()

    def _record_logprobs(self, token_logprobs: TokenLogprobs) -> None:
        self.logprobs.append(self._logprob_entries(token_logprobs))
        self.cumulative_logprob += token_logprobs.sampled_logprob

    def record_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        """Append the entries of the prompt tokens a step scored (the runner scores each
        prompt token once, in order, even when a preempted prompt is recomputed)."""
        assert chunk.start == len(self.prompt_logprobs), (
            f"{self.request_id}: prompt logprobs from token {chunk.start}, "
            f"{len(self.prompt_logprobs)} recorded"
        )
        self.prompt_logprobs += [self._logprob_entries(t) for t in chunk.tokens]

    @property
    def has_all_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(
            self.prompt_token_ids
        )

    def _logprob_entries(self, token_logprobs: TokenLogprobs) -> dict[int, Logprob]:
        """The top tokens by rank, then the chosen token (sampled, or the prompt's) if it is
        not among them, each with its text (when the sequence is detokenized)."""
        entries = {
            token_id: Logprob(logprob, rank, self._decoded_token(token_id))
            for rank, (token_id, logprob) in enumerate(token_logprobs.top, start=1)
        }
        chosen = token_logprobs.sampled_token_id
        if chosen not in entries:
            entries[chosen] = Logprob(
                token_logprobs.sampled_logprob,
                token_logprobs.sampled_rank,
                self._decoded_token(chosen),
            )
        return entries

    def _decoded_token(self, token_id: int) -> str | None:
        return None if self.detokenizer is None else self.tokenizer.decode([token_id])

    def _check_stop(self, token_id: int) -> None:
        """The stop rules, in vLLM's order. Before min_tokens nothing stops a sequence (the
        sampler has banned EOS and stop ids until then). A stop token ends it without being
        detokenized, so the text never shows it; a stop string is found in the text."""
        params = self.params
        if len(self.output_token_ids) >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                self.finish_reason = "stop"
                return
            if token_id in params.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", token_id
                return
        if self.grammar is not None and self.grammar.is_terminated:
            # Chapter 10: the grammar is complete and took its end token, even short of
            # min_tokens (the sampler lets the end through when nothing else is allowed).
            self.finish_reason = "stop"
            return
        if self.detokenizer is not None:  # without one, chapter 09's front end has the text
            matched_stop_string = self.detokenizer.append_token(token_id)
            if matched_stop_string is not None:
                self.finish_reason, self.stop_reason = "stop", matched_stop_string
                return
        if len(self.output_token_ids) >= self.max_tokens:
            self.finish_reason = "length"

    def completion_output(self) -> CompletionOutput:
        """This sequence as vLLM's CompletionOutput. Like vLLM, the token ids include a final
        EOS or stop token while the text does not."""
        return CompletionOutput(
            index=self.index,
            text="" if self.detokenizer is None else self.detokenizer.output_text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )
