"""Chapter 02 checks: a KV cache changes how much work decoding does, never which tokens come out.

Static batching must reproduce, row by row, what transformers' `generate` produces for each
prompt alone, even when rows have different prompt lengths, different `max_tokens`, and stop at
EOS at different steps. The memory and waste numbers the chapter discusses are checked against
their definitions.
"""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_TOKEN_ID, hf_generate
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.baselines.kv_cache import ContiguousKVCache, generate_static_batch
from minivllm.baselines.naive import generate_without_cache
from minivllm.core.request import Request
from minivllm.models.loader import load_model
from minivllm.models.tiny import TINY_FAMILIES
from minivllm.sample.sampler import Sampler
from minivllm.sample.sampling_params import SamplingParams


def greedy_requests(tokenizer, prompts, max_tokens, ignore_eos=False) -> list[Request]:
    """One greedy request per prompt, with its own max_tokens."""
    return [
        Request.create(
            f"request-{i}",
            None,
            list(prompt),
            SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=ignore_eos),
            tokenizer,
            eos_token_ids=(EOS_TOKEN_ID,),
            max_model_len=8192,
        )
        for i, (prompt, limit) in enumerate(zip(prompts, max_tokens, strict=True))
    ]


def run_static_batch(model, tokenizer, prompts, max_tokens, ignore_eos=False):
    requests = greedy_requests(tokenizer, prompts, max_tokens, ignore_eos)
    stats = generate_static_batch(model, requests, Sampler())
    return requests, stats


# --- the tokens -----------------------------------------------------------------------------

# Per-row limits, against the prompts' natural reply lengths (10, 8, 24+, 7 tokens): row 0 is
# cut by its limit first, rows 1 and 3 end at EOS, row 2 runs longest.
STATIC_MAX_TOKENS = [6, 20, 24, 20]


def test_static_batch_equals_transformers_per_prompt(
    embedded_model, tokenizer, chat_prompts, transformers_greedy
):
    """A static batch of prompts of different lengths and limits gives each row exactly the
    tokens transformers generates for that prompt alone (EOS and max_tokens stops included)."""
    requests, _ = run_static_batch(embedded_model, tokenizer, chat_prompts, STATIC_MAX_TOKENS)
    for request, prompt, limit in zip(requests, chat_prompts, STATIC_MAX_TOKENS, strict=True):
        expected = transformers_greedy(prompt, limit, EOS_TOKEN_ID)
        assert request.output_token_ids == expected, f"row {request.request_id}"
        ended_at_eos = expected[-1] == EOS_TOKEN_ID
        assert request.finish_reason == ("stop" if ended_at_eos else "length")
    # The batch really mixes the two ways to finish and different lengths.
    assert {r.finish_reason for r in requests} == {"stop", "length"}
    assert len({len(r.output_token_ids) for r in requests}) > 2


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_static_batch_equals_transformers_on_tiny_models(
    family, tiny_models, tokenizer, chat_prompts
):
    """Decoding from the cache is right for every family (GQA, q/k/v bias, q/k norm)."""
    ours, hf_model = tiny_models(family)
    prompts, max_tokens = chat_prompts[:3], [5, 12, 9]
    requests, _ = run_static_batch(ours, tokenizer, prompts, max_tokens)
    for request, prompt, limit in zip(requests, prompts, max_tokens, strict=True):
        assert request.output_token_ids == hf_generate(hf_model, prompt, limit, EOS_TOKEN_ID)


class TinyLlama:
    """The tiny llama and the tokenizer, with a short repr for hypothesis' counterexamples."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def __repr__(self) -> str:
        return "TinyLlama()"


@pytest.fixture(scope="module")
def tiny_llama(tiny_models, tokenizer) -> TinyLlama:
    return TinyLlama(tiny_models("llama")[0], tokenizer)


@settings(max_examples=12, deadline=None)
@given(
    family=st.sampled_from(TINY_FAMILIES),
    prompt=st.lists(st.integers(3, 49151), min_size=1, max_size=40),
    max_tokens=st.integers(1, 12),
)
def test_kv_cache_loop_equals_no_cache_loop(family, prompt, max_tokens, tiny_models, tiny_llama):
    """With one sequence, prefill + cached decode gives the tokens of recomputing everything:
    the cache stores exactly the K/V the naive loop recomputes."""
    model, _ = tiny_models(family)
    tokenizer = tiny_llama.tokenizer  # all tiny models share the embedded model's tokenizer
    (request,), _ = run_static_batch(model, tokenizer, [prompt], [max_tokens], ignore_eos=True)
    assert request.output_token_ids == generate_without_cache(model, prompt, max_tokens)


# --- memory and waste -----------------------------------------------------------------------


def kv_bytes_per_token_by_definition(hf_config, dtype: torch.dtype) -> int:
    """K and V, for every layer and KV head, head_dim numbers each."""
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    element_size = torch.finfo(dtype).bits // 8
    return 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * element_size


def test_kv_bytes_per_token_of_the_embedded_model(embedded_model, hf_embedded_model):
    """SmolLM2-135M stores 2 (K,V) x 30 layers x 3 KV heads x 64 dims x 4 bytes = 46080 bytes
    per token in float32: the chapter's memory math."""
    config = embedded_model.config
    for dtype in (torch.float32, torch.bfloat16):
        expected = kv_bytes_per_token_by_definition(hf_embedded_model.config, dtype)
        assert config.kv_bytes_per_token(dtype) == expected
    assert config.kv_bytes_per_token(torch.float32) == 2 * 30 * 3 * 64 * 4 == 46080


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_size, max_len", [(1, 1), (3, 100), (8, 17)])
def test_contiguous_cache_reserves_batch_times_max_len_tokens(
    batch_size, max_len, dtype, embedded_model, hf_embedded_model
):
    """A contiguous cache reserves max_len slots for every row, used or not."""
    cache = ContiguousKVCache(embedded_model.config, batch_size, max_len, dtype, "cpu")
    per_token = kv_bytes_per_token_by_definition(hf_embedded_model.config, dtype)
    assert cache.reserved_bytes == batch_size * max_len * per_token
    assert cache.reserved_bytes == batch_size * max_len * embedded_model.config.kv_bytes_per_token(
        dtype
    )


@settings(max_examples=15, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(1, 12), st.integers(1, 8)),  # (prompt length, max_tokens)
        min_size=1,
        max_size=5,
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_static_batch_stats_count_computed_and_useful_rows(rows, seed, tiny_llama):
    """Every decode step computes every row; only rows still generating are useful. The batch
    runs until its longest request is done."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, 49152, (length,), generator=generator).tolist() for length, _ in rows
    ]
    max_tokens = [limit for _, limit in rows]
    requests, stats = run_static_batch(
        tiny_llama.model, tiny_llama.tokenizer, prompts, max_tokens, ignore_eos=True
    )

    assert [len(r.output_token_ids) for r in requests] == max_tokens
    # The prefill produces each row's first token; decode steps produce the rest.
    assert stats.decode_steps == max(max_tokens) - 1
    assert stats.computed_rows == stats.decode_steps * len(requests)
    assert stats.useful_rows == sum(limit - 1 for limit in max_tokens)
    assert stats.useful_rows <= stats.computed_rows


@settings(max_examples=15, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(1, 12), st.integers(1, 8)),  # (prompt length, max_tokens)
        min_size=1,
        max_size=5,
    ),
)
def test_static_batch_reserves_a_rectangle_that_fits_every_row(rows, tiny_llama):
    """Each row gets the same number of slots: enough for every row's prompt and output (the
    last sampled token is never fed back, so it needs none), and no more than the longest
    prompt plus the longest output. Rows that finished early keep running until the batch ends,
    so a short row with a long prompt must not run out of slots either."""
    prompts = [[5 + i] * length for i, (length, _) in enumerate(rows)]
    max_tokens = [limit for _, limit in rows]
    requests, stats = run_static_batch(
        tiny_llama.model, tiny_llama.tokenizer, prompts, max_tokens, ignore_eos=True
    )
    per_token = tiny_llama.model.config.kv_bytes_per_token(torch.float32)
    slots, remainder = divmod(stats.reserved_kv_bytes, len(requests) * per_token)
    assert remainder == 0
    longest_sequence = max(len(p) + limit for p, limit in zip(prompts, max_tokens, strict=True))
    assert longest_sequence - 1 <= slots <= max(map(len, prompts)) + max(max_tokens)


def test_one_long_request_makes_short_ones_waste_rows(tiny_llama, chat_prompts):
    """One long request among short ones (with prompts up to 122 tokens): the short rows keep
    being computed after they are done, the waste chapter 04's continuous batching removes."""
    max_tokens = [24, 2, 2, 2]
    _, stats = run_static_batch(
        tiny_llama.model, tiny_llama.tokenizer, chat_prompts, max_tokens, ignore_eos=True
    )
    assert stats.decode_steps == 23
    assert stats.computed_rows == 23 * 4
    assert stats.useful_rows == 23 + 3 * 1
    assert stats.computed_rows - stats.useful_rows > 0


# --- lower precision ------------------------------------------------------------------------


def test_bfloat16_model_starts_like_float32(
    embedded_dir, tokenizer, chat_prompts, transformers_greedy
):
    """In bfloat16 the embedded model still starts its greedy reply like the float32 model
    (a sanity check, not exactness: rounding can flip a close call later on)."""
    model = load_model(embedded_dir, torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    prompt = chat_prompts[1]
    float32_tokens = transformers_greedy(prompt, 20, EOS_TOKEN_ID)[:8]
    (request,), _ = run_static_batch(model, tokenizer, [prompt], [len(float32_tokens)])
    matching = 0
    for ours, reference in zip(request.output_token_ids, float32_tokens, strict=False):
        if ours != reference:
            break
        matching += 1
    print(f"bfloat16 matches float32 for the first {matching} of {len(float32_tokens)} tokens")
    assert matching >= min(4, len(float32_tokens))
