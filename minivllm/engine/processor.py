"""Turning what a user passes in into validated requests (vLLM calls this the Processor).

All checks happen here, before anything reaches an engine: a bad prompt raises a clear
`TypeError`/`ValueError` naming what was wrong, and no engine state has been touched, so the
`LLM` stays usable for the next call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from minivllm.sample.sampling_params import SamplingParams
from minivllm.structured_output.manager import parse_grammar
from minivllm.tokenizer import encode_prompt

PROMPT_FORMS = "a string, {'prompt': str} or {'prompt_token_ids': list[int]}"


@dataclass
class ProcessedPrompt:
    text: str | None  # None when the user gave token ids
    token_ids: list[int]
    cache_salt: str | None = None  # prefix caching: only requests with the same salt share

    def as_prompt(self) -> dict:
        """The checked prompt in the form `add_request` takes, so it is not encoded again."""
        return {
            "prompt": self.text,
            "prompt_token_ids": self.token_ids,
            "cache_salt": self.cache_salt,
        }


@dataclass
class Processor:
    tokenizer: object
    vocab_size: int
    max_model_len: int

    def process_prompt(self, prompt) -> ProcessedPrompt:
        """A string, a `{"prompt": ...}` or a `{"prompt_token_ids": [...]}` -> checked token ids."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self._encode(prompt)
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, token_ids = (
                prompt.get("prompt"),
                self._check_token_ids(prompt["prompt_token_ids"]),
            )
        elif isinstance(prompt, Mapping) and "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(
                    f"prompt['prompt'] must be a string, got {type(prompt['prompt']).__name__}"
                )
            text, token_ids = prompt["prompt"], self._encode(prompt["prompt"])
        else:
            raise TypeError(f"a prompt must be {PROMPT_FORMS}; got {type(prompt).__name__}")
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt is {len(token_ids)} tokens long, but the model's context is "
                f"{self.max_model_len} tokens (including at least one generated token)"
            )
        return ProcessedPrompt(text, token_ids, cache_salt)

    def process_request(
        self, prompt, params: SamplingParams | None
    ) -> tuple[ProcessedPrompt, SamplingParams]:
        """A request's prompt and params, checked (ValueError/TypeError); None params are the
        defaults."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        processed = self.process_prompt(prompt)
        self.check_fits(processed, params)
        self.check_vocabulary_ids(params)
        if params.structured_outputs is not None:
            # Chapter 10: a grammar that does not parse is refused here, before anything is
            # queued (parsing is cheap; the compile runs later, in the engine's background).
            parse_grammar(params.structured_outputs)
        return processed, params

    def check_fits(self, prompt: ProcessedPrompt, params: SamplingParams) -> None:
        """Prompt plus max_tokens must fit in the context."""
        if params.max_tokens is not None:
            total = len(prompt.token_ids) + params.max_tokens
            if total > self.max_model_len:
                raise ValueError(
                    f"max_tokens={params.max_tokens} does not fit: the prompt has "
                    f"{len(prompt.token_ids)} tokens and the context {self.max_model_len}, so "
                    f"max_tokens can be at most {self.max_model_len - len(prompt.token_ids)}"
                )

    def check_vocabulary_ids(self, params: SamplingParams) -> None:
        """Fields that name tokens may only name tokens of the vocabulary (vLLM's rule): the
        sampler indexes the logits with them, and an id past the end would fail mid-step."""
        named = {"logit_bias": params.logit_bias, "stop_token_ids": params.stop_token_ids}
        for name, token_ids in named.items():
            outside = [t for t in token_ids or () if t >= self.vocab_size]
            if outside:
                raise ValueError(
                    f"{name} must name token ids below the vocabulary size {self.vocab_size}, "
                    f"got {outside[:5]}"
                )

    def _encode(self, text: str) -> list[int]:
        if not text:
            raise ValueError("the prompt is empty; give at least one character or token")
        return encode_prompt(self.tokenizer, text)

    def _check_token_ids(self, token_ids) -> list[int]:
        if not isinstance(token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise TypeError("prompt_token_ids must be a list of ints")
        if not token_ids:
            raise ValueError("prompt_token_ids is empty; give at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids contains ids outside the vocabulary [0, {self.vocab_size}): "
                f"{bad[:5]}"
            )
        return list(token_ids)


def broadcast_params(
    params: SamplingParams | list[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """One SamplingParams for all prompts, or one per prompt (vLLM's rule)."""
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if isinstance(params, (list, tuple)):
        if len(params) != num_prompts:
            raise ValueError(
                f"got {len(params)} SamplingParams for {num_prompts} prompts; pass one, or one "
                "per prompt"
            )
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
        return list(params)
    raise TypeError(
        f"sampling_params must be SamplingParams or a list of them, got {type(params).__name__}"
    )
