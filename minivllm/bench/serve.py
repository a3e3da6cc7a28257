"""Latency under load: requests arrive as a Poisson process at a server, over HTTP (chapter 09).

Throughput benchmarks hand the engine all the work at once. A server's users arrive at random
times, and what each of them feels is latency: the time to the first token (TTFT), the gap
between tokens (ITL) and the whole request (E2E). As the request rate grows, throughput rises
until the engine is saturated; past that point requests queue and TTFT explodes. Running the
same workload at a few rates and plotting latency against throughput shows where that knee is.

    with BackgroundServer(AsyncLLM.from_config(config)) as server:
        results = bench_serve(server.base_url, [prompts_1, prompts_4], request_rates=[1, 4])
    print(format_results(results))

Each request is a streaming `/v1/completions` call with `ignore_eos`, so every request asks
for the same work; the client notes when each chunk arrives. It works against any
OpenAI-compatible server that accepts token-id prompts (vLLM's too), bounded both in requests
and in time: nothing is sent after `max_seconds`, and what still runs then is cancelled.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from minivllm.bench.arrivals import poisson_arrivals
from minivllm.entrypoints.openai.api_server import wait_until_healthy
from minivllm.executor.multiproc import free_port
from minivllm.utils import wait_or_kill

PERCENTILES = (50, 90, 99)
PERCENTILE_NAMES = tuple(f"p{p}" for p in PERCENTILES)


@dataclass
class StreamRecord:
    """What the client saw of one streamed request."""

    ok: bool = False  # the stream ended with [DONE]
    events: list[tuple[float, str]] = field(default_factory=list)  # (seconds since sent, line)
    end_s: float = math.nan
    output_tokens: int = 0
    error: str | None = None


def stream_latencies(events: list[tuple[float, str]]) -> tuple[float, list[float]]:
    """TTFT and inter-token latencies from a server-sent event stream as the client read it:
    (seconds since the request was sent, line) pairs. Only chunks that carry text count (a
    usage chunk has no choices; a role-only chat chunk has no text); NaN TTFT if none did."""
    times = [seconds for seconds, line in events if chunk_text(line)]
    if not times:
        return math.nan, []
    return times[0], [later - earlier for earlier, later in zip(times, times[1:])]


def chunk_text(line: str) -> str:
    """The text a `data: {...}` line carries ("" for anything else): a completion chunk's
    `text` or a chat chunk's `delta.content`, of its first choice."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return ""
    choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
    first = choices[0]
    return first.get("text") or (first.get("delta") or {}).get("content") or ""


@dataclass
class ServeBenchResult:
    """One request rate's measurements; latencies in milliseconds as {"p50", "p90", "p99"}."""

    request_rate: float  # requests per second offered (inf: all at once)
    num_sent: int
    num_completed: int
    num_failed: int  # sent, not completed: an error, or still running when time was up
    duration_s: float
    request_throughput: float  # completed requests per second
    output_throughput: float  # generated tokens per second
    ttft_ms: dict[str, float]  # time to first token, per request
    # Time per output token after the first, one value per request (vLLM's definition):
    # (E2E - TTFT) / (output tokens - 1), for requests of more than one token.
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]  # inter-token latency: every gap between two chunks
    e2e_ms: dict[str, float]
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def percentiles_ms(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {f"p{p}": math.nan for p in PERCENTILES}
    points = np.percentile(np.asarray(values_s) * 1000.0, PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, points)}


async def stream_completion(client: httpx.AsyncClient, url: str, payload: dict) -> StreamRecord:
    """Send one streaming completion and time its chunks."""
    record = StreamRecord()
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                record.events.append((time.perf_counter() - start, line))
                if line == "data: [DONE]":
                    record.ok = True
                    break
                usage = json.loads(line[len("data: ") :]).get("usage")
                if usage:
                    record.output_tokens = usage["completion_tokens"]
    except httpx.HTTPError as error:
        record.error = f"{type(error).__name__}: {error}"
    record.end_s = time.perf_counter() - start
    return record


async def run_at_rate(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    request_rate: float,
    max_tokens: int,
    max_seconds: float,
    seed: int = 0,
    api_key: str | None = None,
) -> ServeBenchResult:
    """Send `prompts` at Poisson arrival times of the given rate; measure what comes back."""
    if math.isinf(request_rate):
        arrivals = [0.0] * len(prompts)
    else:
        arrivals = poisson_arrivals(request_rate, len(prompts), random.Random(seed))
    arrivals = [t for t in arrivals if t < max_seconds]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=max_seconds, limits=limits, headers=headers) as client:
        start = time.perf_counter()

        async def send_at(arrival_s: float, prompt: list[int]) -> StreamRecord:
            await asyncio.sleep(max(0.0, start + arrival_s - time.perf_counter()))
            payload = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            return await stream_completion(client, url, payload)

        tasks = [asyncio.create_task(send_at(t, p)) for t, p in zip(arrivals, prompts)]
        done, pending = await asyncio.wait(tasks, timeout=max_seconds) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        duration = time.perf_counter() - start
    records = [task.result() for task in tasks if task in done]
    return summarize(request_rate, len(arrivals), records, duration)


def summarize(
    request_rate: float, num_sent: int, records: list[StreamRecord], duration_s: float
) -> ServeBenchResult:
    # Each finished stream's (TTFT, ITLs), read from its lines once; a stream without text
    # (NaN TTFT) did not complete.
    latencies = {id(r): stream_latencies(r.events) for r in records if r.ok}
    completed = [r for r in records if r.ok and not math.isnan(latencies[id(r)][0])]
    output_tokens = sum(r.output_tokens for r in completed)
    tpots = [
        (r.end_s - latencies[id(r)][0]) / (r.output_tokens - 1)
        for r in completed
        if r.output_tokens > 1
    ]
    return ServeBenchResult(
        request_rate=request_rate,
        num_sent=num_sent,
        num_completed=len(completed),
        num_failed=num_sent - len(completed),
        duration_s=duration_s,
        request_throughput=len(completed) / duration_s,
        output_throughput=output_tokens / duration_s,
        ttft_ms=percentiles_ms([latencies[id(r)][0] for r in completed]),
        tpot_ms=percentiles_ms(tpots),
        itl_ms=percentiles_ms([gap for r in completed for gap in latencies[id(r)][1]]),
        e2e_ms=percentiles_ms([r.end_s for r in completed]),
        errors=[r.error for r in records if r.error is not None],
    )


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def bench_serve(*args, **kwargs) -> list[ServeBenchResult]:
    """`bench_serve_async` run to its end: the same arguments, for code outside an event
    loop."""
    return asyncio.run(bench_serve_async(*args, **kwargs))


async def bench_serve_async(
    base_url: str,
    prompts_per_rate: list[list[list[int]]],
    request_rates: list[float],
    max_tokens: int = 32,
    max_seconds: float = 60.0,
    model: str | None = None,
    seed: int = 0,
    api_key: str | None = None,
    min_completed_share: float = 0.0,
) -> list[ServeBenchResult]:
    """Each request rate with prompts of its own, one rate after the other (`bench_serve` for
    code already inside an event loop, as a notebook: `await` it).

    Fresh prompts per rate keep a rate from finding an earlier one's prompts in the server's
    prefix cache. Rates are run in the order given; once fewer than `min_completed_share` of a
    rate's requests complete within `max_seconds`, the server is past saturation and the
    rates after it are not run (their requests would only queue longer)."""
    if len(prompts_per_rate) != len(request_rates):
        raise ValueError(
            f"one list of prompts per request rate: got {len(prompts_per_rate)} lists for "
            f"{len(request_rates)} rates"
        )
    model = model or served_model(base_url, api_key)
    results = []
    for rate, prompts in zip(request_rates, prompts_per_rate):
        result = await run_at_rate(
            base_url, model, prompts, rate, max_tokens, max_seconds, seed, api_key
        )
        results.append(result)
        if result.num_completed < min_completed_share * result.num_sent:
            break
    return results


def split_per_rate(prompts: list[list[int]], num_rates: int) -> list[list[list[int]]]:
    """`prompts` cut into `num_rates` consecutive slices of equal length, one per rate: fresh
    prompts for every rate from one workload."""
    n = len(prompts) // num_rates
    return [prompts[i * n : (i + 1) * n] for i in range(num_rates)]


def requests_for_rate(rate: float, arrival_seconds: float, at_once: int) -> int:
    """How many requests a rate gets: `arrival_seconds` of Poisson arrivals on average (enough
    for the server to settle into its steady state), or `at_once` for rate inf."""
    return at_once if math.isinf(rate) else max(1, math.ceil(rate * arrival_seconds))


def knee_rate(results: list[ServeBenchResult], tokens_per_request: int) -> float:
    """The request rate whose offered tokens/s equal the most the server delivered at any rate
    measured: below it the server keeps up, above it requests queue."""
    return max(r.output_throughput for r in results) / tokens_per_request


class ServerProcess:
    """`minivllm serve` in a child process on a free loopback port, for benchmarks: the server
    gets an interpreter (and a GIL) of its own, so the client's timing threads do not slow it.

        with ServerProcess(["--max-num-seqs", "32"]) as server:
            results = bench_serve(server.base_url, [prompts_1, prompts_4], [1, 4])
    """

    def __init__(self, engine_args: list[str] = (), startup_timeout_s: float = 180):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="minivllm-serve-", suffix=".log")
        command = [sys.executable, "-m", "minivllm", "serve", "--port", str(self.port)]
        self.process = subprocess.Popen(
            command + [str(arg) for arg in engine_args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=os.environ | {"HF_HUB_OFFLINE": "1"},
        )
        try:
            wait_until_healthy(self.base_url, startup_timeout_s, self.is_alive)
        except RuntimeError:
            self.log.seek(0)
            raise RuntimeError(
                f"the server exited while starting:\n{self.log.read()[-2000:]}"
            ) from None
        except TimeoutError:
            self.stop()
            raise

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        self.process.terminate()
        wait_or_kill(self.process, 30)
        self.log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def format_results(results: list[ServeBenchResult]) -> str:
    """A table: one row per request rate."""
    header = (
        f"{'rate/s':>7} {'done':>9} {'req/s':>7} {'tok/s':>8} "
        + " ".join(
            f"{name + ' ' + p:>10}"
            for name in ("TTFT", "TPOT", "ITL", "E2E")
            for p in PERCENTILE_NAMES
        )
        + "   (ms)"
    )
    rows = [header]
    for r in results:
        latencies = " ".join(
            f"{getattr(r, name)[p]:>10.1f}"
            for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
            for p in PERCENTILE_NAMES
        )
        rows.append(
            f"{r.request_rate:>7g} {r.num_completed:>4}/{r.num_sent:<4} "
            f"{r.request_throughput:>7.2f} {r.output_throughput:>8.1f} {latencies}"
        )
    for r in results:
        if r.errors:
            rows.append(f"rate {r.request_rate:g}: {len(r.errors)} failed, e.g. {r.errors[0]}")
    return "\n".join(rows)
