"""What comes out: vLLM's `RequestOutput` and `CompletionOutput` (what `LLM.generate` returns,
field for field), and the model runner's plain-data `ModelRunnerOutput` of one step.

Shared by every chapter's engine, so that code written against minivllm runs on vLLM by
changing the import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.sample.sampler import TokenLogprobs


@dataclass
class Logprob:
    """One candidate token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence (a request with n > 1 has n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    # "stop" (EOS, stop token, stop string, a complete grammar), "length", "abort", or "error"
    # (vLLM's FinishReason.ERROR: a fault of this sequence alone, told in `error`).
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # with finish_reason "error": what went wrong, in one line

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its completions, as `LLM.generate` returns them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    # (nothing predicts it); entry i holds prompt token i and the top tokens given tokens < i.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None, repr=False)


@dataclass
class PromptLogprobsChunk:
    """The logprobs of consecutive prompt tokens scored in one step: tokens[j] is prompt
    token start + j under the model's distribution at the position before it (its
    `sampled_token_id` is that prompt token)."""

    start: int
    tokens: list[TokenLogprobs]


@dataclass
class ModelRunnerOutput:
    """What the model runner returns for one step, as plain data: for every request whose step
    reached the end of its known tokens, the token(s) sampled and their logprobs (None when
    the request asked for none). A prefill chunk that stops mid-prompt samples nothing."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs] | None] = field(default_factory=dict)
    # Chapter 08: request id -> draft tokens proposed for the next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Request id -> why it cannot go on (nothing could be sampled): it ends with that error.
    errors: dict[str, str] = field(default_factory=dict)
    # Requests with prompt_logprobs whose step computed prompt tokens: their new entries.
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
