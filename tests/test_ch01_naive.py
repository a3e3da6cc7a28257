"""Chapter 01 checks: the naive loop (rerun the whole sequence for every new token) decodes
greedily exactly like transformers' `generate`.

No KV cache is involved on our side, so these runs are slow on purpose (quadratic in the
length): prompts are real chat prompts of very different lengths, replies 20 tokens at most.
"""

from __future__ import annotations

import pytest
from conftest import CHAT_MESSAGES, EOS_TOKEN_ID, hf_generate

from minivllm.baselines.naive import generate_with_transformers, generate_without_cache
from minivllm.models.tiny import TINY_FAMILIES

MAX_NEW_TOKENS = 20


@pytest.mark.parametrize("prompt_index", range(len(CHAT_MESSAGES)))
def test_naive_greedy_equals_transformers(
    prompt_index, embedded_model, chat_prompts, transformers_greedy
):
    """Recomputing everything each step gives transformers' greedy tokens, EOS stop included."""
    prompt = chat_prompts[prompt_index]
    expected = transformers_greedy(prompt, MAX_NEW_TOKENS, EOS_TOKEN_ID)
    assert generate_without_cache(embedded_model, prompt, MAX_NEW_TOKENS, EOS_TOKEN_ID) == expected


def test_generate_with_transformers_is_plain_greedy_generate(
    hf_embedded_model, chat_prompts, transformers_greedy
):
    """The baseline wrapper returns just the new tokens of a greedy `model.generate` call."""
    prompt = chat_prompts[0]
    expected = transformers_greedy(prompt, MAX_NEW_TOKENS, EOS_TOKEN_ID)
    assert (
        generate_with_transformers(hf_embedded_model, prompt, MAX_NEW_TOKENS, EOS_TOKEN_ID)
        == expected
    )


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_naive_greedy_equals_transformers_on_tiny_models(family, tiny_models, chat_prompts):
    """Each family's tiny random model decodes like transformers, token for token."""
    ours, hf_model = tiny_models(family)
    prompt = chat_prompts[1]
    expected = hf_generate(hf_model, prompt, 24, EOS_TOKEN_ID)
    assert generate_without_cache(ours, prompt, 24, EOS_TOKEN_ID) == expected
