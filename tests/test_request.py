"""The stop rules of a `Request` (minivllm/core/request.py), on their own.

In the engine the sampler bans EOS and stop token ids until min_tokens tokens exist, so the
request's own min_tokens gate never sees them early. These tests append tokens to a request
directly, the way an engine with a different sampler (or a speculative step that accepts
several tokens at once) would, so the request's gate has to hold by itself.

The tokenizer is a stand-in that spells token i as the i-th letter, which makes stop strings
easy to place; expectations come from the rules written out in plain Python.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.core.request import Request
from minivllm.outputs import Logprob, PromptLogprobsChunk
from minivllm.sample.sampler import TokenLogprobs
from minivllm.sample.sampling_params import SamplingParams

LETTERS = "abcdefgh"
EOS, STOP_ID = 0, 1  # spelt "a" and "b"; stop strings below use only "c", "d", "e"


class LetterTokenizer:
    """Token i decodes to LETTERS[i]: one character per token, nothing special."""

    def decode(self, token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(LETTERS[i] for i in token_ids)


def make_request(params: SamplingParams, max_model_len: int = 64, index: int = 0) -> Request:
    return Request.create(
        request_id="r",
        prompt=None,
        prompt_token_ids=[2, 3],
        params=params,
        tokenizer=LetterTokenizer(),
        eos_token_ids=(EOS,),
        max_model_len=max_model_len,
        index=index,
    )


def append_until_finished(request: Request, token_ids: list[int]) -> int:
    """Append tokens one by one until the request finishes; how many were appended."""
    for count, token_id in enumerate(token_ids, start=1):
        request.append_token(token_id)
        if request.is_finished:
            return count
    return len(token_ids)


@pytest.mark.parametrize("stopping_token", [EOS, STOP_ID])
def test_eos_and_stop_ids_do_not_stop_a_request_before_min_tokens(stopping_token):
    """min_tokens=3: the stopping token as output tokens 1 and 2 is kept and the request goes
    on; as token 3 it ends the request with finish_reason "stop" (and, for a stop id, that id
    as stop_reason)."""
    params = SamplingParams(min_tokens=3, max_tokens=10, stop_token_ids=[STOP_ID])
    request = make_request(params)

    for count in (1, 2):
        request.append_token(stopping_token)
        assert not request.is_finished, (
            f"token {stopping_token} as output token {count} of min_tokens=3 ended the request"
        )
    request.append_token(stopping_token)

    assert request.finish_reason == "stop"
    assert request.stop_reason == (None if stopping_token == EOS else STOP_ID)
    assert request.output_token_ids == [stopping_token] * 3
    # The two early ones are ordinary text; the one that stops is never shown.
    assert request.detokenizer.output_text == LETTERS[stopping_token] * 2


def expected_finish(token_ids, min_tokens, max_tokens, ignore_eos, stop):
    """The stop rules in vLLM's order, spelt out: (tokens appended, finish_reason, stop_reason),
    or None if the request is still running after all of them."""
    text = ""
    for count, token_id in enumerate(token_ids, start=1):
        may_stop = count >= min_tokens
        if may_stop and token_id == EOS and not ignore_eos:
            return count, "stop", None
        if may_stop and token_id == STOP_ID:
            return count, "stop", STOP_ID
        text += LETTERS[token_id]
        if may_stop and stop is not None and text.endswith(stop):
            return count, "stop", stop
        if count >= max_tokens:
            return count, "length", None
    return None


@settings(max_examples=150, deadline=None)
@given(
    token_ids=st.lists(st.integers(0, 4), max_size=12),
    min_tokens=st.integers(0, 6),
    extra_tokens=st.integers(0, 6),
    ignore_eos=st.booleans(),
    stop=st.none() | st.sampled_from(["c", "cd", "dc", "ee"]),
)
def test_a_request_stops_exactly_where_the_rules_say(
    token_ids, min_tokens, extra_tokens, ignore_eos, stop
):
    """Random outputs over {EOS, a stop id, three letters}: the request finishes at the first
    token where EOS (unless ignore_eos), the stop id or a stop string may stop it (only from
    output token min_tokens on) or max_tokens is reached, with the matching reasons."""
    params = SamplingParams(
        min_tokens=min_tokens,
        max_tokens=min_tokens + extra_tokens or 1,
        ignore_eos=ignore_eos,
        stop_token_ids=[STOP_ID],
        stop=stop,
    )
    request = make_request(params)

    appended = append_until_finished(request, token_ids)

    expected = expected_finish(token_ids, min_tokens, params.max_tokens, ignore_eos, stop)
    output = request.completion_output()  # what the user reads
    got = (appended, output.finish_reason, output.stop_reason) if request.is_finished else None
    assert got == expected, (
        f"finished as {got}, expected {expected} (tokens appended, finish_reason, stop_reason) "
        f"for outputs {token_ids}, min_tokens={min_tokens}, max_tokens={params.max_tokens}, "
        f"ignore_eos={ignore_eos}, stop={stop!r}"
    )


@pytest.mark.parametrize("detokenize", [True, False])
def test_each_tokens_logprobs_are_recorded_with_its_text_and_summed(detokenize):
    """Per output token: its top tokens by rank, then the token itself (with its own rank)
    when it is not among them, each spelt by the tokenizer (no text without a detokenizer);
    the cumulative logprob adds up the sampled tokens' logprobs."""
    request = make_request(SamplingParams(logprobs=1, max_tokens=5, detokenize=detokenize))

    request.append_token(3, TokenLogprobs(3, -0.5, 1, [(3, -0.5)]))
    request.append_token(4, TokenLogprobs(4, -2.0, 3, [(2, -0.25)]))

    def text(letter: str) -> str | None:
        return letter if detokenize else None

    assert request.logprobs == [
        {3: Logprob(-0.5, 1, text("d"))},
        {2: Logprob(-0.25, 1, text("c")), 4: Logprob(-2.0, 3, text("e"))},
    ]
    assert request.cumulative_logprob == -2.5
    output = request.completion_output()
    assert (output.logprobs, output.cumulative_logprob) == (request.logprobs, -2.5)
    assert output.text == ("de" if detokenize else "")


def test_a_new_request_keeps_its_prompt_and_a_seeded_one_its_own_generator():
    seeded = Request.create(
        "s", "cd", [2, 3], SamplingParams(seed=7), LetterTokenizer(), (EOS,), 64
    )
    assert (seeded.prompt, seeded.index, seeded.metrics.num_prompt_tokens) == ("cd", 0, 2)
    assert seeded.generator is not None and seeded.generator.initial_seed() == 7
    assert make_request(SamplingParams()).generator is None


def test_completion_i_of_n_reports_its_index():
    request = make_request(SamplingParams(n=3, max_tokens=1), index=2)
    request.append_token(3)
    assert request.completion_output().index == 2


class StandInGrammar:
    """A grammar that forbids one token, allows the rest, and is complete once it has taken
    its end token."""

    def __init__(self, forbidden: int = -1, end: int = -1):
        self.forbidden, self.end = forbidden, end
        self.is_terminated = False

    def accept(self, token_id: int) -> bool:
        self.is_terminated = token_id == self.end
        return token_id != self.forbidden


def test_a_token_the_grammar_forbids_ends_the_request_without_being_recorded():
    request = make_request(SamplingParams(max_tokens=10))
    request.grammar = StandInGrammar(forbidden=4)
    request.append_token(3)
    request.append_token(4)
    assert request.output_token_ids == [3]
    assert (request.finish_reason, request.error) == (
        "error",
        "token 4 was emitted although the grammar forbids it",
    )


def test_a_complete_grammar_stops_the_request_even_before_min_tokens():
    request = make_request(SamplingParams(min_tokens=5, max_tokens=10))
    request.grammar = StandInGrammar(end=EOS)
    request.append_token(3)
    request.append_token(EOS)
    assert (request.finish_reason, request.output_token_ids) == ("stop", [3, EOS])


def test_the_first_token_and_the_end_are_timed_once():
    """first_token_time is stamped by the first token only, finished_time by the last."""
    request = make_request(SamplingParams(max_tokens=3))
    request.append_token(3)
    first = request.metrics.first_token_time
    assert first is not None and request.metrics.finished_time is None
    request.append_token(3)
    assert request.metrics.first_token_time == first and request.metrics.finished_time is None
    request.append_token(3)
    assert request.metrics.finished_time is not None and request.metrics.finished_time >= first
    assert request.metrics.num_generation_tokens == 3


def test_an_error_ends_the_request_alone_with_its_message():
    request = make_request(SamplingParams())
    request.append_token(3)

    request.finish_with_error("no token can be sampled")

    assert request.is_finished and request.metrics.finished_time is not None
    output = request.completion_output()
    assert (output.finish_reason, output.error) == ("error", "no token can be sampled")
    assert output.token_ids == [3]


def test_prompt_logprobs_are_recorded_in_prompt_order_and_a_gap_is_refused():
    """The first prompt token has none (nothing predicts it); a chunk must start where the
    recorded ones end."""
    request = make_request(SamplingParams(prompt_logprobs=1))  # prompt [2, 3]
    assert request.prompt_logprobs == [None] and not request.has_all_prompt_logprobs
    token_3 = TokenLogprobs(3, -1.5, 2, [(2, -0.5)])

    with pytest.raises(AssertionError, match="r: prompt logprobs from token 2, 1 recorded"):
        request.record_prompt_logprobs(PromptLogprobsChunk(2, [token_3]))
    request.record_prompt_logprobs(PromptLogprobsChunk(1, [token_3]))

    assert request.prompt_logprobs == [None, {2: Logprob(-0.5, 1, "c"), 3: Logprob(-1.5, 2, "d")}]
    assert request.has_all_prompt_logprobs
