"""Chapter 09 — the async engine: many users at once, each streaming its own answer.

`LLM.generate` (chapter 04) owns the loop: it adds a batch, steps until the batch is done and
returns. A server cannot work that way. Requests arrive one by one from many connections, each
wants its tokens as soon as they exist, and a user who closes the tab must stop costing compute.
`AsyncLLM` (vLLM's name) turns the engine inside out: the engine core loops by itself, and
requests come and go while it runs.

    asyncio event loop (HTTP, many coroutines)              engine core (a thread or a process)
    ------------------------------------------              -----------------------------------
    stream = llm.add_request(id, prompt, params)  --AddRequest-->  engine.add_request(...)
                                                                   while work: engine.step()
    OutputProcessor: token ids -> text  <--one callback per step, deltas (token ids)--
    async for output in stream:
        send it to the client
    client gone -> stream.close()  --AbortRequests-->  engine.abort_request(id): blocks freed

Where the core runs is the client's business (engine/core_client.py): `minivllm serve` runs it
in a process of its own (engine/core.py: the step and the HTTP front end then share no GIL);
`AsyncLLM(engine)` steps an engine you built in a background thread. `engine.step()` is one
forward pass, milliseconds to seconds of blocking work: on the event loop it would freeze every
connection for that long.

One thread owns the streams: the event loop's. The client's thread (the in-process engine
thread, or the thread reading the core's socket) touches none of them; after each step it
hands the step's outputs to the loop with `loop.call_soon_threadsafe` (the one safe way into
another thread's event loop), and the loop routes them. So a stream that closes while its last
output is on the way cannot race the delivery: both run on the loop, one after the other.

Text: the core sends token ids only and the front end detokenizes, as in vLLM V1. The
`OutputProcessor` (engine/output_processor.py) keeps one incremental detokenizer per sequence,
on the event loop like the streams: it turns each step's new tokens into new text and
decoded logprob tokens, holds back what may still change, and checks the stop strings. A
sequence that a stop string ends, ends here; the core, which sees no text, is told to abort it.

Streams: outputs arrive as deltas (engine/deltas.py: only what a step added) and each stream
joins them into the cumulative `RequestOutput` its consumer reads. A consumer that is slower
than the engine gets the newest state when it reads, with the steps it missed merged in, as
vLLM's output collector does, so a stream that nobody reads holds one output, not one per step.
A stream ends with the output marked `finished`.

Cancellation: a consumer that stops iterating (the client disconnected, so the server's task is
cancelled) closes its stream, which aborts the request before the next step: its KV blocks go
back to the pool at once instead of after `max_tokens` tokens nobody reads.

Back-pressure: at most `max_waiting_requests` requests may wait for their first token; one more
raises `EngineOverloadedError` (the server answers 503) instead of growing a queue without bound.

Request ids: the caller's id names the stream and its outputs, and may be used again as soon as
its stream has closed. The core may still be running the old request then: an abort reaches it
between two steps, and the step under way ends with an output of the old request. So, as in
vLLM, the core knows every request by an id of its own, the caller's id and a serial number
(`"r-7"`), never used twice by one `AsyncLLM`: the old request's late output names the old id,
which nothing listens to any more.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from minivllm.config import EngineConfig
from minivllm.engine import make_engine
from minivllm.engine.core import EngineCoreOutputs
from minivllm.engine.core_client import EngineCoreClient, EngineDeadError, InprocClient, MPClient
from minivllm.engine.data_parallel import AddRequest
from minivllm.engine.deltas import merge_delta, new_request_output, snapshot
from minivllm.engine.llm_engine import Metric
from minivllm.engine.output_processor import OutputProcessor, core_params
from minivllm.outputs import RequestOutput
from minivllm.sample.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError", "RequestStream"]

DEFAULT_MAX_WAITING_REQUESTS = 1024
T = TypeVar("T")


class StepListener(Protocol):
    """Told, on the event loop, what every step produced (as deltas with text: each output
    holds the new tokens and text) and which requests were aborted; the server's latency
    metrics listen."""

    def on_step(self, outputs: list[RequestOutput], now: float) -> None:
        """`now`: when the step ended (time.monotonic)."""

    def on_abort(self, request_ids: list[str]) -> None: ...


class EngineOverloadedError(RuntimeError):
    """Too many requests wait for their first token; the client should retry later."""


@dataclass
class RequestStream:
    """The outputs of one request, in the event loop that asked for them.

    Iterate it with `async for`; `close()` (also called when iteration is abandoned through
    `AsyncLLM.generate`) aborts the request if it has not finished. Used on the loop only."""

    request_id: str  # the caller's
    core_id: str  # the engine core's (see the module docstring)
    owner: AsyncLLM
    output: RequestOutput  # everything received so far, joined
    started: bool = False  # has produced its first output
    finished: bool = False  # nothing more will be read from it
    unread: bool = False  # `output` changed since the consumer last read it
    error: BaseException | None = None
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not (self.unread or self.error):
            self.wakeup.clear()
            await self.wakeup.wait()
        if not self.unread:  # an error, and nothing left unread before it
            self.finished = True
            raise self.error
        self.unread = False
        self.finished = self.output.finished
        return snapshot(self.output)

    def close(self) -> None:
        """Stop the request if it is still running (idempotent)."""
        if not self.finished:
            self.finished = True
            self.owner._abort(self.core_id)

    def receive(self, delta: RequestOutput) -> None:
        self.started = True
        merge_delta(self.output, delta)
        self.unread = True
        self.wakeup.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.wakeup.set()


class AsyncLLM:
    """An engine core that steps by itself, with one async stream per request."""

    def __init__(
        self,
        engine,
        max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
    ) -> None:
        """`engine`: an `EngineCoreClient`, or an engine to step in a thread of this process."""
        self.client = engine if isinstance(engine, EngineCoreClient) else InprocClient(engine)
        self.max_waiting_requests = max_waiting_requests
        self.output_processor = OutputProcessor(self.client.tokenizer)  # the loop's alone
        self.listeners: list[StepListener] = []
        # Open streams by core id, and the core id of each open caller's id; the loop's alone.
        self._streams: dict[str, RequestStream] = {}
        self._core_ids: dict[str, str] = {}
        self._serials = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the streams live in
        self._error: BaseException | None = None
        self._stopping = False
        self.client.start(self._on_outputs, self._on_failure)

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
        *,
        multiprocess: bool = True,
    ) -> AsyncLLM:
        """The engine core in processes of its own (vLLM's default), or, with
        `multiprocess=False`, in a thread of this one."""
        client = MPClient(config) if multiprocess else InprocClient(make_engine(config))
        return cls(client, max_waiting_requests)

    @property
    def engine(self):
        """The engine itself, for an engine stepped in this process."""
        return self.client.engine

    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def model_path(self):
        return self.client.model_path

    @property
    def is_running(self) -> bool:
        return self._error is None and not self._stopping

    @property
    def num_open_requests(self) -> int:
        """Requests accepted and not yet finished or aborted."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests accepted that have not produced a token yet."""
        return sum(not stream.started for stream in self._streams.values())

    # --- the event loop's side ---

    def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
    ) -> RequestStream:
        """Validate a request now (ValueError/TypeError, nothing queued) and send it to the
        engine core; its outputs arrive on the returned stream. Call from a coroutine."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self._error
        if request_id in self._core_ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"the server is busy: {self.num_waiting} requests are already waiting for their "
                f"first token (max_waiting_requests={self.max_waiting_requests}); retry later"
            )
        # The Processor only reads the tokenizer: checking here does not touch the engine.
        processed, params = self.client.processor.process_request(prompt, params)
        prompt = processed.as_prompt()
        self._use_loop(asyncio.get_running_loop())
        # A unique id for the core, rather than a serial number the core would echo with each
        # output: the id is the key the core, the output processor and MPClient's routes
        # already use, and unique ids keep each of them right as it is, where a serial would
        # travel in every message and be checked at each of them.
        core_id = f"{request_id}-{next(self._serials)}"
        self.client.add_request(AddRequest(core_id, prompt, core_params(params), priority))
        # Registered after the send: its first output is delivered on this loop, later.
        self.output_processor.add_request(core_id, prompt["prompt_token_ids"], params)
        output = new_request_output(request_id, prompt)
        stream = RequestStream(request_id, core_id, self, output)
        self._streams[core_id] = stream
        self._core_ids[request_id] = core_id
        return stream

    def _use_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Streams live in one event loop. A new loop may take over once the old one has no
        open streams or is closed (asyncio.run, called again)."""
        if loop is self._loop:
            return
        if self._streams and self._loop is not None and not self._loop.is_closed():
            raise RuntimeError("an AsyncLLM serves one event loop at a time")
        if self._streams:  # left open by a closed loop: nobody will read them
            self.client.abort_requests(list(self._streams))
            self.output_processor.abort_requests(list(self._streams))
            self._streams.clear()
            self._core_ids.clear()
        self._loop = loop

    async def generate(
        self,
        prompt,
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's `RequestOutput` each time it advances, the last one finished.
        Leaving the loop early (break, cancellation) aborts the request."""
        stream = self.add_request(request_id, prompt, sampling_params, priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks are freed before the next step."""
        core_id = self._core_ids.get(request_id)
        if core_id is not None:
            self._abort(core_id)

    def _abort(self, core_id: str) -> None:
        """`abort`, by the core's id: what a stream stops is its own request, even once its
        caller's id names another one."""
        stream = self._forget(core_id)
        if stream is None:
            return
        self.output_processor.abort_requests([core_id])
        stream.finished = True
        if self.is_running:
            self.client.abort_requests([core_id])
        for listener in self.listeners:
            listener.on_abort([stream.request_id])

    def _forget(self, core_id: str) -> RequestStream | None:
        """Close the books on an open stream (None if it is not open); its id is free again."""
        stream = self._streams.pop(core_id, None)
        if stream is not None:
            del self._core_ids[stream.request_id]
        return stream

    def add_listener(self, listener: StepListener) -> None:
        self.listeners.append(listener)

    def call_engine(self, function: Callable[[Any], T]) -> T:
        """`function(engine)` between two steps, where the engine is safe to read, in the
        engine's process (there `function` must pickle by name: a module-level function).
        Blocks until the current step ends: from a coroutine, call it through
        asyncio.to_thread."""
        return self.client.call_engine(function)

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics (see `call_engine` on blocking)."""
        return self.client.get_metrics()

    def get_replica_metrics(self) -> list[list[Metric]]:
        """Each data-parallel replica's own metrics (one list without data parallelism)."""
        return self.client.get_replica_metrics()

    def shutdown(self) -> None:
        """Stop the engine core; every open stream ends with EngineDeadError."""
        self._stopping = True
        self.client.shutdown()
        self._post(self._fail_streams, EngineDeadError("the engine was shut down"))

    # --- called on the client's thread: hand over to the loop ---

    def _on_outputs(self, report: EngineCoreOutputs) -> None:
        self._post(self._deliver, report)

    def _on_failure(self, error: BaseException) -> None:
        self._error = error  # from now on add_request refuses
        self._post(self._fail_streams, EngineDeadError(f"the engine loop failed: {error!r}"))

    def _post(self, callback: Callable, *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # no stream is open in a loop that could read it
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the loop closed in the meantime

    # --- the loop's side of delivery ---

    def _deliver(self, report: EngineCoreOutputs) -> None:
        # Requests aborted while this step ran are left out: their outputs are not wanted.
        processed = self.output_processor.process_outputs(report.outputs)
        streams = [self._streams[output.request_id] for output in processed.outputs]
        # From here on the outputs carry their caller's ids.
        outputs = [
            replace(output, request_id=stream.request_id)
            for stream, output in zip(streams, processed.outputs)
        ]
        for listener in self.listeners:
            listener.on_step(outputs, report.timestamp)
        for stream, output in zip(streams, outputs):
            if output.finished:
                self._forget(stream.core_id)
            stream.receive(output)
        if self.is_running:  # what a stop string ended here, the core must stop too
            if processed.requests_to_abort:
                self.client.abort_requests(processed.requests_to_abort)
            if processed.sequences_to_abort:
                self.client.abort_sequences(processed.sequences_to_abort)
        for core_id, error in report.errors.items():
            self.output_processor.abort_requests([core_id])
            stream = self._forget(core_id)
            if stream is not None:
                stream.fail(error)

    def _fail_streams(self, error: BaseException) -> None:
        self.output_processor.abort_requests(list(self._streams))
        streams, self._streams, self._core_ids = self._streams, {}, {}
        for stream in streams.values():
            stream.fail(error)
