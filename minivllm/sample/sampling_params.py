"""The sampling parameters of one request, vLLM's `SamplingParams`, checked when they are made.

The sampler (`sample/sampler.py`) applies them
to a batch. Every invalid value raises a `ValueError` that names the field, the value and the
rule, so a bad request fails before it reaches the engine.
"""

from __future__ import annotations

import json as json_module
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from minivllm.utils import as_int, float_in, int_at_least, reject, string_list, token_id_list

# Temperatures below this are treated as greedy, as in vLLM: dividing by a tiny temperature
# would overflow the logits, and the resulting distribution is argmax anyway.
GREEDY_TEMPERATURE_THRESHOLD = 1e-5

# The seeds torch's random generator accepts: a signed or an unsigned 64-bit integer.
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass
class StructuredOutputsParams:
    """Chapter 10: the form the output must take, vLLM's names; set exactly one field.

    json: a JSON schema (dict or string); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: one of these strings; grammar: an EBNF grammar
    (GBNF style, `root ::= ...`)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name, value in self._fields() if value not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            reject("structured_outputs.json", self.json, "a JSON schema (dict or string)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                reject(f"structured_outputs.{name}", value, "a non-empty string")
        if self.choice is not None:
            self.choice = string_list("structured_outputs.choice", self.choice)
            if not self.choice:
                reject("structured_outputs.choice", self.choice, "a list of non-empty strings")
        if self.json_object not in (None, True, False):
            reject("structured_outputs.json_object", self.json_object, "a bool")

    def _fields(self) -> list[tuple[str, Any]]:
        names = ("json", "regex", "choice", "grammar", "json_object")
        return [(name, getattr(self, name)) for name in names]

    def kind(self) -> tuple[str, Any]:
        """The one field that is set, and its value."""
        return next((name, value) for name, value in self._fields() if value not in (None, False))

    def key(self) -> str:
        """A string naming the spec, equal for equal specs (a compiled grammar is reused). Key
        order is kept: a schema's property order is the order of the fields it produces."""
        kind, value = self.kind()
        return kind + ":" + json_module.dumps(value)


@dataclass
class SamplingParams:
    """How one request wants its tokens chosen. Field names and defaults follow vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, normalised to 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: generate up to the model's context length
    min_tokens: int = 0
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top logprobs to return per generated token
    # Per prompt token: its logprob and rank, plus this many top tokens (-1: the whole
    # vocabulary). None: off. Reported in RequestOutput.prompt_logprobs.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> a number added to its logit before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # False: no text at all, only token ids (logprobs without decoded tokens). The server's
    # engine core runs every request so, and its front end makes the text (chapter 09).
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # chapter 10

    def __post_init__(self) -> None:
        self._validate_integers()
        self._validate_sampling_knobs()
        self._validate_penalties()
        self._validate_logit_bias()
        self._validate_stops()
        self._validate_flags()
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            reject("structured_outputs", self.structured_outputs, "a StructuredOutputsParams")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_THRESHOLD

    def for_completion(self, index: int) -> SamplingParams:
        """The parameters of completion `index` of an n > 1 request: with a seed, completion i
        samples with seed + i, so that siblings differ and each is reproducible (as in vLLM).
        The siblings share one prompt, so only completion 0 scores it (prompt_logprobs)."""
        if index == 0:
            return self
        seed = None if self.seed is None else self.seed + index
        return replace(self, seed=seed, prompt_logprobs=None)

    def _validate_integers(self) -> None:
        self.n = int_at_least("n", self.n, 1)
        if self.max_tokens is not None:
            self.max_tokens = int_at_least("max_tokens", self.max_tokens, 1)
        self.min_tokens = int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            reject("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            self.logprobs = int_at_least("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = int_at_least("prompt_logprobs", self.prompt_logprobs, -1)
        if self.seed is not None:
            self.seed = self._checked_seed()

    def _checked_seed(self) -> int:
        """The seed, refused here if completion n - 1's seed (seed + n - 1) would not fit the
        generator: a seed torch cannot take must fail at once, not in the engine later."""
        seed, (low, high) = as_int("seed", self.seed), SEED_RANGE
        if not low <= seed <= high - (self.n - 1):
            reject("seed", seed, f"an int from -2**63 to 2**64 - {self.n} (n={self.n})")
        return seed

    def _validate_sampling_knobs(self) -> None:
        self.temperature = float_in("temperature", self.temperature, low=0.0)
        self.top_p = float_in("top_p", self.top_p, low=0.0, high=1.0, low_inclusive=False)
        self.min_p = float_in("min_p", self.min_p, low=0.0, high=1.0)
        top_k = as_int("top_k", self.top_k)
        if top_k < -1:
            reject("top_k", top_k, "-1 or >= 0 (-1 and 0 both disable top-k)")
        self.top_k = max(top_k, 0)

    def _validate_penalties(self) -> None:
        self.presence_penalty = float_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = float_in(
            "repetition_penalty", self.repetition_penalty, low=0.0, low_inclusive=False
        )

    def _validate_logit_bias(self) -> None:
        """Token ids >= 0 (the engine checks them against its vocabulary) to finite numbers."""
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, Mapping) or not all(
            _is_token_id(token_id) and _is_finite_number(bias)
            for token_id, bias in self.logit_bias.items()
        ):
            reject("logit_bias", self.logit_bias, "a dict of token ids to finite numbers")
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}

    def _validate_stops(self) -> None:
        self.stop = string_list("stop", self.stop)
        self.stop_token_ids = token_id_list("stop_token_ids", self.stop_token_ids)

    def _validate_flags(self) -> None:
        names = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize")
        for name in names:
            if not isinstance(getattr(self, name), bool):
                reject(name, getattr(self, name), "a bool")
        if self.stop and not self.detokenize:  # vLLM's rule: a stop string is found in text
            reject("stop", self.stop, "empty when detokenize is False (stop strings need text)")


def _is_token_id(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _is_finite_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
