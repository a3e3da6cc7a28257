"""Chapter 10 through the server: structured outputs asked for in OpenAI's dialect
(`response_format`) or vLLM's (`structured_outputs` in the request body), with the official
`openai` client, on the embedded model. The answers parse and fit their schema, streamed or
not; and a spec that cannot be used is a 400 in OpenAI's shape before anything streams, after
which the server still answers with every KV block free.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pydantic
import pytest
from test_ch09_server import sse_events, wait_until_idle
from test_ch10_structured_outputs import PERSON, PHONE, is_person

from minivllm import SamplingParams, StructuredOutputsParams
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import BackgroundServer

PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
ASK_FOR_A_PERSON = [
    {"role": "user", "content": "Describe a person as JSON with a name and an age."}
]

pytestmark = pytest.mark.slow  # the embedded model


@pytest.fixture(scope="module")
def server():
    server = BackgroundServer(
        AsyncLLM.from_config(EngineConfig(max_model_len=512, kv_cache_memory_bytes=256 * 1024**2))
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


# --- answers of the asked form -------------------------------------------------------------------


def test_a_json_schema_answer_fits_the_schema_streamed_or_not(server, client, model):
    request = dict(
        model=model,
        messages=ASK_FOR_A_PERSON,
        response_format=PERSON_FORMAT,
        temperature=0.0,
        max_tokens=64,
    )
    answer = client.chat.completions.create(**request).choices[0]
    assert answer.finish_reason == "stop" and is_person(answer.message.content)
    body = {**request, "stream": True}
    events = sse_events(httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60))
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert streamed == answer.message.content


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_the_openai_client_parses_into_a_pydantic_model(client, model):
    """`parse` turns the model class into a strict json_schema and the answer back into it."""
    completion = client.chat.completions.parse(
        model=model,
        messages=ASK_FOR_A_PERSON,
        response_format=Person,
        temperature=1.0,
        seed=3,
        max_tokens=64,
    )
    assert isinstance(completion.choices[0].message.parsed, Person)


def test_json_object_gives_a_json_object(client, model):
    answer = client.chat.completions.create(
        model=model,
        messages=ASK_FOR_A_PERSON,
        response_format={"type": "json_object"},
        temperature=0.0,
        max_tokens=64,
    ).choices[0]
    assert answer.finish_reason == "stop"
    assert isinstance(json.loads(answer.message.content), dict)


def test_vllm_structured_outputs_choice_and_regex_in_completions(client, model):
    choices = ["positive", "negative"]
    review = "Review: the food was cold and the waiter was rude. Sentiment:"
    picked = client.completions.create(
        model=model,
        prompt=review,
        n=3,
        temperature=1.0,
        seed=0,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(c.text in choices and c.finish_reason == "stop" for c in picked.choices)
    phone = client.completions.create(
        model=model,
        prompt="Call me at",
        temperature=1.0,
        seed=0,
        extra_body={"structured_outputs": {"regex": PHONE}},
    ).choices[0]
    assert re.fullmatch(PHONE, phone.text), phone.text


# --- refused specs -------------------------------------------------------------------------------

COMPLETION = {"prompt": "Hi", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

BAD_SPECS = {
    "schema that is not one": (
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {
                **PERSON_FORMAT,
                "json_schema": {"name": "x", "schema": {"type": "objec"}},
            },
        },
        "structured_outputs.json is not valid",
    ),
    "unbalanced regex": (
        "/v1/completions",
        {**COMPLETION, "structured_outputs": {"regex": "(ab"}},
        "structured_outputs.regex is not valid",
    ),
    "grammar that does not parse": (
        "/v1/completions",
        {**COMPLETION, "structured_outputs": {"grammar": 'root ::= "a" |'}},
        "structured_outputs.grammar is not valid",
    ),
    "response_format and structured_outputs": (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "response_format must be text when structured_outputs is set",
    ),
    "two kinds in structured_outputs": (
        "/v1/completions",
        {**COMPLETION, "structured_outputs": {"regex": "a", "choice": ["a"]}},
        "exactly one of json, regex, choice, grammar, json_object",
    ),
    "json_schema without its schema": (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema"}},
        "needs a json_schema",
    ),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("case", BAD_SPECS, ids=list(BAD_SPECS))
def test_a_bad_spec_is_a_400_and_the_server_keeps_serving(server, client, model, case, stream):
    """Refused before a response starts, even a streamed one, and nothing is left behind."""
    path, body, message = BAD_SPECS[case]
    response = httpx.post(
        server.base_url + path, json={**body, "model": model, "stream": stream}, timeout=60
    )
    assert response.status_code == 400 and response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert message in error["message"], error["message"]
    assert client.completions.create(model=model, **COMPLETION).usage.completion_tokens >= 1
    wait_until_idle(server)


def test_the_openai_client_raises_bad_request(client, model):
    with pytest.raises(openai.BadRequestError, match="structured_outputs.regex is not valid"):
        client.completions.create(
            model=model, **COMPLETION, extra_body={"structured_outputs": {"regex": "[a-"}}
        )


def test_the_async_engine_refuses_a_bad_spec_before_queueing_it(server):
    """The check runs in AsyncLLM.add_request, on the caller's side, not on the engine thread."""
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab"))

    async def add():
        return server.engine.add_request("bad-regex", "Hi", params)

    with pytest.raises(ValueError, match="structured_outputs.regex is not valid"):
        asyncio.run(add())
    assert server.engine.num_open_requests == 0
