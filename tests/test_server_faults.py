"""The server when things go wrong around it: its engine core killed under load, clients that
hang up mid-stream, and hours of both.

- The engine core process killed (SIGKILL) while streams are open: every open request ends
  with an error (an error event and `[DONE]` in a stream, a 503 otherwise), `/health` answers
  503 at once, new requests are refused, and `minivllm serve` exits non-zero, as vLLM's server
  does, so that a supervisor restarts it (it used to answer 503 for ever).
- 64 streams at once, half of them cut by their client: afterwards nothing runs, every KV
  block is back in the pool, and /metrics says so.
- The soak test (MINIVLLM_SOAK=1 to run it; `slow`): minutes of Poisson arrivals, a third of
  the streams cut at a random point, some plain requests abandoned; after warm-up and at the
  end every block is free and resident memory has not grown.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import psutil
import pytest
from conftest import ENGINE_TEST_FAMILY
from test_ch09_server import (
    ENGINE_SETTINGS,
    MODEL,
    scrape,
    start_server,
    stream_client,
    wait_until_idle,
)

from minivllm.bench.serve import ServerProcess
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import BackgroundServer, ServerSettings

# Room for answers long enough to still be running when the core is killed.
LONG_CONTEXT = 512
LONG_ANSWER = 480


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs[ENGINE_TEST_FAMILY]


def start_tiny_server(model_dir, **engine_settings) -> BackgroundServer:
    """test_ch09_server's server, with some of its engine settings changed."""
    config = EngineConfig(model=str(model_dir), **{**ENGINE_SETTINGS, **engine_settings})
    return BackgroundServer(AsyncLLM.from_config(config), ServerSettings(served_model_name=MODEL))


def long_request(index: int, stream: bool) -> dict:
    return {
        "model": MODEL,
        "prompt": f"Request {index} goes on and on",
        "max_tokens": LONG_ANSWER,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": index,
        "stream": stream,
    }


async def open_stream(http: httpx.AsyncClient, base_url: str, body: dict, started: asyncio.Event):
    """A stream's events until [DONE], `started` set once its first chunk arrived; True if
    it ended with [DONE]."""
    events, done = [], False
    async with http.stream("POST", base_url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                done = True
                break
            events.append(json.loads(line.removeprefix("data: ")))
            started.set()
    return events, done


async def kill_under_load(base_url: str, core_pid: int, num_streams: int = 6):
    """Open streams and plain requests, kill the core once every stream has a chunk: the
    streams' events, the plain responses, and how long /health took to answer 503."""
    async with httpx.AsyncClient(timeout=120) as http:
        started = [asyncio.Event() for _ in range(num_streams)]
        streams = [
            asyncio.create_task(open_stream(http, base_url, long_request(i, True), started[i]))
            for i in range(num_streams)
        ]
        plain = [
            asyncio.create_task(
                http.post(base_url + "/v1/completions", json=long_request(100 + i, False))
            )
            for i in range(2)
        ]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
        os.kill(core_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while (await http.get(base_url + "/health")).status_code != 503:
            await asyncio.sleep(0.05)
        health_s = time.monotonic() - killed_at
        return await asyncio.gather(*streams), await asyncio.gather(*plain), health_s


def assert_every_request_failed(stream_results, plain_responses) -> None:
    for events, done in stream_results:
        assert done, "a stream was left open"
        error = events[-1]["error"]
        assert error["code"] == 503 and "engine" in error["message"], error
        assert all("choices" in event for event in events[:-1])
    for response in plain_responses:
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == 503


def test_a_killed_engine_core_fails_every_open_request(model_dir):
    server = start_tiny_server(model_dir, max_model_len=LONG_CONTEXT)
    try:
        (core,) = server.engine.client.cores
        streams, plain, health_s = asyncio.run(kill_under_load(server.base_url, core.process.pid))
        assert_every_request_failed(streams, plain)
        assert health_s < 5
        refused = httpx.post(server.base_url + "/v1/completions", json=long_request(0, False))
        assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
    finally:
        server.stop()  # a dead core still shuts down cleanly


def test_minivllm_serve_exits_when_its_engine_core_dies(model_dir):
    """As vLLM's server: exit non-zero, for a supervisor to restart it, once the open
    requests have been told."""
    arguments = ["--model", model_dir, "--served-model-name", MODEL]
    arguments += ["--device", "cpu", "--dtype", "float32", "--block-size", "4"]
    arguments += ["--max-model-len", LONG_CONTEXT]
    server = ServerProcess(arguments)
    try:
        (core,) = [
            child
            for child in psutil.Process(server.process.pid).children()
            if "spawn_main" in " ".join(child.cmdline())
        ]
        streams, plain, health_s = asyncio.run(kill_under_load(server.base_url, core.pid))
        assert_every_request_failed(streams, plain)
        assert server.process.wait(timeout=60) == 1
        server.log.seek(0)
        assert "error: the engine stopped" in server.log.read()
    finally:
        server.stop()


def test_half_of_64_streams_cut_leave_nothing_behind(model_dir):
    server = start_server(model_dir)
    try:

        async def run_all():
            return await asyncio.gather(
                *(stream_client(server.base_url, i, hang_up=i % 2 == 1) for i in range(64))
            )

        results = asyncio.run(run_all())
        for index, (events, done) in enumerate(results):
            if index % 2 == 0:
                assert done and events[-1]["usage"]["completion_tokens"] <= 12
        wait_until_idle(server)
        metrics = scrape(server)
        assert metrics["vllm:num_requests_running"] == 0
        assert metrics["vllm:num_requests_waiting"] == 0
        assert metrics["vllm:kv_cache_usage_perc"] == 0
    finally:
        server.stop()


# --- the soak test -------------------------------------------------------------------------------

SOAK_SECONDS = float(os.environ.get("MINIVLLM_SOAK_SECONDS", 180))
WARM_UP_SECONDS = 60
REQUEST_RATE = 6.0  # per second
# Resident memory may move by allocator noise, not grow with the number of requests served
# (measured: 5-10 MiB over three minutes after warm-up, no Python object added).
RSS_SLACK_BYTES = 32 * 2**20
# The KV pool is mapped at start and its pages become resident when first written: a pool of
# the default size (2 GiB here) would grow the core's resident memory for hours without a
# leak. A pool of 1,024 blocks (32 sequences of the whole context) is all written during the
# warm-up, so that what grows after it is a leak.
SOAK_POOL_BYTES = 2 * 2**20


def resident_bytes(server) -> int:
    """The server's resident memory: this process (the front end) and its engine core."""
    processes = [psutil.Process(), psutil.Process(server.engine.client.cores[0].process.pid)]
    return sum(process.memory_info().rss for process in processes)


async def soak_request(http: httpx.AsyncClient, base_url: str, rng: random.Random) -> None:
    """One client: a stream read to its end, or cut after a random number of chunks, or a
    plain request, sometimes abandoned."""
    body = {
        "model": MODEL,
        "prompt": f"Soak {rng.random()} story",
        "max_tokens": rng.randint(1, 96),
        "temperature": 1.0,
        "ignore_eos": rng.random() < 0.5,
        "stream": rng.random() < 0.8,
    }
    if not body["stream"]:
        try:
            await http.post(base_url + "/v1/completions", json=body, timeout=rng.uniform(0.05, 5))
        except httpx.TimeoutException:
            pass
        return
    cut_after = rng.randint(1, 20) if rng.random() < 0.33 else None
    async with http.stream("POST", base_url + "/v1/completions", json=body) as response:
        chunks = 0
        async for line in response.aiter_lines():
            chunks += line.startswith("data: ")
            if chunks == cut_after:
                break


async def soak(base_url: str, seconds: float, rng: random.Random) -> None:
    """Poisson arrivals for `seconds`, then wait for the last clients."""
    async with httpx.AsyncClient(timeout=60) as http:
        clients, deadline = [], time.monotonic() + seconds
        while time.monotonic() < deadline:
            clients.append(asyncio.create_task(soak_request(http, base_url, rng)))
            await asyncio.sleep(rng.expovariate(REQUEST_RATE))
        await asyncio.gather(*clients)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MINIVLLM_SOAK") != "1", reason="a soak of minutes: MINIVLLM_SOAK=1 runs it"
)
def test_a_soak_with_random_aborts_leaks_neither_blocks_nor_memory(model_dir):
    server = start_tiny_server(model_dir, kv_cache_memory_bytes=SOAK_POOL_BYTES)
    rng = random.Random(0)
    try:
        asyncio.run(soak(server.base_url, WARM_UP_SECONDS, rng))
        wait_until_idle(server)
        warm = resident_bytes(server)
        asyncio.run(soak(server.base_url, SOAK_SECONDS, rng))
        wait_until_idle(server)  # every block free
        grown = resident_bytes(server) - warm
        assert grown < RSS_SLACK_BYTES, f"resident memory grew by {grown / 2**20:.0f} MiB"
        assert scrape(server)["vllm:kv_cache_usage_perc"] == 0
    finally:
        server.stop()
