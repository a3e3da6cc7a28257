"""Chapter 09 — the async engine: many users at once, each streaming its own answer.

`LLM.generate` (chapter 04) owns the loop: it adds a batch, steps until the batch is done and
returns. A server cannot work that way. Requests arrive one by one from many connections, each
wants its tokens as soon as they exist, and a user who closes the tab must stop costing compute.
`AsyncLLM` (vLLM's name) turns the engine inside out: the loop runs by itself, in one background
thread, and requests come and go while it runs.

    asyncio event loop (HTTP, many coroutines)           engine thread (one, owns the engine)
    ------------------------------------------           ------------------------------------
    stream = llm.add_request(id, prompt, params)  --inbox-->  engine.add_request(...)
                                                             while work: outputs = engine.step()
    async for output in stream:       <--call_soon_threadsafe--  stream.queue.put(output)
        send it to the client
    client gone -> stream.close()  ---------inbox-->  engine.abort_request(id): blocks freed

Why a thread: `engine.step()` is one forward pass, milliseconds to seconds of blocking work. Run
on the event loop, it would freeze every connection for that long; in its own thread the event
loop keeps accepting requests and writing tokens while the model computes (PyTorch releases the
GIL inside its kernels). The engine is not thread-safe, so only the engine thread calls it: the
event loop hands it requests and aborts through an inbox, and it wakes up when the inbox fills.

Streams: each request has an `asyncio.Queue`. After every step the engine thread puts each
request's newest `RequestOutput` into its queue with `loop.call_soon_threadsafe` (the one safe
way into another thread's event loop). A stream ends with the output marked `finished`.

Cancellation: a consumer that stops iterating (the client disconnected, so the server's task is
cancelled) closes its stream, which aborts the request before the next step: its KV blocks go
back to the pool at once instead of after `max_tokens` tokens nobody reads.

Back-pressure: at most `max_waiting_requests` requests may wait for their first token; one more
raises `EngineOverloadedError` (the server answers 503) instead of growing a queue without bound.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from minivllm.config import EngineConfig
from minivllm.engine import make_engine
from minivllm.engine.llm_engine import Metric
from minivllm.outputs import RequestOutput
from minivllm.sample.sampling_params import SamplingParams

DEFAULT_MAX_WAITING_REQUESTS = 1024
T = TypeVar("T")


class StepListener(Protocol):
    """Told, on the engine thread, what every step produced and which requests were aborted;
    the server's latency metrics listen here."""

    def on_step(self, outputs: list[RequestOutput], now: float) -> None:
        """`now`: when the outputs came out (time.monotonic)."""

    def on_abort(self, request_ids: list[str]) -> None: ...


class EngineOverloadedError(RuntimeError):
    """Too many requests wait for their first token; the client should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or a step raised); no request can run."""


@dataclass
class RequestStream:
    """The outputs of one request, in the event loop that asked for them.

    Iterate it with `async for`; `close()` (also called when iteration is abandoned through
    `AsyncLLM.generate`) aborts the request if it has not finished."""

    request_id: str
    owner: AsyncLLM
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    started: bool = False  # has produced its first output
    finished: bool = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Stop the request if it is still running (idempotent)."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)

    # Called on the engine thread.
    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    """An engine stepped by a background thread, with one async stream per request."""

    def __init__(
        self, engine, max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS
    ) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.listeners: list[StepListener] = []
        self._streams: dict[str, RequestStream] = {}
        # The inbox: (request id, prompt, params, priority) to add, or request ids to abort.
        self._to_add: list[tuple[str, dict, SamplingParams, int]] = []
        self._to_abort: list[str] = []
        self._wakeup = threading.Condition()
        # Held around every engine call: the engine thread's steps, and metric reads from others.
        self._engine_lock = threading.Lock()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls, config: EngineConfig, max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS
    ) -> AsyncLLM:
        return cls(make_engine(config), max_waiting_requests)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_path(self):
        return self.engine.model_path

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
        return sum(not stream.started for stream in list(self._streams.values()))

    # --- the event loop's side ---

    def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
    ) -> RequestStream:
        """Validate a request now (ValueError/TypeError, nothing queued) and queue it for the
        engine thread; its outputs arrive on the returned stream. Call from a coroutine."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self._error
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"the server is busy: {self.num_waiting} requests are already waiting for their "
                f"first token (max_waiting_requests={self.max_waiting_requests}); retry later"
            )
        # The Processor only reads the tokenizer, so checking here does not touch the engine.
        processed, params = self.engine.processor.process_request(prompt, params)
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        self._streams[request_id] = stream
        with self._wakeup:
            self._to_add.append((request_id, processed.as_prompt(), params, priority))
            self._wakeup.notify()
        return stream

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
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.finished = True
        with self._wakeup:
            self._to_abort.append(request_id)
            self._wakeup.notify()

    def add_listener(self, listener: StepListener) -> None:
        self.listeners.append(listener)

    def call_engine(self, function: Callable[[Any], T]) -> T:
        """`function(engine)` between two steps, where the engine is safe to read. Blocks until
        the current step ends: from a coroutine, call it through asyncio.to_thread."""
        with self._engine_lock:
            return function(self.engine)

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics (see `call_engine` on blocking)."""
        return self.call_engine(lambda engine: engine.get_metrics())

    def shutdown(self) -> None:
        """Stop the loop, end every open stream with EngineDeadError, stop the engine."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join()
        self._fail_streams(EngineDeadError("the engine was shut down"))
        self.engine.shutdown()

    # --- the engine thread's side ---

    def _run(self) -> None:
        try:
            while self._wait_for_work():
                with self._engine_lock:
                    self._apply_inbox()
                    outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                self._deliver(outputs, time.monotonic())
        except BaseException as error:  # a failed step: every stream learns why
            self._error = error
            self._fail_streams(EngineDeadError(f"the engine loop failed: {error!r}"))

    def _wait_for_work(self) -> bool:
        """Sleep until there is something to do; False when shutting down."""
        with self._wakeup:
            while not (
                self._stopping
                or self._to_add
                or self._to_abort
                or self.engine.has_unfinished_requests()
            ):
                self._wakeup.wait()
            return not self._stopping

    def _apply_inbox(self) -> None:
        with self._wakeup:
            to_add, self._to_add = self._to_add, []
            to_abort, self._to_abort = self._to_abort, []
        for request_id, prompt, params, priority in to_add:
            if request_id not in self._streams:
                continue  # aborted before it reached the engine
            try:
                self.engine.add_request(request_id, prompt, params, priority=priority)
            except (ValueError, TypeError) as error:
                self._streams.pop(request_id).put_threadsafe(error)
        if to_abort:
            self.engine.abort_request(to_abort)
            for listener in self.listeners:
                listener.on_abort(to_abort)

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        for listener in self.listeners:
            listener.on_step(outputs, now)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while this step ran; its outputs are not wanted
            stream.started = True
            if output.finished:
                del self._streams[output.request_id]
            stream.put_threadsafe(output)

    def _fail_streams(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            if not stream.loop.is_closed():
                stream.put_threadsafe(error)
