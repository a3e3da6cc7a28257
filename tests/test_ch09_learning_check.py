"""Chapter 09's learning checks: each passes on minivllm's own code and fails on a typical
mistake. `stream_latencies`: timing every event line, as a client that counts chunks instead of
tokens would (usage and role-only chunks then look like tokens). `generate`: a stream that does
not abort its request on every way a client can leave.
"""

from __future__ import annotations

import pytest

from minivllm.learning_checks import all_checks, assert_check, run_check


def _every_data_line_is_a_token(events):
    times = [seconds for seconds, line in events if line.startswith("data: ")]
    return times[0], [later - earlier for earlier, later in zip(times, times[1:])]


def test_stream_latencies_check_passes_on_minivllm_and_fails_on_a_typical_mistake():
    assert_check("ch09.stream_latencies", all_checks()["ch09.stream_latencies"].reference())
    result = run_check("ch09.stream_latencies", _every_data_line_is_a_token)
    assert not result.passed
    assert "expected ttft" in result.report


async def _never_aborts(engine, request_id, prompt):
    async for output in engine.add_request(request_id, prompt):
        yield output


async def _aborts_only_when_closed(engine, request_id, prompt):
    try:
        async for output in engine.add_request(request_id, prompt):
            yield output
    except GeneratorExit:  # a cancelled task raises CancelledError at the await instead
        engine.abort(request_id)
        raise


async def _aborts_after_the_loop(engine, request_id, prompt):
    finished = False
    async for output in engine.add_request(request_id, prompt):
        finished = output.finished
        yield output
    if not finished:  # never reached: a closed or cancelled generator does not resume here
        engine.abort(request_id)


@pytest.mark.parametrize(
    "mistake, client",
    [
        (_never_aborts, "leaves"),
        (_aborts_only_when_closed, "is cancelled"),
        (_aborts_after_the_loop, "leaves"),
    ],
)
def test_generate_check_passes_on_minivllm_and_fails_on_typical_mistakes(mistake, client):
    """minivllm's `AsyncLLM.generate` passes; three ways to leak a request whose client left
    each fail, naming the client that caught them and the blocks still held."""
    assert_check("ch09.generate", all_checks()["ch09.generate"].reference())
    result = run_check("ch09.generate", mistake)
    assert not result.passed
    assert f"a client that {client}" in result.report
    assert "holds its KV blocks" in result.report
