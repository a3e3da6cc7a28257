"""Chapter 09: the OpenAI-compatible server, checked through a real socket with the official
`openai` client: the same tokens as `LLM.generate`, streams that add up to the full answer, an
OpenAI-shaped error for every bad input (after which the server still answers), many clients at
once with some hanging up mid-stream and no KV block left behind, and metrics that count what
was sent."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import CHAT_MESSAGES, ENGINE_TEST_FAMILY, assert_pool_is_empty
from prometheus_client.parser import text_string_to_metric_families

from minivllm import LLM, SamplingParams
from minivllm.bench.serve import bench_serve
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import BackgroundServer, ServerSettings

MODEL = "tiny"
MAX_MODEL_LEN = 128
LONG_ANSWER = MAX_MODEL_LEN - 16  # max_tokens of requests that are meant to be cut short
ENGINE_SETTINGS = dict(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=4)


def start_server(model_dir, **settings) -> BackgroundServer:
    engine = AsyncLLM.from_config(EngineConfig(model=str(model_dir), **ENGINE_SETTINGS))
    return BackgroundServer(engine, ServerSettings(served_model_name=MODEL, **settings))


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
def tiny_llm(model_dir) -> LLM:
    return LLM(model=str(model_dir), **ENGINE_SETTINGS)


def wait_until_idle(server: BackgroundServer, timeout_s: float = 30.0) -> None:
    """Until the engine has nothing running or waiting (aborts land before the next step)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.engine.num_open_requests == 0 and server.engine.call_engine(is_idle):
            return
        time.sleep(0.05)
    raise AssertionError("the engine still has requests")


def is_idle(engine) -> bool:
    if engine.has_unfinished_requests():
        return False
    assert_pool_is_empty(engine)
    return True


def sse_events(response: httpx.Response) -> list[dict]:
    """The events of an OpenAI stream, checking the wire format: `data: ...` lines separated by
    blank lines, JSON chunks, and `[DONE]` last."""
    lines = response.text.split("\n")
    data = [line for line in lines if line]
    assert all(line.startswith("data: ") for line in data), data[:3]
    assert response.text.endswith("data: [DONE]\n\n")
    return [json.loads(line[len("data: ") :]) for line in data[:-1]]


# --- generation ----------------------------------------------------------------------------------


def test_greedy_completion_equals_llm_generate(client, tiny_llm):
    """Greedy text through HTTP is LLM.generate's text, token count for token count."""
    prompts = ["Hello there", "The capital of France is", "one two three four"]
    expected = tiny_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    response = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=12, temperature=0.0
    )
    assert response.object == "text_completion" and response.model == MODEL
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice, output in zip(response.choices, expected):
        assert choice.text == output.outputs[0].text
        assert choice.finish_reason == output.outputs[0].finish_reason
    assert response.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)


def test_token_id_prompt_and_logprobs(client, tiny_llm):
    ids = tiny_llm.get_tokenizer().encode("Hello there")
    response = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=5,
        temperature=0.0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for token_logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert token_logprob == pytest.approx(max(top.values()))
    assert "".join(logprobs.tokens) == response.choices[0].text


def test_stream_adds_up_to_the_full_answer(server, client):
    """A completion stream is well-formed, and its pieces join to the non-streamed text."""
    request = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.0)
    full = client.completions.create(**request)
    response = httpx.post(
        server.base_url + "/v1/completions",
        json={**request, "stream": True, "stream_options": {"include_usage": True}},
        timeout=60,
    )
    events = sse_events(response)
    usage = events.pop()
    assert usage["choices"] == [] and usage["usage"] == full.usage.model_dump(exclude_none=True)
    assert "".join(e["choices"][0]["text"] for e in events) == full.choices[0].text
    finish = [e["choices"][0]["finish_reason"] for e in events]
    assert finish[-1] == full.choices[0].finish_reason and not any(finish[:-1])


def test_chat_stream_and_n(client):
    """Chat with n = 2 and a seed: a role chunk, then content; each choice's stream joins to a
    complete answer of max_tokens tokens; the same seed gives the same answers."""
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_completion_tokens=10,
        n=2,
        seed=7,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    first = client.chat.completions.create(**request)
    again = client.chat.completions.create(**request)
    assert first.object == "chat.completion" and [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 20
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in first.choices)

    texts, roles = ["", ""], set()
    chunks = client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            roles.add(choice.delta.role)
            texts[choice.index] += choice.delta.content or ""
    assert "assistant" in roles and chunk.usage.completion_tokens == 20
    assert texts == [c.message.content for c in first.choices]


def test_stop_strings_cut_the_text(client):
    """A stop string ends the answer before it, streamed or not."""
    request = dict(model=MODEL, prompt="Hello there", max_tokens=16, temperature=0.0)
    text = client.completions.create(**request).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = client.completions.create(**request, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**request, stop=[stop], stream=True)
    )
    assert streamed == stopped.text


def test_models_and_tokenizer_routes(server, client, tiny_llm):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello there"}).json()
    assert tokens["tokens"] == tiny_llm.get_tokenizer().encode("Hello there")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello there"}


# --- errors --------------------------------------------------------------------------------------

COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

BAD_REQUESTS = {
    "malformed JSON": ("/v1/completions", b'{"prompt": "Hi",', 400, None),
    "wrong type": ("/v1/completions", {**COMPLETION, "max_tokens": "many"}, 400, "max_tokens"),
    "missing prompt": ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    "negative max_tokens": ("/v1/completions", {**COMPLETION, "max_tokens": -1}, 400, "max_tokens"),
    "huge max_tokens": ("/v1/completions", {**COMPLETION, "max_tokens": 10**6}, 400, None),
    "temperature < 0": ("/v1/completions", {**COMPLETION, "temperature": -0.5}, 400, "temperature"),
    "top_p = 0": ("/v1/completions", {**COMPLETION, "top_p": 0.0}, 400, "top_p"),
    "top_p > 1": ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p"),
    "n = 0": ("/v1/completions", {**COMPLETION, "n": 0}, 400, "n"),
    "n > 128": ("/v1/chat/completions", {**CHAT, "n": 466201}, 400, "n"),
    "empty prompt": ("/v1/completions", {**COMPLETION, "prompt": ""}, 400, None),
    "prompt longer than the context": (
        "/v1/completions",
        {**COMPLETION, "prompt": list(range(10, 10 + MAX_MODEL_LEN + 5))},
        400,
        None,
    ),
    "empty messages": ("/v1/chat/completions", {**CHAT, "messages": []}, 400, None),
    "message without role": (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"content": "x"}]},
        400,
        None,
    ),
    "unknown model": ("/v1/completions", {**COMPLETION, "model": "gpt-17"}, 404, "model"),
    "unknown route": ("/v1/nothing-here", {}, 404, None),
    "oversized body": ("/v1/completions", {**COMPLETION, "prompt": "x" * (2 << 20)}, 413, None),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_requests_get_openai_errors(server, client, case):
    path, body, status, param = BAD_REQUESTS[case]
    send = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(server.base_url + path, timeout=60, **send)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param and param in error["message"]
    # The server is still serving, and the failed request left nothing behind.
    assert client.completions.create(**COMPLETION).choices[0].text is not None
    wait_until_idle(server)


def test_the_openai_client_raises_on_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(**CHAT, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(**{**COMPLETION, "model": "nope"})


def test_a_full_waiting_queue_is_refused(server, client):
    server.engine.max_waiting_requests = 0
    try:
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(**COMPLETION)
        assert refused.value.status_code == 503 and "busy" in refused.value.message
    finally:
        server.engine.max_waiting_requests = 1024
    assert client.completions.create(**COMPLETION).choices


def test_api_key(model_dir):
    with start_server(model_dir, api_key="secret") as keyed:
        url = keyed.base_url
        assert httpx.get(url + "/health").status_code == 200  # open to load balancers
        assert httpx.get(url + "/v1/models").status_code == 401
        wrong = httpx.post(
            url + "/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer x"}
        )
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401
        good = openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0)
        assert good.completions.create(**COMPLETION).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).models.list()


# --- under load ----------------------------------------------------------------------------------


async def stream_client(base_url: str, index: int, hang_up: bool) -> tuple[list[dict], bool]:
    """One streaming client; one that hangs up does so after its second chunk, long before its
    request could finish by itself."""
    body = {
        "model": MODEL,
        "prompt": f"Request number {index} says",
        "max_tokens": LONG_ANSWER if hang_up else 12,
        "temperature": 0.8,
        "seed": index,
        "ignore_eos": index % 2 == 0,
        "stop": ["the"] if index % 3 == 0 else None,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events, done = [], False
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", base_url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line:
                    continue
                assert line.startswith("data: ")
                if line == "data: [DONE]":
                    done = True
                    break
                events.append(json.loads(line[len("data: ") :]))
                if hang_up and len(events) == 2:
                    break
    return events, done


def test_many_streaming_clients_some_hanging_up(server):
    """64 concurrent streams, a quarter closed mid-stream: every finished stream is complete
    and well-formed, the others were aborted, and afterwards no request runs and every KV block
    is free."""
    wait_until_idle(server)
    before = scrape(server)

    async def run_all():
        return await asyncio.gather(
            *(stream_client(server.base_url, i, hang_up=i % 4 == 3) for i in range(64))
        )

    results = asyncio.run(run_all())
    for index, (events, done) in enumerate(results):
        if index % 4 == 3:
            continue
        assert done, f"stream {index} did not end with [DONE]"
        usage = events.pop()["usage"]
        choices = [e["choices"][0] for e in events]
        assert choices[-1]["finish_reason"] in ("length", "stop")
        assert not any(c["finish_reason"] for c in choices[:-1])
        if choices[-1]["finish_reason"] == "length":
            assert usage["completion_tokens"] == 12
        else:
            assert usage["completion_tokens"] <= 12
    wait_until_idle(server)
    grown = growth(before, scrape(server))
    assert grown["vllm:request_success_total"] == 48
    assert grown["vllm:generation_tokens_total"] < 48 * 12 + 16 * LONG_ANSWER


def test_a_non_streaming_client_that_hangs_up_is_aborted(server):
    wait_until_idle(server)
    before = scrape(server)
    body = {**COMPLETION, "max_tokens": LONG_ANSWER, "n": 4, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=0.1)
    wait_until_idle(server)
    grown = growth(before, scrape(server))
    assert grown["vllm:request_success_total"] == 0
    assert grown["vllm:generation_tokens_total"] < 4 * LONG_ANSWER


# --- metrics and the serving benchmark -----------------------------------------------------------


def scrape(server) -> dict[str, float]:
    """Every sample of /metrics, summed over labels, by sample name."""
    text = httpx.get(server.base_url + "/metrics").text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def growth(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How much each sample grew (a labelled counter has no sample before its first count)."""
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def test_metrics_count_what_was_served(server, client):
    wait_until_idle(server)
    before = scrape(server)
    usages = [
        client.completions.create(model=MODEL, prompt=f"Count {i}", max_tokens=3 + i).usage
        for i in range(3)
    ]
    after = scrape(server)
    grown = growth(before, after)
    assert grown["vllm:request_success_total"] == 3
    assert grown["vllm:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert grown["vllm:generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    assert grown["vllm:time_to_first_token_seconds_count"] == 3
    assert grown["vllm:e2e_request_latency_seconds_count"] == 3
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"):
        assert name in after
    assert after["vllm:prefix_cache_queries_total"] >= after["vllm:prefix_cache_hits_total"]


def test_bench_serve_at_one_rate(server, tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    prompts = [tokenizer.encode(f"Benchmark prompt {i} about rivers") for i in range(6)]
    (result,) = bench_serve(server.base_url, [prompts], [8.0], max_tokens=6, max_seconds=60)
    assert result.num_sent == result.num_completed == 6 and not result.errors
    assert result.num_failed == 0
    assert result.output_throughput == pytest.approx(36 / result.duration_s)
    for latency in (result.ttft_ms, result.tpot_ms, result.itl_ms, result.e2e_ms):
        assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"]
    assert result.ttft_ms["p50"] <= result.e2e_ms["p50"]
    # Each request's 5 tokens after the first took TPOT each, after its TTFT: 5 TPOT <= E2E,
    # request by request, so percentile by percentile.
    for p in ("p50", "p90", "p99"):
        assert 5 * result.tpot_ms[p] <= result.e2e_ms[p] + 1e-9
    wait_until_idle(server)


# --- the embedded model --------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_model_chat_equals_llm_chat(embedded_dir):
    """The real model: a greedy chat answer over HTTP is LLM.chat's, and it is right."""
    messages = [{"role": "user", "content": CHAT_MESSAGES[1]}]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    llm = LLM(max_model_len=512, kv_cache_memory_bytes=256 * 1024**2)
    expected = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    expected_completion = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    del llm
    engine = AsyncLLM.from_config(
        EngineConfig(max_model_len=512, kv_cache_memory_bytes=256 * 1024**2)
    )
    with BackgroundServer(engine) as embedded:
        client = openai.OpenAI(base_url=embedded.base_url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(
            model=model, messages=messages, temperature=0.0, max_tokens=24
        ).choices[0]
        completion = client.completions.create(
            model=model, prompt="The capital of France is", temperature=0.0, max_tokens=24
        ).choices[0]
    assert answer.message.content == expected.text and "Paris" in answer.message.content
    assert answer.finish_reason == expected.finish_reason
    assert completion.text == expected_completion.outputs[0].text


def test_data_parallel_replicas_serve_behind_the_same_api(model_dir, tiny_llm):
    """Chapter 07's replicas plug in behind the server unchanged: two engine processes, one
    endpoint, concurrent requests spread over both, the same greedy text as one engine, and
    every block free afterwards."""
    config = EngineConfig(model=str(model_dir), data_parallel_size=2, **ENGINE_SETTINGS)
    prompts = [[5, 6, 7, 8], [100, 200, 300], [42] * 6, [7, 7, 9, 11, 13]] * 2
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    expected = [o.outputs[0].text for o in tiny_llm.generate(requests, params, use_tqdm=False)]
    engine = AsyncLLM.from_config(config)
    with BackgroundServer(engine, ServerSettings(served_model_name=MODEL)) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)

        def complete(prompt: list[int]) -> str:
            extra = {"ignore_eos": True}
            response = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0, extra_body=extra
            )
            return response.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts)) == expected
        per_replica = engine.get_replica_metrics()
        for metrics in per_replica:
            values = {m.name: m.value for m in metrics}
            assert values["vllm:prompt_tokens"] > 0, "a replica was never used"
            assert values["vllm:num_requests_running"] == 0
            assert values["vllm:kv_cache_usage_perc"] == 0


def test_bench_serve_stops_past_saturation_and_wants_prompts_per_rate(server, tiny_llm):
    """A rate at which too few requests complete ends the sweep: the later rates are not run;
    prompts come one list per rate (fresh prompts, no rate served from another's cache)."""
    tokenizer = tiny_llm.get_tokenizer()
    prompts = [[tokenizer.encode(f"Rate {rate} prompt {i}") for i in range(2)] for rate in (1, 2)]
    with pytest.raises(ValueError, match="one list of prompts per request rate"):
        bench_serve(server.base_url, prompts[:1], [8.0, 16.0], max_tokens=2)
    # Demanding more than every request: the first rate already counts as saturated.
    results = bench_serve(
        server.base_url, prompts, [8.0, 16.0], max_tokens=2, min_completed_share=1.5
    )
    assert [r.request_rate for r in results] == [8.0]
    assert results[0].num_completed == 2
    wait_until_idle(server)
