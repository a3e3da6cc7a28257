"""The served `/openapi.json` says exactly what the server takes, checked by fuzzing it.

schemathesis reads the schema as the app serves it and sends, to every operation, requests
the schema allows and requests it forbids (wrong types, values out of range, missing fields),
all through the ASGI app itself (no socket), with all its default checks: no 5xx, only the
statuses and content types the schema documents, bodies that fit it, forbidden requests
refused and allowed ones accepted. Every error is OpenAI's JSON, and after every request the
engine has nothing running and every KV block back in its pool.

One check is narrowed, not dropped: a JSON schema states each field's type and bounds, not the
rules that tie fields together or that depend on what a field holds once read (a prompt too
long for the context once tokenized, a regex that does not compile). An allowed request that
breaks one of those (`SCHEMALESS_RULES`) may be a 400; the message must name the rule.

The rest checks what the fuzz cannot see from outside: the bounds the schema declares are the
ones SamplingParams enforces, the vocabulary bound of logit_bias's keys, and the schema itself
is valid OpenAPI.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import schemathesis
from conftest import ENGINE_TEST_FAMILY
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate
from schemathesis.config import SchemathesisConfig
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi.checks import positive_data_acceptance
from test_ch09_server import ENGINE_SETTINGS, MODEL, wait_until_idle

from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import ServerSettings, build_app
from minivllm.entrypoints.openai.protocol import SamplingRequest
from minivllm.sample.sampling_params import SamplingParams

# What an allowed request may still be refused for: rules between fields, or on what a field
# holds, that a JSON schema does not state. Each is the start of the message that names it.
SCHEMALESS_RULES = [
    # the prompt, once tokenized, against the context
    r"the prompt is \d+ tokens long, but the model's context",
    r"max_tokens=\d+ does not fit",
    # a field that needs another
    r"max_tokens must be >= 1, got 0",  # 0 only with echo
    r"min_tokens must be <= max_tokens",
    r"best_of must equal n",
    r"Stream options can only be defined when `stream=True`",
    r"`prompt_logprobs` are not available when `stream=True`",
    r"top_logprobs needs logprobs=true",
    r"response_format must be text when structured_outputs is set",
    r"tool_choice required or a named function cannot be combined",
    r"When using `tool_choice`, `tools` must be set",
    r"\"auto\" tool choice requires",  # tools given, tool_choice left to its default
    r"Tool '.*' has not been passed in `tools`",
    # what a string holds
    r"structured_outputs\.\w+ is not valid",
    r"structured_outputs\.grammar matches no finite string",
    r"tool call arguments must be a JSON object",
]
SCHEMALESS = re.compile("|".join(f"(?:{rule})" for rule in SCHEMALESS_RULES))


# A short context: a chat request without max_tokens generates to its end.
FUZZ_ENGINE_SETTINGS = {**ENGINE_SETTINGS, "max_model_len": 64}
# The examples phase (the schema's own examples) and a bounded fuzzing phase; the coverage
# phase, which sends a case per keyword of the schema (over a thousand here), is left out.
FUZZ_CONFIG = SchemathesisConfig.from_dict({"phases": {"coverage": {"enabled": False}}})


@dataclass
class ServedApp:
    """The app over its engine (the engine in a thread of this process), with no socket."""

    engine: AsyncLLM
    app: FastAPI


@contextmanager
def served_app(model_dir, **engine_settings) -> Iterator[ServedApp]:
    config = EngineConfig(model=str(model_dir), **engine_settings)
    engine = AsyncLLM.from_config(config, multiprocess=False)
    try:
        yield ServedApp(engine, build_app(engine, ServerSettings(served_model_name=MODEL)))
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def served(tiny_model_dirs):
    with served_app(tiny_model_dirs[ENGINE_TEST_FAMILY], **FUZZ_ENGINE_SETTINGS) as served:
        yield served


@pytest.fixture
def fuzzed(tiny_model_dirs):
    """An app of its own for the fuzz test (its operations run one after another on it): the
    engine's random draws (requests without a seed) start from its seed, whichever tests ran
    before on this worker, so a failure comes back on every run."""
    with served_app(tiny_model_dirs[ENGINE_TEST_FAMILY], **FUZZ_ENGINE_SETTINGS) as fuzzed:
        yield fuzzed


@pytest.fixture
def fuzzed_schema(fuzzed):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzzed.app, config=FUZZ_CONFIG)


def accepts_what_the_schema_allows(ctx, response, case):
    """schemathesis' positive_data_acceptance, except for a 400 that names a SCHEMALESS_RULE."""
    try:
        return positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        if response.status_code == 400 and SCHEMALESS.search(error_of(response)["message"]):
            return None
        raise


def error_of(response) -> dict:
    """The OpenAI error a response holds: {"message", "type", "param", "code"}."""
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == response.status_code and error["message"], error
    return error


@pytest.fixture(autouse=True)
def node_id_for_schemathesis(request):
    """schemathesis 4.32's from_fixture reads and renames a test through pytest's private
    `Node._nodeid`, which pytest 9.2 no longer has: give it one to read."""
    request.node._nodeid = request.node.nodeid


schema = schemathesis.pytest.from_fixture("fuzzed_schema")


@schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_served_schema_is_what_the_server_takes(case, fuzzed):
    response = case.call_and_validate(
        excluded_checks=[positive_data_acceptance],
        additional_checks=[accepts_what_the_schema_allows],
    )
    if response.status_code >= 400:
        error_of(response)
    wait_until_idle(fuzzed)  # nothing running, every KV block free


def test_the_schema_is_valid_openapi(served):
    validate(TestClient(served.app).get("/openapi.json").json())


# --- the cases clients found --------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
REFUSED = {
    "a boolean token id": ("/detokenize", {"tokens": [False]}, "tokens"),
    "a fractional token id": ("/detokenize", {"tokens": [1.5]}, "tokens"),
    "boolean prompt ids": ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    "boolean ids in a batch": ("/v1/completions", {"prompt": [[False]]}, "prompt"),
    "a boolean count": ("/v1/completions", {"prompt": "Hi", "n": True}, "n"),
    "logprobs past 20": ("/v1/completions", {"prompt": "Hi", "logprobs": 50}, "logprobs"),
    "top_logprobs past 20": (
        "/v1/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    "functions, even empty": ("/v1/chat/completions", {**CHAT, "functions": []}, "functions"),
    "suffix, even empty": ("/v1/completions", {"prompt": "Hi", "suffix": ""}, "suffix"),
    "no messages": ("/tokenize", {"messages": []}, "messages"),
    "an empty role": ("/v1/chat/completions", {**CHAT, "messages": [{"role": ""}]}, "messages"),
    "a logit_bias key with a sign": (
        "/v1/completions",
        {"prompt": "Hi", "logit_bias": {"+5": 1}},
        "logit_bias",
    ),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_what_the_schema_forbids_is_a_400_naming_the_field(served, case):
    path, body, param = REFUSED[case]
    response = TestClient(served.app).post(path, json=body)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param


def test_the_schema_declares_the_bounds_the_server_enforces(served):
    spec = TestClient(served.app).get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    vocab_size = served.engine.client.processor.vocab_size
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] == {
        "type": "integer",
        "minimum": 0,
        "maximum": vocab_size - 1,
    }
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["minItems"] == 1
    assert chat["functions"]["type"] == "null"
    assert chat["top_logprobs"]["anyOf"][0]["maximum"] == 20
    assert "auto" not in chat["tool_choice"]["anyOf"][0]["enum"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["suffix"]["type"] == "null"
    bias_keys = completion["logit_bias"]["anyOf"][0]["propertyNames"]["pattern"]
    assert re.fullmatch(bias_keys, str(vocab_size - 1))
    assert not re.fullmatch(bias_keys, str(vocab_size))


def test_an_integral_float_is_the_integer_it_spells(served):
    """JSON Schema's "integer" takes 1.0, so the server does too (and refuses 1.5)."""
    client = TestClient(served.app)
    assert (
        client.post("/detokenize", json={"tokens": [1.0]}).json()
        == client.post("/detokenize", json={"tokens": [1]}).json()
    )
    wait_until_idle(served)


# --- grammars that match nothing ----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("grammar", ["root ::= root", 'root ::= "a" root'])
def test_an_unsatisfiable_grammar_is_a_400_before_the_stream(served, grammar, stream):
    """It used to be a 200 whose stream ended in a 500 error event ("no token can be
    sampled"), or text until max_tokens."""
    body = {"prompt": "Hi", "max_tokens": 8, "stream": stream}
    response = TestClient(served.app).post(
        "/v1/completions", json={**body, "structured_outputs": {"grammar": grammar}}
    )
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    assert "matches no finite string" in error_of(response)["message"]
    wait_until_idle(served)


# --- what the fuzz cannot see from outside -------------------------------------------------------


def numeric_bounds(field: str) -> tuple[dict, type]:
    """The bounds SamplingRequest's schema declares on a number field, and its type."""
    declared = SamplingRequest.model_json_schema()["properties"][field]
    numeric = next(
        option
        for option in declared.get("anyOf", [declared])
        if option.get("type") in ("integer", "number")
    )
    return numeric, int if numeric["type"] == "integer" else float


# The bounds that are SamplingParams' (n's and the logprobs' caps are the server's own).
FROM_SAMPLING_PARAMS = ["temperature", "top_p", "top_k", "min_p", "presence_penalty"]
FROM_SAMPLING_PARAMS += ["frequency_penalty", "repetition_penalty", "min_tokens"]
# keyword -> (steps from the bound to a value it allows, to one it refuses)
BOUND_KEYWORDS = {
    "minimum": (0, -1),
    "maximum": (0, 1),
    "exclusiveMinimum": (1, 0),
    "exclusiveMaximum": (-1, 0),
}


@pytest.mark.parametrize("field", FROM_SAMPLING_PARAMS)
def test_declared_bounds_are_those_of_sampling_params(field):
    """At each bound the schema declares, SamplingParams takes the last value inside and
    refuses the first one outside."""
    bounds, kind = numeric_bounds(field)
    step = 1 if kind is int else 1e-9
    declared = {keyword: bounds[keyword] for keyword in BOUND_KEYWORDS if keyword in bounds}
    assert declared, bounds
    for keyword, bound in declared.items():
        inside, outside = BOUND_KEYWORDS[keyword]
        SamplingParams(**{field: kind(bound + inside * step)})
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: kind(bound + outside * step)})


@pytest.mark.parametrize("limit", [1, 2, 10, 20, 101, 49152])
@given(number=st.one_of(st.integers(0, 10**5), st.integers(0, 10**12)))
def test_integers_below_matches_exactly_the_ids_below_the_limit(limit, number):
    """logit_bias's keys in the schema: the decimal ids below the limit, and no other way to
    write a number (a leading zero, a sign)."""
    from minivllm.entrypoints.openai.protocol import integers_below

    pattern = re.compile(integers_below(limit))
    assert bool(pattern.fullmatch(str(number))) == (number < limit)
    for other_spelling in ("0" + str(number), "+" + str(number), str(number) + ".0"):
        assert not pattern.fullmatch(other_spelling)
