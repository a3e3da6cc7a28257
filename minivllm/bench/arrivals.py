"""Requests that arrive over time, and the latency each one sees (chapter 04's measurement of
chunked prefill).

Throughput benchmarks hand the engine every request at t = 0. Users do not: requests arrive
one by one, and what a user waiting for a streamed answer feels is the gap between two of its
tokens, the **inter-token latency** (ITL). A long prompt that arrives while others decode is the
case chunked prefill is for: computed in one step, it stalls every running request for that
whole step; cut into chunks of the token budget, it delays each of them a little, several times.

    requests = long_prompt_mid_stream(tokenizer, ...)      # arrival times + prompts
    timelines = run_with_arrivals(engine, requests)        # steps the engine on a wall clock
    timelines[0].inter_token_s                             # the gaps between its tokens

`run_with_arrivals` drives `LLMEngine` exactly as a server loop would: before every step it
adds the requests whose arrival time has passed, and it notes when each output token comes out.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from minivllm.bench.workloads import chat_prompt_of_length
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sample.sampling_params import SamplingParams


@dataclass
class TimedRequest:
    """A request and when it arrives, in seconds from the start of the run."""

    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class RequestTimeline:
    """When a request arrived and when each of its output tokens came out (seconds from the
    start of the run)."""

    request_id: str
    arrival_s: float
    prompt_length: int
    token_times_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        """Time to first token: from arrival to the first output token."""
        return self.token_times_s[0] - self.arrival_s

    @property
    def inter_token_s(self) -> list[float]:
        """The gaps between consecutive output tokens."""
        times = self.token_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]


def poisson_arrivals(rate_per_s: float, count: int, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process: independent exponential gaps of mean 1 / rate."""
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate_per_s)
        times.append(now)
    return times


def long_prompt_mid_stream(
    tokenizer,
    num_decoders: int = 8,
    decoder_prompt_length: int = 64,
    decoder_output_length: int = 96,
    rate_per_s: float = 8.0,
    long_prompt_length: int = 1536,
    long_prompt_arrival_s: float = 1.5,
    seed: int = 0,
) -> list[TimedRequest]:
    """Short chat requests arriving as a Poisson process, each streaming a long answer, and one
    long prompt that arrives while they decode (it asks for one token: it is there to be
    prefilled)."""
    rng = random.Random(seed)
    requests = [
        TimedRequest(
            arrival_s=arrival,
            prompt_token_ids=chat_prompt_of_length(tokenizer, decoder_prompt_length, rng),
            max_tokens=decoder_output_length,
        )
        for arrival in poisson_arrivals(rate_per_s, num_decoders, rng)
    ]
    long_prompt = chat_prompt_of_length(tokenizer, long_prompt_length, rng)
    requests.append(TimedRequest(long_prompt_arrival_s, long_prompt, max_tokens=1))
    return sorted(requests, key=lambda r: r.arrival_s)


def run_with_arrivals(engine: LLMEngine, requests: list[TimedRequest]) -> list[RequestTimeline]:
    """Step the engine on a wall clock, adding each request when its arrival time has passed;
    returns one timeline per request, in arrival order. Greedy, EOS ignored, so every request
    produces exactly `max_tokens` tokens."""
    pending = sorted(enumerate(requests), key=lambda item: item[1].arrival_s)
    timelines = {
        str(i): RequestTimeline(str(i), r.arrival_s, len(r.prompt_token_ids)) for i, r in pending
    }
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][1].arrival_s <= now:
            index, request = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
            engine.add_request(str(index), {"prompt_token_ids": request.prompt_token_ids}, params)
        if not engine.has_unfinished_requests():
            time.sleep(max(pending[0][1].arrival_s - now, 0.0))  # idle until the next one
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for output in outputs:
            timeline = timelines[output.request_id]
            new_tokens = len(output.outputs[0].token_ids) - len(timeline.token_times_s)
            timeline.token_times_s += [now] * new_tokens
    return [timelines[str(i)] for i in range(len(requests))]
