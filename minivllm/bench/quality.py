"""Chapter 12 — what fewer bits cost: perplexity on held-out prose, and greedy agreement.

Quantization changes every weight a little; whether that matters is measured on the model's
outputs, two ways:

- **Perplexity** on text the model did not write: exp of the mean negative log-likelihood of
  each token given the ones before it (the engine's `prompt_logprobs`). The text is
  `data/heldout_prose.txt`, a story written for minivllm (about 2,600 tokens, no download). It
  is cut into windows scored one at a time, each from its own start, as language-model
  evaluations do: the first token of a window has no context and is not scored.
- **Greedy agreement**: decode the same prompts greedily with and without quantization and
  count the tokens that are equal before the first difference. One different token changes
  everything after it, so this is the strictest test a quantized model can fail.
"""

from __future__ import annotations

import math
from pathlib import Path

HELDOUT_PROSE = Path(__file__).parent / "data" / "heldout_prose.txt"


def heldout_token_ids(tokenizer) -> list[int]:
    """The held-out prose as token ids (no special tokens: plain text)."""
    return tokenizer.encode(HELDOUT_PROSE.read_text(), add_special_tokens=False)


def windows(token_ids: list[int], length: int) -> list[list[int]]:
    """`token_ids` cut into consecutive windows of `length` tokens (the last one may be
    shorter; a window of one token has nothing to score and is dropped)."""
    cut = [token_ids[i : i + length] for i in range(0, len(token_ids), length)]
    return [window for window in cut if len(window) > 1]


def perplexity(llm, token_ids: list[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood) of every token after the first of each window, as
    the engine scores them (`SamplingParams.prompt_logprobs=0`: each prompt token's own
    logprob)."""
    from minivllm.sample.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    prompts = [{"prompt_token_ids": ids} for ids in windows(token_ids, window)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    total, count = 0.0, 0
    for prompt, output in zip(prompts, outputs):
        ids = prompt["prompt_token_ids"]
        for position in range(1, len(ids)):
            total -= output.prompt_logprobs[position][ids[position]].logprob
            count += 1
    return math.exp(total / count)


def tokens_before_first_difference(tokens: list[int], reference: list[int]) -> int:
    """How many tokens two greedy outputs share from the start."""
    for position, (token, expected) in enumerate(zip(tokens, reference)):
        if token != expected:
            return position
    return min(len(tokens), len(reference))
