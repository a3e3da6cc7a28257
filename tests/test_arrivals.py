"""The arrival-process driver of chapter 04's latency measurement: requests join when they
arrive, every token's time is recorded, and latencies are computed from those times."""

from __future__ import annotations

import random
import time

import pytest
from conftest import ENGINE_TEST_FAMILY

from minivllm.bench.arrivals import (
    RequestTimeline,
    TimedRequest,
    poisson_arrivals,
    run_with_arrivals,
)
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine


def test_poisson_arrivals_increase_with_mean_gap_one_over_rate():
    times = poisson_arrivals(rate_per_s=4.0, count=4000, rng=random.Random(0))
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert all(gap > 0 for gap in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)


def test_timeline_latencies_come_from_token_times():
    timeline = RequestTimeline("a", arrival_s=1.0, prompt_length=3, token_times_s=[1.5, 1.7, 2.2])
    assert timeline.ttft_s == pytest.approx(0.5)
    assert timeline.inter_token_s == pytest.approx([0.2, 0.5])


@pytest.mark.parametrize("chunked", [True, False])
def test_requests_join_when_they_arrive_and_every_token_is_timed(tiny_model_dirs, chunked):
    """No request is added before its arrival time; each gets exactly max_tokens token times,
    none before its arrival, in order; with or without chunked prefill."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dirs[ENGINE_TEST_FAMILY]),
            dtype="float32",
            device="cpu",
            max_num_batched_tokens=64 if chunked else 256,
            enable_chunked_prefill=chunked,
        )
    )
    requests = [
        TimedRequest(0.0, list(range(10, 30)), max_tokens=12),
        TimedRequest(0.05, list(range(40, 240)), max_tokens=1),
        TimedRequest(0.02, list(range(5, 15)), max_tokens=8),
        TimedRequest(0.3, list(range(7, 12)), max_tokens=4),  # after a quiet spell
    ]
    added_at = {}
    add_request, start = engine.add_request, time.perf_counter()

    def recording_add(request_id, prompt, params):
        added_at[request_id] = time.perf_counter() - start
        add_request(request_id, prompt, params)

    engine.add_request = recording_add
    timelines = run_with_arrivals(engine, requests)

    for i, (request, timeline) in enumerate(zip(requests, timelines)):
        assert timeline.request_id == str(i) and timeline.arrival_s == request.arrival_s
        assert added_at[str(i)] >= request.arrival_s
        assert len(timeline.token_times_s) == request.max_tokens
        assert timeline.token_times_s == sorted(timeline.token_times_s)
        assert timeline.ttft_s > 0
    assert not engine.scheduler.has_unfinished_requests()
