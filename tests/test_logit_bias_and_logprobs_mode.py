"""logit_bias and logprobs_mode through the whole engine, against transformers.

logit_bias (OpenAI's) is added to the logits before a token is chosen. logprobs_mode (vLLM's
engine setting) says what logprobs report: "raw_logprobs" (the default, vLLM V1's) is
log_softmax of the model's own logits, whatever the request's penalties; "processed_logprobs"
is log_softmax of the logits the token was chosen from. With a repetition penalty the two
differ by exactly transformers' `RepetitionPenaltyLogitsProcessor`.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import ENGINE_TEST_FAMILY, assert_pool_is_empty

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.cli import add_engine_args

TOLERANCE = 1e-4
PROMPT = [5, 17, 300, 2048, 77, 9, 300, 17]
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs, tiny_models):
    return tiny_model_dirs[ENGINE_TEST_FAMILY], tiny_models(ENGINE_TEST_FAMILY)[1]


def tiny_llm(model_dir, **settings) -> LLM:
    return LLM(model_dir, dtype="float32", device="cpu", block_size=4, **settings)


def generate(llm: LLM, params: SamplingParams, prompt=PROMPT):
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert_pool_is_empty(llm.llm_engine)
    return output.outputs[0]


@torch.inference_mode()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits at every position of token_ids."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy_with_bias(hf_model, prompt: list[int], bias: dict[int, float], steps: int):
    """Greedy decoding with transformers, the bias added to the logits at every step."""
    tokens = list(prompt)
    for _ in range(steps):
        logits = hf_logits(hf_model, tokens)[-1]
        for token_id, value in bias.items():
            logits[token_id] += value
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


# --- logit_bias ---


def test_a_bias_of_plus_100_forces_a_token(tiny):
    model_dir, _ = tiny
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, logit_bias={1234: 100.0})
    assert generate(tiny_llm(model_dir), params).token_ids == [1234] * NUM_TOKENS


def test_a_bias_of_minus_100_bans_the_greedy_token(tiny, tiny_greedy):
    """-100 on the token greedy decoding picks first: it never appears, and every step takes
    what transformers' argmax of the biased logits takes."""
    model_dir, hf_model = tiny
    banned = tiny_greedy(PROMPT, 1)[0]
    bias = {banned: -100.0}
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logit_bias=bias
    )

    tokens = generate(tiny_llm(model_dir), params).token_ids

    assert banned not in tokens
    assert tokens == hf_greedy_with_bias(hf_model, PROMPT, bias, NUM_TOKENS)


@pytest.mark.parametrize("field", ["logit_bias", "stop_token_ids"])
def test_a_token_id_outside_the_vocabulary_is_refused_naming_the_field(tiny, field):
    """Checked before anything is queued: the sampler would index the logits with the id
    (a stop id past the vocabulary once killed the engine mid-step)."""
    model_dir, _ = tiny
    llm = tiny_llm(model_dir)
    vocab_size = llm.llm_engine.model_config.vocab_size
    value = {vocab_size: 1.0} if field == "logit_bias" else [vocab_size + 7]
    with pytest.raises(ValueError, match=f"^{field} must "):
        llm.generate("Hi", SamplingParams(min_tokens=2, **{field: value}), use_tqdm=False)
    assert_pool_is_empty(llm.llm_engine)
    # The engine still runs.
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


# --- logprobs_mode ---


def reported(completion) -> list[dict[int, float]]:
    return [{t: e.logprob for t, e in step.items()} for step in completion.logprobs]


def assert_logprobs_equal(steps: list[dict[int, float]], references: list[torch.Tensor]):
    for step, reference in zip(steps, references, strict=True):
        for token_id, value in step.items():
            assert value == pytest.approx(float(reference[token_id]), abs=TOLERANCE)


@pytest.mark.parametrize(
    "settings", [{}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}]
)
def test_raw_and_processed_logprobs_differ_exactly_by_the_penalty(
    embedded_dir, hf_embedded_model, tokenizer, settings
):
    """Greedy decoding of a repetitive prompt on the embedded model with repetition_penalty
    1.5: the tokens do not depend on the mode; the default (raw) logprobs are transformers'
    log_softmax of the plain logits, the processed ones its log_softmax after
    RepetitionPenaltyLogitsProcessor(1.5) over the context (also when n-gram drafts, which
    this prompt invites, are verified)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    prompt = tokenizer.encode("one two three one two three one two three one two")
    params = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, repetition_penalty=1.5, logprobs=3
    )
    settings = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=2**26, **settings)

    raw = generate(LLM(embedded_dir, **settings), params, prompt)
    processed_llm = LLM(embedded_dir, logprobs_mode="processed_logprobs", **settings)
    processed = generate(processed_llm, params, prompt)

    assert raw.token_ids == processed.token_ids
    context = prompt + list(raw.token_ids)
    logits = hf_logits(hf_embedded_model, context)
    penalty = RepetitionPenaltyLogitsProcessor(1.5)
    raw_reference, processed_reference = [], []
    for step, token in enumerate(raw.token_ids):
        position = len(prompt) - 1 + step
        row = logits[position]
        penalised = penalty(torch.tensor([context[: position + 1]]), row[None].clone())[0]
        assert token == int(penalised.argmax())
        raw_reference.append(row.log_softmax(dim=-1))
        processed_reference.append(penalised.log_softmax(dim=-1))
    assert_logprobs_equal(reported(raw), raw_reference)
    assert_logprobs_equal(reported(processed), processed_reference)
    # The penalty matters here: " three" is the model's favourite and has been seen.
    assert any(set(r) != set(p) for r, p in zip(reported(raw), reported(processed), strict=True))


def test_raw_logits_report_the_models_logits(tiny):
    """raw_logits: the values reported are transformers' logits themselves."""
    model_dir, hf_model = tiny
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)

    completion = generate(tiny_llm(model_dir, logprobs_mode="raw_logits"), params)

    logits = hf_logits(hf_model, PROMPT + list(completion.token_ids))
    start = len(PROMPT) - 1
    assert_logprobs_equal(reported(completion), [logits[start + i] for i in range(3)])


def test_logprobs_mode_is_an_engine_setting_and_a_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).logprobs_mode == "raw_logprobs"
    assert parser.parse_args(["--logprobs-mode", "processed_logits"]).logprobs_mode == (
        "processed_logits"
    )
    with pytest.raises(ValueError, match="^logprobs_mode must be "):
        LLM(logprobs_mode="processed")
