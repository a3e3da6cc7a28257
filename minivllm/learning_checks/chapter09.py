"""Chapter 09's learning check: latencies as a client measures them, from the event stream."""

from __future__ import annotations

import json
import math

from hypothesis import given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check


def _our_stream_latencies():
    from minivllm.bench.serve import stream_latencies

    return stream_latencies


def _data(payload: dict) -> str:
    return "data: " + json.dumps(payload)


# The lines a stream may hold, and whether each carries text.
LINE_KINDS = {
    "completion text": (lambda i: _data({"choices": [{"index": 0, "text": f"t{i}"}]}), True),
    "chat text": (lambda i: _data({"choices": [{"delta": {"content": f"c{i}"}}]}), True),
    "empty text": (lambda i: _data({"choices": [{"index": 0, "text": ""}]}), False),
    "chat role only": (lambda i: _data({"choices": [{"delta": {"role": "assistant"}}]}), False),
    "usage": (lambda i: _data({"choices": [], "usage": {"completion_tokens": i}}), False),
    "blank": (lambda i: "", False),
}


@learning_check(
    "ch09.stream_latencies",
    signature="stream_latencies(events: list[tuple[float, str]]) -> tuple[float, list[float]]: "
    "events are (seconds since the request was sent, line) as read from a server-sent event "
    "stream; return (ttft, itls): the time of the first `data:` chunk whose first choice "
    "carries text (`text`, or `delta.content` for chat) and the gaps between consecutive "
    "text-carrying chunks. Ignore blank lines, chunks without text and `data: [DONE]`.",
    reference=_our_stream_latencies,
)
def check_stream_latencies(stream_latencies) -> None:
    """Random streams: text chunks mixed with empty chunks, role-only chat chunks, blank lines
    and a usage chunk, at increasing times, ending with [DONE]."""

    @check_settings(max_examples=40)
    @given(
        kinds=st.lists(st.sampled_from(sorted(LINE_KINDS)), min_size=1, max_size=12),
        gaps=st.lists(st.floats(0.001, 0.5), min_size=13, max_size=13),
    )
    def property(kinds, gaps):
        if not any(LINE_KINDS[kind][1] for kind in kinds):
            kinds = kinds + ["completion text"]
        events, text_times, now = [], [], 0.0
        for i, kind in enumerate(kinds):
            now += gaps[i]
            make_line, carries_text = LINE_KINDS[kind]
            events.append((now, make_line(i)))
            if carries_text:
                text_times.append(now)
        events.append((now + gaps[-1], "data: [DONE]"))
        ttft, itls = stream_latencies(events)
        expected = [later - earlier for earlier, later in zip(text_times, text_times[1:])]
        lines = "\n".join(f"  {t:.3f} s  {line!r}" for t, line in events)
        if (
            not math.isclose(ttft, text_times[0])
            or len(itls) != len(expected)
            or not all(math.isclose(a, b) for a, b in zip(itls, expected))
        ):
            raise AssertionError(
                f"for the stream\n{lines}\nexpected ttft {text_times[0]:.3f} s and itls "
                f"{[round(x, 3) for x in expected]}, got ttft {ttft} and itls "
                f"{[round(x, 3) for x in itls]}"
            )

    property()
