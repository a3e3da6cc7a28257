"""Chapter 09's learning checks: a request stream that aborts its request when the client
leaves (the rule that keeps a server's KV blocks from leaking), and latencies as a client
measures them, from the event stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hypothesis import example, given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check, reraise_if_stub


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


@dataclass
class FakeOutput:
    request_id: str
    index: int  # the request's index-th output
    finished: bool


@dataclass
class FakeEngine:
    """An engine that streams `num_outputs` outputs per request and records what it was asked.
    Before output `stall_at` it waits until cancelled (a slow step: the client leaves while
    waiting). A request holds its KV blocks while it is in `running`."""

    num_outputs: int
    stall_at: int | None = None
    running: set[str] = field(default_factory=set)
    added: list[tuple[str, object]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    stalled: asyncio.Event = field(default_factory=asyncio.Event)

    def add_request(self, request_id: str, prompt):
        self.added.append((request_id, prompt))
        self.running.add(request_id)
        return self._outputs(request_id)

    async def _outputs(self, request_id: str):
        for index in range(self.num_outputs):
            if index == self.stall_at:
                self.stalled.set()
                await asyncio.Event().wait()  # never set: only a cancellation ends it
            await asyncio.sleep(0)  # a step
            finished = index == self.num_outputs - 1
            if finished:
                self.running.discard(request_id)  # a finished request frees its blocks
            yield FakeOutput(request_id, index, finished)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.discard(request_id)


async def _consume(generate, engine: FakeEngine, how: str, stop_after: int) -> list[FakeOutput]:
    """A client reading the stream to its end, leaving after `stop_after` outputs (the server
    closes the stream, as `contextlib.aclosing` does), or cancelled while it waits."""
    received: list[FakeOutput] = []

    async def read() -> None:
        async with contextlib.aclosing(generate(engine, "request-0", [1, 2, 3])) as stream:
            async for output in stream:
                received.append(output)
                if how == "leaves" and len(received) == stop_after:
                    break

    if how != "is cancelled":
        await read()
        return received
    reader = asyncio.create_task(read())
    await engine.stalled.wait()
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader
    return received


def _run_scenario(generate, num_outputs: int, how: str, stop_after: int):
    async def scenario():
        engine = FakeEngine(num_outputs, stall_at=stop_after if how == "is cancelled" else None)
        received = await _consume(generate, engine, how, stop_after)
        return engine, received

    # In a thread of its own: a notebook's cell already runs inside an event loop.
    with ThreadPoolExecutor(1) as thread:
        try:
            return thread.submit(asyncio.run, scenario()).result(timeout=10)
        except NotImplementedError as error:  # raised when the stub's body first runs
            reraise_if_stub(error)
            raise


def _our_generate():
    from minivllm.engine.async_llm import AsyncLLM

    class EngineStream:
        """What `AsyncLLM.add_request` returns, over the fake engine: the request's outputs,
        and `close()`, which aborts it unless it finished."""

        def __init__(self, engine: FakeEngine, request_id: str, prompt):
            self.engine, self.request_id, self.finished = engine, request_id, False
            self.outputs = engine.add_request(request_id, prompt)

        def __aiter__(self):
            return self

        async def __anext__(self):
            output = await anext(self.outputs)
            self.finished = output.finished
            return output

        def close(self) -> None:
            if not self.finished:
                self.engine.abort(self.request_id)

    @dataclass
    class Engine:
        fake: FakeEngine

        def add_request(self, request_id, prompt, params=None, *, priority=0):
            return EngineStream(self.fake, request_id, prompt)

    def generate(engine: FakeEngine, request_id: str, prompt):
        return AsyncLLM.generate(Engine(engine), prompt, None, request_id)

    return generate


@learning_check(
    "ch09.generate",
    signature="generate(engine, request_id: str, prompt) -> an async generator: it sends the "
    "request (outputs = engine.add_request(request_id, prompt), an async iterator) and yields "
    "each output, in order (output.finished is True on the last); a client that leaves "
    "early (the stream is closed before the last output, or the task is cancelled while it "
    "waits) must leave the request aborted: engine.abort(request_id), so its blocks are freed.",
    reference=_our_generate,
)
def check_generate(generate) -> None:
    """With a fake engine, three clients: one that reads every output, one that leaves after
    some (the server closes the stream), one cancelled while it waits for the next. After each,
    no request may still hold blocks, and the outputs read are the engine's, in order."""

    @check_settings(max_examples=30)
    @given(
        num_outputs=st.integers(1, 6),
        how=st.sampled_from(["reads to the end", "leaves", "is cancelled"]),
        offset=st.integers(0, 5),
    )
    @example(num_outputs=3, how="leaves", offset=0)
    @example(num_outputs=3, how="is cancelled", offset=1)
    def property_(num_outputs, how, offset):
        # Where the client stops: after 1 .. n-1 outputs when it leaves (with one output there
        # is nothing to leave before), while waiting for output 0 .. n-1 when cancelled.
        if how == "leaves" and num_outputs == 1:
            how = "reads to the end"
        first = {"reads to the end": num_outputs, "leaves": 1, "is cancelled": 0}[how]
        choices = {"reads to the end": 1, "leaves": num_outputs - 1, "is cancelled": num_outputs}
        stop_after = first + offset % choices[how]
        engine, received = _run_scenario(generate, num_outputs, how, stop_after)
        when = {
            "reads to the end": f" ({num_outputs} outputs)",
            "leaves": f" after {stop_after} of {num_outputs} outputs",
            "is cancelled": f" while waiting for output {stop_after} of {num_outputs}",
        }[how]
        story = f"a client that {how}{when}"
        if engine.added != [("request-0", [1, 2, 3])]:
            raise AssertionError(
                f"{story}: expected one engine.add_request('request-0', [1, 2, 3]), got "
                f"{engine.added}"
            )
        expected = list(range(stop_after))
        if [output.index for output in received] != expected:
            raise AssertionError(
                f"{story}: expected outputs {expected} in order, got "
                f"{[output.index for output in received]}"
            )
        if engine.running:
            raise AssertionError(
                f"{story}: the request still runs and holds its KV blocks after the client "
                f"left (engine.abort was called for {engine.aborted or 'nothing'})"
            )

    property_()
