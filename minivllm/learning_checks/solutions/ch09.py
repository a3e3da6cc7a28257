"""Chapter 09's solutions: a request stream that aborts its request when the client leaves; TTFT
and inter-token latencies from a server-sent event stream."""

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


async def generate(engine, request_id, prompt):
    finished = False
    try:
        async for output in engine.add_request(request_id, prompt):
            finished = output.finished
            yield output
    finally:
        # Reached when the loop ends, when the consumer closes the stream (GeneratorExit at
        # the yield) and when its task is cancelled (CancelledError at the await): in the last
        # two the request would otherwise keep running, and keep its blocks, for nobody.
        if not finished:
            engine.abort(request_id)
