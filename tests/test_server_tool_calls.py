"""tool_choice "required" through the server: the answer is a JSON array of calls, and a model
may not know when to close it. The tiny random model, greedy, repeats its one call until
max_tokens; the server ends the answer before the repeat, returns the calls an answer cut
short completed, and honours parallel_tool_calls. The official `openai` client's streaming
helper, which raises on an answer cut by max_tokens, gets its call. Everything runs on the ASGI
app (no socket), on an engine in a thread of this process.
"""

from __future__ import annotations

import json

import openai
import pydantic
import pytest
from conftest import ENGINE_TEST_FAMILY
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from test_ch09_server import ENGINE_SETTINGS, MODEL, sse_events, wait_until_idle
from test_served_schema import served_app

PING = {
    "type": "function",
    "function": {
        "name": "ping",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
# Greedy, the tiny model answers [{"name": "ping", "parameters": {}}, {"name": "ping", ...
# and goes on (18 tokens a call) until max_tokens.
PING_REQUEST = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Ping it"}],
    "tools": [PING],
    "tool_choice": "required",
    "max_tokens": 60,
    "temperature": 0,
}
TOKENS_PER_CALL = 18


@pytest.fixture(scope="module")
def served(tiny_model_dirs):
    with served_app(tiny_model_dirs[ENGINE_TEST_FAMILY], **ENGINE_SETTINGS) as served:
        yield served


def chat(served, body: dict) -> dict:
    response = TestClient(served.app).post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def called(choice: dict) -> list[tuple[str, dict]]:
    return [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in choice["message"]["tool_calls"]
    ]


@pytest.mark.parametrize("parallel", [None, True, False])
def test_a_repeated_call_ends_the_answer(served, parallel):
    """It used to run to max_tokens, finish "length", with tool_calls [] and the array in
    the content."""
    body = {**PING_REQUEST, "parallel_tool_calls": parallel}
    answer = chat(served, body)
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    assert called(choice) == [("ping", {})]
    # How far past the repeat the engine ran before the server read it depends on timing, so
    # the usage is only bounded (test_a_repeat_closes_the_streams_at_once checks the abort).
    assert TOKENS_PER_CALL <= answer["usage"]["completion_tokens"] <= body["max_tokens"]
    wait_until_idle(served)  # nothing runs, every block is free


def test_a_streamed_answer_ends_at_the_repeat_too(served):
    events = sse_events(
        TestClient(served.app).post(
            "/v1/chat/completions",
            json={**PING_REQUEST, "stream": True, "stream_options": {"include_usage": True}},
        )
    )
    usage = events.pop()["usage"]
    calls = [c for e in events for c in e["choices"] if c["delta"].get("tool_calls")]
    (last,) = calls
    (call,) = last["delta"]["tool_calls"]
    assert call["function"] == {"name": "ping", "arguments": "{}"}
    assert last["finish_reason"] == "tool_calls"
    assert TOKENS_PER_CALL <= usage["completion_tokens"] <= PING_REQUEST["max_tokens"]
    wait_until_idle(served)


def test_an_answer_cut_by_max_tokens_returns_the_calls_it_completed(served):
    """One call and part of the next: the call is returned, the answer stays "length"."""
    answer = chat(served, {**PING_REQUEST, "max_tokens": TOKENS_PER_CALL + 6})
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "length"
    assert called(choice) == [("ping", {})]
    too_short = chat(served, {**PING_REQUEST, "max_tokens": TOKENS_PER_CALL // 2})
    (choice,) = too_short["choices"]
    assert choice["message"]["tool_calls"] == [] and choice["message"]["content"]
    wait_until_idle(served)


def test_n_answers_each_end_at_their_repeat(served):
    answer = chat(served, {**PING_REQUEST, "n": 3, "temperature": 1.0, "seed": 0})
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    for choice in answer["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        assert called(choice) == [("ping", {})]
    wait_until_idle(served)


class Ping(pydantic.BaseModel):
    pass


def test_the_openai_stream_helper_gets_the_call(served):
    """openai's `chat.completions.stream` raises LengthFinishReasonError on an answer cut by
    max_tokens, which the repeated call used to be."""
    client = openai.OpenAI(
        base_url="http://testserver/v1",
        api_key="none",
        max_retries=0,
        http_client=TestClient(served.app),
    )
    request = {**PING_REQUEST, "tools": [openai.pydantic_function_tool(Ping, name="ping")]}
    with client.chat.completions.stream(**request) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "ping" and call.function.parsed_arguments == Ping()
    wait_until_idle(served)


# --- reading the calls out of the text -----------------------------------------------------------

CALLS = st.lists(
    st.fixed_dictionaries(
        {
            "name": st.sampled_from(["ping", "get_weather"]),
            "parameters": st.dictionaries(st.sampled_from("abc"), st.integers(0, 3), max_size=2),
        }
    ),
    min_size=1,
    max_size=4,
)


@given(calls=CALLS, cut=st.integers(0, 400), separator=st.sampled_from([", ", ","]))
def test_complete_calls_are_those_the_text_finished(calls, cut, separator):
    from minivllm.entrypoints.openai.serving_chat import complete_calls

    text = "[" + separator.join(json.dumps(call) for call in calls) + "]"
    prefix = text[:cut]
    ends, position = [], 1
    for call in calls:
        position += len(json.dumps(call))
        ends.append(position)
        position += len(separator)
    assert complete_calls(prefix) == [c for c, end in zip(calls, ends) if end <= cut]


@given(calls=CALLS)
def test_first_distinct_keeps_the_calls_before_the_first_repeat(calls):
    from minivllm.entrypoints.openai.serving_chat import first_distinct

    distinct = first_distinct(calls)
    assert calls[: len(distinct)] == distinct
    assert all(call not in distinct[:i] for i, call in enumerate(distinct))
    if len(distinct) < len(calls):
        assert calls[len(distinct)] in distinct


# --- ending an answer at its repeat, whenever the repeat is read ---------------------------------

PING_CALL = '{"name": "ping", "parameters": {}}'


def request_output(text: str, finish_reason: str | None):
    from minivllm.outputs import CompletionOutput, RequestOutput

    completion = CompletionOutput(
        index=0, text=text, token_ids=list(range(len(text))), finish_reason=finish_reason
    )
    return RequestOutput("r", None, [1], [completion], finished=finish_reason is not None)


def ended_answers(*outputs) -> tuple[list, int]:
    """What without_repeated_calls yields from these outputs (one stream), and how many of
    them it read before closing the stream."""
    import asyncio

    from minivllm.entrypoints.openai.serving_chat import without_repeated_calls

    read = 0

    async def stream():
        nonlocal read
        for output in outputs:
            read += 1
            yield 0, output

    async def collect():
        return [output async for _, output in without_repeated_calls(stream())]

    return asyncio.run(collect()), read


@pytest.mark.parametrize("finish_reason", ["length", "stop"])
def test_a_choice_finished_before_its_repeat_was_read_is_cut_too(finish_reason):
    """The engine can run ahead of the server: the whole answer, repeat included, arrives in
    one output already finished ("length" at max_tokens, or "stop" when the array closed). It
    is cut at the repeat as if the repeat had been read in time (it used to pass whole, and a
    streamed answer ended "length" on a busy machine)."""
    text = f"[{PING_CALL}, {PING_CALL}, {PING_CALL}" + ("]" if finish_reason == "stop" else "")

    (answer,), read = ended_answers(request_output(text, finish_reason))

    (completion,) = answer.outputs
    assert json.loads(completion.text) == [json.loads(PING_CALL)]
    assert completion.finish_reason == "stop" and answer.finished and read == 1


def test_a_repeat_closes_the_streams_at_once():
    """A repeat read while the engine still runs ends the answer there: the stream is closed
    (which aborts the request) and nothing after it is read."""
    running = request_output(f"[{PING_CALL}, {PING_CALL}, ", None)
    later = request_output(f"[{PING_CALL}, {PING_CALL}, {PING_CALL}", "length")

    (answer,), read = ended_answers(running, later)

    assert json.loads(answer.outputs[0].text) == [json.loads(PING_CALL)]
    assert answer.finished and read == 1


@pytest.mark.parametrize("finish_reason", ["abort", "error"])
def test_an_aborted_or_failed_choice_is_left_as_it_ended(finish_reason):
    text = f"[{PING_CALL}, {PING_CALL}"
    (answer,), _ = ended_answers(request_output(text, finish_reason))
    assert answer.outputs[0].text == text and answer.outputs[0].finish_reason == finish_reason
