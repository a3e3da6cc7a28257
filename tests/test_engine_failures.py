"""A fault in one request ends that request, never the engine.

What belongs to one sequence (its grammar rejects a token, its grammar fails to compile, its
logits are NaN so that nothing can be sampled) finishes that sequence with finish_reason
"error" (vLLM's FinishReason.ERROR) and a one-line `CompletionOutput.error`; its blocks go back,
the other requests of the batch go on with the tokens they would have had alone, and
`engine.step()` does not raise. The min_tokens ban never takes away the last token a grammar
allows: a grammar that is complete ends its sequence. The engine's shutdown stops the grammar
compile pool.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ENGINE_TEST_FAMILY, EOS_TOKEN_ID, assert_pool_is_empty
from test_ch04_engine import run_to_completion

import minivllm.worker.model_runner as model_runner_module
from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sample.sampler import Sampler, SamplingRow

FREE_PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}
FREE = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
YES_NO = StructuredOutputsParams(choice=["yes", "no"])
VOCAB = 16


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return str(tiny_model_dirs[ENGINE_TEST_FAMILY])


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, block_size=4)


def free_tokens_alone(llm) -> list[int]:
    return list(llm.generate(FREE_PROMPT, FREE, use_tqdm=False)[0].outputs[0].token_ids)


def row(min_tokens: int = 0, output_token_ids=(), **params) -> SamplingRow:
    return SamplingRow(
        SamplingParams(min_tokens=min_tokens, max_tokens=16, **params),
        prompt_token_ids=[1, 2],
        output_token_ids=list(output_token_ids),
        generator=torch.Generator().manual_seed(0),
        eos_token_ids=(EOS_TOKEN_ID,),
    )


def allowed_only(*token_ids: int) -> torch.Tensor:
    """One row of logits as a grammar's mask leaves it: -inf everywhere else."""
    logits = torch.full((VOCAB,), float("-inf"))
    logits[list(token_ids)] = torch.arange(len(token_ids), dtype=torch.float32)
    return logits


# --- min_tokens and a grammar -------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_min_tokens_ban_never_takes_the_last_allowed_token(temperature):
    """A complete grammar allows only EOS: the ban must leave it. Where the grammar allows
    more, the ban holds as usual."""
    logits = torch.stack([allowed_only(EOS_TOKEN_ID), allowed_only(9, EOS_TOKEN_ID)])
    rows = [row(min_tokens=5, temperature=temperature) for _ in range(2)]
    sampled = Sampler()(logits, rows)
    assert sampled.token_ids == [EOS_TOKEN_ID, 9]
    assert sampled.errors == [None, None]
    probs = Sampler().probabilities(logits, rows)
    assert probs[0, EOS_TOKEN_ID] == 1.0 and probs[1, 9] == 1.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_with_a_complete_grammar_ends_the_request(llm, temperature):
    """After "yes" the grammar allows only EOS, before min_tokens is reached: the grammar
    wins and the output is "yes" or "no", beside a free request that is not disturbed."""
    alone = free_tokens_alone(llm)
    params = SamplingParams(
        max_tokens=10, min_tokens=5, temperature=temperature, seed=1, structured_outputs=YES_NO
    )
    outputs = llm.generate(["Answer yes or no:", FREE_PROMPT], [params, FREE], use_tqdm=False)
    constrained, free = outputs[0].outputs[0], outputs[1].outputs[0]
    assert constrained.text in ("yes", "no")
    assert constrained.finish_reason == "stop" and constrained.error is None
    assert list(free.token_ids) == alone
    assert_pool_is_empty(llm.llm_engine)


# --- a fault of one request ends that request -----------------------------------------------------


def test_a_token_the_grammar_rejects_ends_only_its_request(llm, monkeypatch):
    """With the mask switched off the sampler emits tokens the grammar forbids: the grammar's
    request finishes with an error (LLM.generate returns it), the free one runs on."""
    alone = free_tokens_alone(llm)
    monkeypatch.setattr(model_runner_module, "apply_token_bitmasks", lambda *args: None)
    # A string no random model starts with by chance: its first token is one of 49,152.
    choice = StructuredOutputsParams(choice=["zzzz yes"])
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice)
    outputs = llm.generate(["Answer:", FREE_PROMPT], [params, FREE], use_tqdm=False)
    failed, free = outputs[0].outputs[0], outputs[1].outputs[0]
    assert failed.finish_reason == "error"
    assert "grammar" in failed.error and "\n" not in failed.error
    assert failed.token_ids == []  # the forbidden token is not part of the output
    assert list(free.token_ids) == alone and free.error is None
    assert_pool_is_empty(llm.llm_engine)


def test_a_grammar_that_fails_to_compile_ends_only_its_request(model_dir, monkeypatch):
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=4))
    engine.add_request("warm", "Hi", SamplingParams(max_tokens=1, structured_outputs=YES_NO))
    run_to_completion(engine)  # builds the manager

    def failing_compile(grammar):
        raise RuntimeError("[12:00:00] grammar_compiler.cc:42: the compiler ran out of states")

    compiler = engine.structured_output_manager.compiler
    monkeypatch.setattr(compiler, "compile_grammar", failing_compile)
    broken = StructuredOutputsParams(choice=["alpha", "beta"])
    engine.add_request(
        "broken", "Pick one", SamplingParams(max_tokens=8, structured_outputs=broken)
    )
    engine.add_request("free", FREE_PROMPT, FREE)
    finished = run_to_completion(engine)
    failed = finished["broken"].outputs[0]
    assert failed.finish_reason == "error"
    assert failed.error == "the grammar failed to compile: the compiler ran out of states"
    assert finished["free"].outputs[0].finish_reason == "length"
    assert_pool_is_empty(engine)


def poison_rows_after(model, token_id: int, monkeypatch) -> None:
    """Make the model's hidden state NaN wherever its input token is `token_id`, so that the
    logits there are NaN: a fault of that one sequence's rows."""
    forward = model.forward

    def poisoned(input_ids, *args, **kwargs):
        hidden = forward(input_ids, *args, **kwargs)
        return hidden.masked_fill((input_ids == token_id).unsqueeze(-1), float("nan"))

    monkeypatch.setattr(model, "forward", poisoned)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("grammar", [None, StructuredOutputsParams(json_object=True)])
def test_nan_logits_end_only_their_request(model_dir, monkeypatch, temperature, grammar):
    poison = 777
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=4))
    engine.add_request("free", FREE_PROMPT, FREE)
    alone = list(run_to_completion(engine)["free"].outputs[0].token_ids)
    poison_rows_after(engine.executor.driver_worker.model, poison, monkeypatch)
    params = SamplingParams(
        temperature=temperature, seed=0, max_tokens=8, structured_outputs=grammar
    )
    engine.add_request("nan", {"prompt_token_ids": [9, 10, poison]}, params)
    engine.add_request("free", FREE_PROMPT, FREE)
    finished = run_to_completion(engine)
    failed = finished["nan"].outputs[0]
    assert failed.finish_reason == "error" and "NaN" in failed.error
    assert failed.token_ids == []
    assert list(finished["free"].outputs[0].token_ids) == alone
    assert_pool_is_empty(engine)


def test_nan_logits_in_a_verification_end_only_their_request(model_dir, monkeypatch):
    """The target as its own draft model (greedy: every draft is accepted), with the target's
    hidden states NaN from position 25 on, which only the long prompt reaches: its draft at
    position 25 is verified against a row with nothing to sample."""
    itself = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 2}
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=4, speculative_config=itself))
    engine.add_request("free", FREE_PROMPT, FREE)
    alone = list(run_to_completion(engine)["free"].outputs[0].token_ids)
    target = engine.executor.driver_worker.model
    forward = target.forward

    def poisoned(input_ids, positions, *args, **kwargs):
        hidden = forward(input_ids, positions, *args, **kwargs)
        return hidden.masked_fill((positions >= 25).unsqueeze(-1), float("nan"))

    monkeypatch.setattr(target, "forward", poisoned)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    engine.add_request("nan", {"prompt_token_ids": list(range(100, 124))}, params)
    engine.add_request("free", FREE_PROMPT, FREE)
    finished = run_to_completion(engine)
    failed = finished["nan"].outputs[0]
    assert failed.finish_reason == "error" and "NaN" in failed.error
    assert engine.scheduler.spec_decode_stats.num_draft_tokens > 0
    assert list(finished["free"].outputs[0].token_ids) == alone
    assert_pool_is_empty(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_and_inf_logits_never_give_a_token_the_grammar_forbids(temperature):
    """Row 0: the grammar allows 3 and 4, and a repetition penalty that is 0 in float32 (as
    5e-324 is) turns the mask's -inf into NaN (-inf * 0) and the seen token 4 into +inf. Row 1:
    NaN and +inf straight from the model beside allowed tokens. Row 2: nothing but NaN."""
    penalised = row(temperature=temperature, output_token_ids=[4])
    penalised.params.repetition_penalty = 5e-324  # past validation: what float32 makes of it
    logits = torch.stack(
        [
            allowed_only(3, 4),
            torch.tensor([float("nan"), float("inf"), float("-inf"), 0.5] + [float("nan")] * 12),
            torch.full((VOCAB,), float("nan")),
        ]
    )
    rows = [penalised, row(temperature=temperature), row(temperature=temperature)]
    sampled = Sampler()(logits, rows)
    assert sampled.token_ids[:2] == [4, 1]  # the +inf token, the one the model is sure of
    assert sampled.errors[:2] == [None, None]
    assert "NaN" in sampled.errors[2]
    probs = Sampler().probabilities(logits, rows)
    assert probs[0, 4] == 1.0 and probs[1, 1] == 1.0
    assert probs[2].sum() == 0  # nothing to draw from


# --- shutdown -----------------------------------------------------------------------------------


def test_shutdown_stops_the_grammar_compile_pool(model_dir):
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=4))
    engine.add_request("a", "Hi", SamplingParams(max_tokens=2, structured_outputs=YES_NO))
    run_to_completion(engine)
    pool = engine.structured_output_manager.compile_pool
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shutdown"):
        pool.submit(print)
