"""Chapter 09's learning check: it passes on minivllm's own `stream_latencies` and fails on the
typical mistake of timing every event line, as a client that counts chunks instead of tokens
would (usage and role-only chunks then look like tokens)."""

from __future__ import annotations

from minivllm.learning_checks import all_checks, assert_check, run_check


def _every_data_line_is_a_token(events):
    times = [seconds for seconds, line in events if line.startswith("data: ")]
    return times[0], [later - earlier for earlier, later in zip(times, times[1:])]


def test_stream_latencies_check_passes_on_minivllm_and_fails_on_a_typical_mistake():
    assert_check("ch09.stream_latencies", all_checks()["ch09.stream_latencies"].reference())
    result = run_check("ch09.stream_latencies", _every_data_line_is_a_token)
    assert not result.passed
    assert "expected ttft" in result.report
