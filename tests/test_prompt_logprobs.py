"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): for every prompt token, how likely
the model found it given the tokens before it, plus the k most likely tokens at that place.

transformers is the oracle: one forward pass over the whole prompt, `log_softmax(logits[i - 1])`
scores prompt token i. The engine must give the same numbers however it computes the prompt:
in one step or in chunks over several, recomputed after a preemption (each token reported
once), with the prefix cache on, with n > 1, with speculative decoding and split over two
tensor-parallel ranks.
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import ENGINE_TEST_FAMILY, assert_pool_is_empty

from minivllm import LLM, SamplingParams
from minivllm.models.tiny import make_tiny_model

# Agreement of two float32 implementations of the same model, in logprob units.
TOLERANCE = 1e-4

# K and V of the tiny models: 2 layers x 2 KV heads x 16 dims x 2 x 4 bytes (float32).
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 16 * 2 * 4

# Token ids of short random prompts; the tiny models share the embedded model's vocabulary.
SHORT_PROMPTS = [
    [1],
    [5, 17],
    [5, 17, 300, 2048, 77, 9],
    list(range(40, 75)),  # several blocks of four: chunked by a small budget
    list(range(40, 60)) + [900, 901],  # shares 20 tokens with the one above
]


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs, tiny_models):
    """The engine tests' tiny model: its directory and transformers' copy of it."""
    return tiny_model_dirs[ENGINE_TEST_FAMILY], tiny_models(ENGINE_TEST_FAMILY)[1]


@torch.inference_mode()
def reference_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: row i is log_softmax of transformers' logits at position i."""
    logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def rank_bounds(row: torch.Tensor, value: float) -> tuple[int, int]:
    """The ranks (1 = most likely) a token of logprob `value` may have in `row`, allowing for
    tokens within TOLERANCE of it to fall on either side."""
    return 1 + int((row > value + TOLERANCE).sum()), 1 + int((row > value - TOLERANCE).sum())


def assert_prompt_logprobs_equal_transformers(prompt_logprobs, prompt, reference, num_top):
    """One entry per prompt token, None first; entry i holds prompt token i (its logprob and
    rank) and the num_top most likely tokens given prompt[:i], ranked 1..num_top."""
    assert prompt_logprobs is not None
    assert len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entries, row = prompt_logprobs[i], reference[i - 1]
        token = prompt[i]
        assert token in entries, f"prompt token {i} is missing from its own entry"
        assert entries[token].logprob == pytest.approx(float(row[token]), abs=TOLERANCE)
        low, high = rank_bounds(row, float(row[token]))
        assert low <= entries[token].rank <= high, f"prompt token {i}: rank"
        top = {t: e for t, e in entries.items() if e.rank <= num_top and t != token}
        if entries[token].rank <= num_top:
            top[token] = entries[token]
        assert sorted(e.rank for e in top.values()) == list(range(1, num_top + 1))
        assert len(entries) in (num_top, num_top + 1)
        kth_best = float(row.topk(num_top).values[-1]) if num_top else None
        for token_id, entry in top.items():
            assert entry.logprob == pytest.approx(float(row[token_id]), abs=TOLERANCE)
            assert entry.logprob >= kth_best - TOLERANCE


def tiny_llm(model_dir, **settings) -> LLM:
    defaults = dict(dtype="float32", device="cpu", block_size=4, kv_cache_memory_bytes=2**22)
    return LLM(model_dir, **{**defaults, **settings})


def generate(llm: LLM, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"max_num_batched_tokens": 3},
        {"max_num_batched_tokens": 7},
        {"max_num_batched_tokens": 16, "enable_prefix_caching": False},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        {"speculative_config": {"method": "layer_skip", "num_draft_layers": 1}},
    ],
    ids=["one-step", "chunks-of-3", "chunks-of-7", "no-prefix-cache", "ngram", "layer-skip"],
)
@pytest.mark.parametrize("num_top", [0, 3])
def test_prompt_logprobs_equal_transformers(tiny, settings, num_top):
    """Every prompt token's logprob, rank and top-k equal transformers' log_softmax, whether the
    prompt runs in one step or in chunks of 3 or 7 tokens (a chunk that ends on the prompt's
    last token samples too), with or without speculative decoding."""
    model_dir, hf_model = tiny
    llm = tiny_llm(model_dir, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=num_top)

    outputs = generate(llm, SHORT_PROMPTS, params)

    for output, prompt in zip(outputs, SHORT_PROMPTS, strict=True):
        assert output.prompt_token_ids == prompt
        reference = reference_logprobs(hf_model, prompt)
        assert_prompt_logprobs_equal_transformers(
            output.prompt_logprobs, prompt, reference, num_top
        )
    assert_pool_is_empty(llm.llm_engine)


def test_prompt_logprobs_are_off_by_default(tiny):
    model_dir, _ = tiny
    outputs = generate(tiny_llm(model_dir), SHORT_PROMPTS[2:3], SamplingParams(max_tokens=2))
    assert outputs[0].prompt_logprobs is None


def test_a_preempted_prompt_reports_each_token_once(tiny, tiny_greedy):
    """A pool of 24 four-token blocks cannot hold every request: running ones are preempted,
    mid-prompt or mid-decode, and recomputed. Each prompt token is still reported exactly once,
    with transformers' values, and the tokens are those of transformers' greedy decoding."""
    model_dir, hf_model = tiny
    prompts = [list(range(100 + 9 * i, 130 + 9 * i)) for i in range(4)]
    llm = tiny_llm(
        model_dir,
        kv_cache_memory_bytes=24 * 4 * TINY_KV_BYTES_PER_TOKEN,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)

    outputs = generate(llm, prompts, params)

    preemptions = {m.name: m.value for m in llm.get_metrics()}["vllm:num_preemptions"]
    assert preemptions > 0, "the pool was meant to be too small"
    for output, prompt in zip(outputs, prompts, strict=True):
        assert output.outputs[0].token_ids == tiny_greedy(prompt, 16)
        reference = reference_logprobs(hf_model, prompt)
        assert_prompt_logprobs_equal_transformers(output.prompt_logprobs, prompt, reference, 2)
    assert_pool_is_empty(llm.llm_engine)


def test_prompt_logprobs_with_the_prefix_cache_holding_the_prompt(tiny):
    """A prompt whose blocks the prefix cache already holds is still scored in full (like vLLM,
    a request that asks for prompt logprobs does not read the prefix cache), and a later
    request without them still hits the cache."""
    model_dir, hf_model = tiny
    prompt = list(range(200, 230))
    llm = tiny_llm(model_dir, enable_prefix_caching=True)
    plain = SamplingParams(temperature=0.0, max_tokens=2)

    generate(llm, [prompt], plain)  # fills the cache
    scored = generate(llm, [prompt], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    again = generate(llm, [prompt], plain)[0]

    reference = reference_logprobs(hf_model, prompt)
    assert_prompt_logprobs_equal_transformers(scored.prompt_logprobs, prompt, reference, 1)
    assert again.num_cached_tokens > 0
    assert_pool_is_empty(llm.llm_engine)


def test_prompt_logprobs_with_n_completions(tiny):
    """n sampled completions share one prompt, scored once, on the request's output."""
    model_dir, hf_model = tiny
    prompt = SHORT_PROMPTS[3]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=5, prompt_logprobs=2)

    output = generate(tiny_llm(model_dir, max_num_batched_tokens=8), [prompt], params)[0]

    assert len(output.outputs) == 3
    reference = reference_logprobs(hf_model, prompt)
    assert_prompt_logprobs_equal_transformers(output.prompt_logprobs, prompt, reference, 2)


def test_prompt_logprobs_minus_one_gives_the_whole_vocabulary(tiny):
    """prompt_logprobs=-1 (vLLM's value) ranks every token of the vocabulary."""
    model_dir, hf_model = tiny
    prompt = [5, 17, 300]
    llm = tiny_llm(model_dir)
    vocab_size = llm.llm_engine.model_config.vocab_size

    output = generate(llm, [prompt], SamplingParams(max_tokens=1, prompt_logprobs=-1))[0]

    reference = reference_logprobs(hf_model, prompt)
    assert_prompt_logprobs_equal_transformers(output.prompt_logprobs, prompt, reference, vocab_size)


def test_prompt_logprobs_on_the_embedded_model(embedded_dir, hf_embedded_model, tokenizer):
    """One short real prompt: lm-eval's loglikelihood of " Paris" after the question is the
    sum of these entries."""
    prompt = tokenizer.encode("Question: What is the capital of France?\nAnswer: Paris")
    llm = LLM(embedded_dir, dtype="float32", device="cpu", max_num_batched_tokens=5)

    output = generate(llm, [prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]

    reference = reference_logprobs(hf_embedded_model, prompt)
    assert_prompt_logprobs_equal_transformers(output.prompt_logprobs, prompt, reference, 1)


def test_prompt_logprobs_split_over_two_ranks(tmp_path, embedded_dir):
    """Tensor parallelism: rank 0 gathers the logits of every prompt position, the other rank
    takes part in each gather and reports nothing; the values are the unsplit model's."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model("mistral", tmp_path / "tp", seed=1, tokenizer_dir=embedded_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    llm = tiny_llm(model_dir, tensor_parallel_size=2, max_num_batched_tokens=8)
    try:
        outputs = generate(llm, SHORT_PROMPTS, params)
        assert_pool_is_empty(llm.llm_engine)
    finally:
        del llm
        gc.collect()
    for output, prompt in zip(outputs, SHORT_PROMPTS, strict=True):
        reference = reference_logprobs(hf_model, prompt)
        assert_prompt_logprobs_equal_transformers(output.prompt_logprobs, prompt, reference, 2)


@pytest.mark.parametrize("value", [-2, 1.5, True, "1"])
def test_invalid_prompt_logprobs_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="^prompt_logprobs must be "):
        SamplingParams(prompt_logprobs=value)
