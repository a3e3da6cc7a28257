"""Chapter 09's solution: TTFT and inter-token latencies from a server-sent event stream."""

import json


def stream_latencies(events):
    times = []
    for seconds, line in events:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue  # blank separators and the end marker carry no token
        choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
        first = choices[0]
        text = first.get("text") or (first.get("delta") or {}).get("content")
        if text:  # usage chunks and role-only chat chunks carry no token
            times.append(seconds)
    return times[0], [later - earlier for earlier, later in zip(times, times[1:])]
