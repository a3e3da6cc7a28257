"""The server's wire behaviour where real clients depend on it, as vLLM's: a schema that
documents every body and error, OpenAI-shaped errors for everything (400 naming the field, 500
in JSON, an error event then `[DONE]` mid-stream), completions logprobs with the chosen token,
`echo` and prompt logprobs (lm-eval's loglikelihood), logit_bias, tool calling without a
parser, the model's generation_config defaults, and the official `openai` client on all of it.
Everything runs on a tiny random model; transformers is the oracle for the prompt logprobs.
"""

from __future__ import annotations

import json
import shutil
from typing import Literal

import httpx
import openai
import pydantic
import pytest
import torch
from conftest import ENGINE_TEST_FAMILY
from test_ch09_server import MODEL, sse_events, start_server, wait_until_idle

from minivllm.config import SpeculativeConfig
from minivllm.entrypoints.openai import api_server

COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
PROMPT_IDS = [5, 17, 300, 42, 1000, 77, 9, 250]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs[ENGINE_TEST_FAMILY]


@pytest.fixture(scope="module")
def server(model_dir):
    server = start_server(model_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def post(server, path: str, body, **options) -> httpx.Response:
    send = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(server.base_url + path, timeout=60, **send, **options)


def strict_json(text: str):
    """JSON as the standard has it: NaN and Infinity are refused."""

    def refuse(constant):
        raise AssertionError(f"{constant} in the response")

    return json.loads(text, parse_constant=refuse)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


def app_state(server):
    return server.server.config.app.state.server


def stream_lines(response: httpx.Response) -> list[str]:
    return [line for line in response.text.split("\n") if line]


# --- the schema ----------------------------------------------------------------------------------


def test_openapi_documents_every_body_and_error(server):
    spec = httpx.get(server.base_url + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        operation = spec["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].split("/")[-1] in schemas
        for status in ("400", "401", "404", "413", "500"):
            error = operation["responses"][status]["content"]["application/json"]["schema"]
            assert error["$ref"].endswith("/ErrorResponse")
        assert "422" not in operation["responses"]
    assert (
        "text/event-stream"
        in spec["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    )
    info = schemas["ErrorInfo"]["properties"]
    assert set(info) == {"message", "type", "param", "code"}
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "503" in spec["paths"]["/health"]["get"]["responses"]


def test_validation_errors_are_400_naming_the_field(server):
    error = assert_openai_error(
        post(server, "/v1/completions", {**COMPLETION, "temperature": "hot"}), 400, "temperature"
    )
    assert "temperature" in error["message"]
    assert_openai_error(post(server, "/v1/chat/completions", b"[1, 2]"), 400)
    assert_openai_error(post(server, "/detokenize", {"tokens": "abc"}), 400, "tokens")
    error = assert_openai_error(post(server, "/v1/completions", b'{"prompt": "Hi",'), 400)
    assert error["message"].startswith("Invalid JSON") and error["param"] is None


def test_a_body_without_content_type_is_read_as_json(server):
    assert post(server, "/v1/completions", json.dumps(COMPLETION).encode()).status_code == 200


def test_a_wrong_method_is_405_with_allow(server):
    response = httpx.get(server.base_url + "/v1/completions")
    assert_openai_error(response, 405)
    assert "POST" in response.headers["allow"]


# --- 500s in OpenAI's shape ----------------------------------------------------------------------


def test_an_unexpected_error_is_a_json_500(server, monkeypatch):
    completions = app_state(server).completions

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the server")

    monkeypatch.setattr(completions, "respond", broken)
    error = assert_openai_error(post(server, "/v1/completions", COMPLETION), 500)
    assert "a bug in the server" in error["message"]
    monkeypatch.setattr(completions, "start_request", broken)
    assert_openai_error(post(server, "/v1/completions", {**COMPLETION, "stream": True}), 500)
    monkeypatch.undo()
    wait_until_idle(server)
    assert post(server, "/v1/completions", COMPLETION).status_code == 200


def test_an_error_mid_stream_is_an_error_event_then_done(server, monkeypatch):
    completions = app_state(server).completions
    real_choice = completions.choice
    calls = []

    def fails_second_time(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("lost the detokenizer")
        return real_choice(*args, **kwargs)

    monkeypatch.setattr(completions, "choice", fails_second_time)
    body = {**COMPLETION, "max_tokens": 12, "ignore_eos": True, "stream": True}
    response = post(server, "/v1/completions", body)
    lines = stream_lines(response)
    assert response.status_code == 200 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: ") :])["error"]
    assert error["code"] == 500 and "lost the detokenizer" in error["message"]
    assert "choices" in json.loads(lines[0][len("data: ") :])  # the first chunk went out
    monkeypatch.undo()
    wait_until_idle(server)


class FailingStream:
    """An engine stream whose request ends with finish_reason "error", as the engine reports
    a request it had to stop (a grammar that rejected the sampled token, say)."""

    def __init__(self, stream):
        self.stream = stream

    def __aiter__(self):
        return self

    async def __anext__(self):
        output = await self.stream.__anext__()
        if output.finished:
            for completion in output.outputs:
                completion.finish_reason = "error"
                completion.error = "the grammar rejected token 0"
        return output

    def close(self) -> None:
        self.stream.close()


def test_a_request_the_engine_failed_is_a_500_and_the_server_keeps_serving(server, monkeypatch):
    add_request = server.engine.add_request
    monkeypatch.setattr(
        server.engine, "add_request", lambda *a, **k: FailingStream(add_request(*a, **k))
    )
    error = assert_openai_error(post(server, "/v1/chat/completions", CHAT), 500)
    assert "the grammar rejected token 0" in error["message"]
    response = post(server, "/v1/completions", {**COMPLETION, "stream": True})
    lines = stream_lines(response)
    assert lines[-1] == "data: [DONE]"
    assert "the grammar rejected token 0" in json.loads(lines[-2][6:])["error"]["message"]
    monkeypatch.undo()
    wait_until_idle(server)
    assert post(server, "/v1/completions", COMPLETION).status_code == 200


# --- values that were 500s -----------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [[-1], [-(2**37)], [2**64], [10**8], [3, 49152]])
def test_detokenize_refuses_ids_outside_the_vocabulary(server, tokens):
    assert_openai_error(post(server, "/detokenize", {"tokens": tokens}), 400, "tokens")


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_seed_outside_int64_is_a_400(server, seed, path, stream):
    body = {**(COMPLETION if path == "/v1/completions" else CHAT), "seed": seed, "stream": stream}
    assert_openai_error(post(server, path, body), 400, "seed")


@pytest.mark.parametrize("penalty", [5e-324, 1e-40])
def test_a_tiny_repetition_penalty_with_logprobs_is_never_a_500(server, penalty):
    bodies = [
        ("/v1/completions", {**COMPLETION, "logprobs": 2}),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}),
        ("/v1/completions", {**COMPLETION, "logprobs": 2, "stream": True}),
    ]
    for path, body in bodies:
        response = post(server, path, {**body, "repetition_penalty": penalty, "prompt": "0 0 0"})
        assert response.status_code in (200, 400), response.text
        if body.get("stream"):
            for line in stream_lines(response)[:-1]:
                strict_json(line[len("data: ") :])
        else:
            strict_json(response.text)
    wait_until_idle(server)


# --- logprobs ------------------------------------------------------------------------------------


def test_completion_top_logprobs_include_the_sampled_token(client):
    """OpenAI's and vLLM's format: the chosen token and the `logprobs` best ones."""
    response = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=12,
        temperature=1.5,
        seed=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    logprobs = response.choices[0].logprobs
    for token, token_logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs
    ):
        assert token in top and top[token] == pytest.approx(token_logprob)
        assert 1 <= len(top) <= 3


def test_chat_top_logprobs_are_only_the_most_likely(client):
    response = client.chat.completions.create(
        **{**CHAT, "max_tokens": 8},
        temperature=1.5,
        seed=0,
        logprobs=True,
        top_logprobs=2,
    )
    for entry in response.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


# --- fields that used to be ignored --------------------------------------------------------------

REFUSED = {
    "suffix": ("/v1/completions", {**COMPLETION, "suffix": "end"}, "suffix"),
    "best_of > n": ("/v1/completions", {**COMPLETION, "best_of": 2}, "best_of"),
    "functions": (
        "/v1/chat/completions",
        {**CHAT, "functions": [WEATHER["function"]]},
        "functions",
    ),
    "function_call": ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
    "audio output": ("/v1/chat/completions", {**CHAT, "modalities": ["audio"]}, "modalities"),
    "tool_choice auto": (
        "/v1/chat/completions",
        {**CHAT, "tools": [WEATHER], "tool_choice": "auto"},
        "tool_choice",
    ),
    "tools without tool_choice": (
        "/v1/chat/completions",
        {**CHAT, "tools": [WEATHER]},
        "tool_choice",
    ),
    "tool_choice without tools": (
        "/v1/chat/completions",
        {**CHAT, "tool_choice": "required"},
        "tool_choice",
    ),
    "unknown named tool": (
        "/v1/chat/completions",
        {
            **CHAT,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        "tool_choice",
    ),
    "tool_choice and response_format": (
        "/v1/chat/completions",
        {
            **CHAT,
            "tools": [WEATHER],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "tool_choice",
    ),
    "logit_bias key not an id": (
        "/v1/completions",
        {**COMPLETION, "logit_bias": {"hello": 1}},
        "logit_bias",
    ),
    "logit_bias id outside the vocabulary": (
        "/v1/completions",
        {**COMPLETION, "logit_bias": {"1000000": 1}},
        "logit_bias",
    ),
    "prompt_logprobs in a stream": (
        "/v1/chat/completions",
        {**CHAT, "prompt_logprobs": 1, "stream": True},
        "prompt_logprobs",
    ),
    "a template option that replaces an argument": (
        "/v1/chat/completions",
        {**CHAT, "chat_template_kwargs": {"tokenize": False}},
        "chat_template_kwargs",
    ),
    "stream_options without stream": (
        "/v1/completions",
        {**COMPLETION, "stream_options": {"include_usage": True}},
        "stream_options",
    ),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_a_field_minivllm_does_not_support_is_a_400_naming_it(server, case):
    path, body, param = REFUSED[case]
    assert_openai_error(post(server, path, body), 400, param)


def test_vllm_messages_for_auto_tool_choice_and_stream_options(server):
    body = {**CHAT, "tools": [WEATHER], "tool_choice": "auto"}
    error = assert_openai_error(post(server, "/v1/chat/completions", body), 400)
    assert error["message"] == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )
    body = {**CHAT, "stream_options": {"include_usage": True}}
    error = assert_openai_error(post(server, "/v1/chat/completions", body), 400)
    assert error["message"] == "Stream options can only be defined when `stream=True`."


def test_best_of_equal_to_n_is_accepted(server):
    assert post(server, "/v1/completions", {**COMPLETION, "best_of": 2, "n": 2}).status_code == 200


def test_logit_bias_steers_the_answer(client):
    """+100 on one token makes greedy decoding choose it every time; a bias beyond OpenAI's
    range is clamped to it, not refused."""
    favourite = 1234
    for bias in (100, 1e6):
        response = client.completions.create(
            model=MODEL,
            prompt=PROMPT_IDS,
            max_tokens=4,
            temperature=0.0,
            logprobs=0,
            logit_bias={str(favourite): bias},
            extra_body={"ignore_eos": True},
        )
        tokens = response.choices[0].logprobs.tokens
        unbiased = client.completions.create(
            model=MODEL, prompt=PROMPT_IDS, max_tokens=4, temperature=0.0, logprobs=0
        )
        assert unbiased.choices[0].logprobs.tokens != tokens
        assert tokens == [client_decode(client, favourite)] * 4


def client_decode(client, token_id: int) -> str:
    url = str(client.base_url).removesuffix("/v1/")
    return httpx.post(url + "/detokenize", json={"tokens": [token_id]}).json()["prompt"]


# --- tools ---------------------------------------------------------------------------------------


def test_tool_choice_required_returns_tool_calls(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris, and the time?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0.0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and not choice.message.content
    for call in calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert arguments["city"] in ("Paris", "Rome") and arguments["unit"] in ("C", "F")
        else:
            assert call.function.name == "get_time" and arguments["zone"] in ("UTC", "CET")


class Place(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]


class Trip(pydantic.BaseModel):
    destination: Place
    nights: Literal[1, 2, 3]


def test_a_tool_made_from_nested_pydantic_models_is_called(client):
    """Nested models put "$defs" in the tool's parameters; the "required" array schema keeps
    their references resolvable."""
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Plan a trip"}],
        tools=[openai.pydantic_function_tool(Trip)],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0.0,
    )
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "Trip"
    Trip.model_validate_json(call.function.arguments)


def test_a_named_tool_choice_calls_that_function(server, client):
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=48,
        temperature=0.0,
    )
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "stop"  # vLLM and OpenAI: a named call ends with "stop"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    events = sse_events(post(server, "/v1/chat/completions", {**request, "stream": True}))
    streamed = [c for e in events for c in e["choices"] if c["delta"].get("tool_calls")]
    (last,) = streamed
    (delta,) = last["delta"]["tool_calls"]
    assert delta["function"] == call.function.model_dump()
    assert delta["id"].startswith("chatcmpl-tool-") and last["finish_reason"] == "stop"


def test_a_tool_conversation_round_trips(client):
    """The assistant's tool call and the tool's answer go back into the template."""
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "chatcmpl-tool-1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Rome", "unit": "C"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "21 C"},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=4
    )
    assert response.choices[0].message.tool_calls in (None, [])


TOOL_TEMPLATE = (
    "{% if greeting %}{{ greeting }}\n{% endif %}"
    "{% if tools %}{% for tool in tools %}TOOL {{ tool.function.name }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_tools_and_template_options_reach_the_chat_template(server, client):
    tokenizer = server.engine.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = TOOL_TEMPLATE
    try:
        plain = client.chat.completions.create(**CHAT).usage.prompt_tokens
        with_tools = client.chat.completions.create(
            **CHAT, tools=[WEATHER, TIME], tool_choice="none"
        ).usage.prompt_tokens
        greeted = client.chat.completions.create(
            **CHAT, extra_body={"chat_template_kwargs": {"greeting": "Good morning"}}
        ).usage.prompt_tokens
    finally:
        tokenizer.chat_template = original
    tool_lines = len(tokenizer.encode("TOOL get_weather\nTOOL get_time\n"))
    assert with_tools == plain + tool_lines
    assert greeted == plain + len(tokenizer.encode("Good morning\n"))


# --- echo and prompt logprobs --------------------------------------------------------------------


def reference_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `ids`."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_echo_returns_the_prompt_and_its_logprobs(server, client, hf_model):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=2, temperature=0.0, logprobs=1, echo=True
    )
    choice = response.choices[0]
    prompt_text = client_detokenize(server, PROMPT_IDS)
    generated = client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=2, temperature=0.0
    ).choices[0]
    assert choice.text == prompt_text + generated.text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(PROMPT_IDS) + 2
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = reference_logprobs(hf_model, PROMPT_IDS)
    for i in range(1, len(PROMPT_IDS)):
        expected = reference[i - 1, PROMPT_IDS[i]].item()
        assert logprobs.token_logprobs[i] == pytest.approx(expected, abs=1e-4)
        assert 1 <= len(logprobs.top_logprobs[i]) <= 2
    assert logprobs.text_offset[len(PROMPT_IDS)] == len(prompt_text)
    streamed = sse_events(
        post(
            server,
            "/v1/completions",
            {
                **COMPLETION,
                "prompt": PROMPT_IDS,
                "max_tokens": 2,
                "temperature": 0.0,
                "echo": True,
                "stream": True,
            },
        )
    )
    assert "".join(e["choices"][0]["text"] for e in streamed) == choice.text


def client_detokenize(server, ids: list[int]) -> str:
    return post(server, "/detokenize", {"tokens": ids}).json()["prompt"]


def test_echo_with_max_tokens_zero_returns_only_the_prompt(server, client):
    response = client.completions.create(
        model=MODEL, prompt="Hello there my friend", max_tokens=0, echo=True, logprobs=0
    )
    choice = response.choices[0]
    assert choice.text == "Hello there my friend"
    prompt_ids = post(server, "/tokenize", {"prompt": "Hello there my friend"}).json()["tokens"]
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    assert "".join(choice.logprobs.tokens) == choice.text


def test_lm_eval_loglikelihood_request(server, hf_model):
    """lm-eval's `local-completions` loglikelihood payload, and its parse of the answer: the
    continuation's logprobs sum to transformers' (it used to read 0 from a 1-token list)."""
    context, continuation = PROMPT_IDS[:5], PROMPT_IDS[5:]
    body = {
        "model": MODEL,
        "prompt": context + continuation,
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
        "temperature": 0,
    }
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    token_logprobs = choice["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == len(PROMPT_IDS) + 1
    score = sum(token_logprobs[len(context) : -1])
    reference = reference_logprobs(hf_model, PROMPT_IDS)
    expected = sum(reference[i - 1, PROMPT_IDS[i]].item() for i in range(5, len(PROMPT_IDS)))
    assert score == pytest.approx(expected, abs=1e-3)


def test_prompt_logprobs_on_both_endpoints(server, hf_model):
    body = {**COMPLETION, "prompt": PROMPT_IDS, "prompt_logprobs": 2}
    entries = post(server, "/v1/completions", body).json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(PROMPT_IDS) and entries[0] is None
    reference = reference_logprobs(hf_model, PROMPT_IDS)
    for i in range(1, len(PROMPT_IDS)):
        chosen = entries[i][str(PROMPT_IDS[i])]
        assert chosen["logprob"] == pytest.approx(reference[i - 1, PROMPT_IDS[i]].item(), abs=1e-4)
        assert len(entries[i]) <= 3
    chat = post(server, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 0}).json()
    prompt_tokens = chat["usage"]["prompt_tokens"]
    assert len(chat["prompt_logprobs"]) == prompt_tokens and chat["prompt_logprobs"][0] is None


# --- streams -------------------------------------------------------------------------------------


def test_chat_stream_sends_one_role_chunk_per_choice(server):
    body = {**CHAT, "n": 2, "stream": True, "max_tokens": 3}
    events = sse_events(post(server, "/v1/chat/completions", body))
    roles = [e for e in events if any(c["delta"].get("role") for c in e["choices"])]
    assert [[c["index"] for c in e["choices"]] for e in roles] == [[0], [1]]


def test_include_usage_with_the_openai_client(client):
    for stream in (
        client.completions.create(
            **COMPLETION, stream=True, stream_options={"include_usage": True}
        ),
        client.chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True}),
    ):
        chunks = list(stream)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
        assert all(chunk.usage is None for chunk in chunks[:-1])


class Verdict(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


def test_the_openai_client_parses_into_a_pydantic_model(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    completion = parse(
        model=MODEL,
        messages=CHAT["messages"],
        response_format=Verdict,
        max_tokens=48,
        temperature=0,
    )
    assert isinstance(completion.choices[0].message.parsed, Verdict)


# --- the model's generation defaults -------------------------------------------------------------


@pytest.fixture(scope="module")
def generation_config_dir(model_dir, tmp_path_factory):
    """The tiny model with a generation_config.json that asks for greedy decoding (top_k 1)
    and 3 new tokens."""
    path = tmp_path_factory.mktemp("with-generation-config") / "model"
    shutil.copytree(model_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 3}))
    return path


def test_generation_config_fills_the_fields_a_request_leaves_out(generation_config_dir):
    request = {
        "model": MODEL,
        "prompt": PROMPT_IDS,
        "temperature": 1.0,
        "seed": 3,
        "ignore_eos": True,
    }
    with start_server(generation_config_dir) as auto:
        defaulted = post(auto, "/v1/completions", request).json()
        greedy = post(auto, "/v1/completions", {**request, "temperature": 0.0}).json()
        explicit = post(auto, "/v1/completions", {**request, "max_tokens": 5, "top_k": 0}).json()
    assert defaulted["usage"]["completion_tokens"] == 3
    assert defaulted["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert explicit["usage"]["completion_tokens"] == 5
    with start_server(generation_config_dir, generation_config="vllm") as plain:
        ignored = post(plain, "/v1/completions", request).json()
    assert ignored["usage"]["completion_tokens"] == 16  # the completions default


def test_generation_config_from_a_folder(generation_config_dir, model_dir):
    assert api_server.sampling_defaults(str(generation_config_dir), model_dir) == {
        "top_k": 1,
        "max_tokens": 3,
    }
    assert api_server.sampling_defaults("auto", model_dir) == {}
    with pytest.raises(ValueError, match="generation_config"):
        api_server.sampling_defaults(str(model_dir / "nowhere"), model_dir)


# --- n-gram speculation defaults -----------------------------------------------------------------


def test_ngram_lookup_defaults_follow_vllm():
    default = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 5})
    assert (default.prompt_lookup_min, default.prompt_lookup_max) == (5, 5)
    only_min = SpeculativeConfig.from_value(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 5}
    )
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.from_value({"method": "ngram", "prompt_lookup_max": 3})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
