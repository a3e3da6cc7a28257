"""Chapter 09 — the engine core: the loop that steps the engine, in a process of its own.

A server does two kinds of work. The front end parses HTTP, tokenizes, checks requests and
writes tokens back to many sockets; the engine core schedules and runs forward passes. In one
process they share one GIL, so every JSON body parsed is time the GPU waits, and every step is
time the clients wait. vLLM V1 therefore runs the core in its own process, a busy loop fed and
drained over ZMQ sockets; minivllm does the same:

    server process (AsyncLLM, front end)              engine-core process (EngineCoreProc)
    ------------------------------------              ------------------------------------
    Processor: tokenize, check          AddRequest
    MPClient.add_request   ---- input socket ---->    while True:
    MPClient.abort_requests    AbortRequests             apply every message that arrived
                               AbortSequences            step() if there is work
    output thread               <-- output socket --     send EngineCoreOutputs (deltas)
    -> OutputProcessor: text   EngineCoreOutputs
    -> RequestStreams: join

What crosses is plain data, as between scheduler and workers: a processed request (its token
ids and `SamplingParams`), request ids to abort, and each step's outputs as deltas (only the
new token ids and logprobs: engine/deltas.py). No text crosses. As in vLLM V1, the core
runs the server's requests with `detokenize=False` and without their stop strings, so it
checks only the rules that need no text (EOS, stop token ids, a complete grammar,
max_tokens, the context); the front end's output processor (engine/output_processor.py)
makes the text, checks the stop strings and tells the core to abort a sequence that one
ended. Detokenizing costs the core's process nothing, then.

Messages are pickled (pyzmq's `send_pyobj`). The alternative, msgspec, is faster but needs a
typed schema for every message; pickle sends the engine's own dataclasses (`SamplingParams`,
`RequestOutput`, exceptions) unchanged, exactly as chapter 07's data-parallel pipes do.
Unpickling runs code chosen by the sender, so the sockets are Unix sockets in a directory only
this user can open: the two ends are the same program, started by the same user.

`EngineCore` is the part both ways of running share: `AsyncLLM`'s in-process thread
(core_client.InprocClient) wraps one directly; `EngineCoreProc` adds the sockets and the loop.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from minivllm.config import EngineConfig
from minivllm.engine.data_parallel import (
    AddRequest,
    EngineCall,
    Failed,
    Ready,
    Shutdown,
    picklable_error,
)
from minivllm.engine.deltas import OutputDeltas
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput

# How long a closing core keeps trying to deliver its last messages (a Failed) to the front end.
CLOSE_LINGER_MS = 2000


# --- messages, besides chapter 07's AddRequest, EngineCall, Ready, Failed and Shutdown ---------


@dataclass
class AbortRequests:
    """Front end -> core: stop these requests and free their blocks."""

    request_ids: list[str]


@dataclass
class AbortSequences:
    """Front end -> core: stop single sequences (request id, index) of n > 1 requests whose
    other sequences go on (the front end found a stop string in them)."""

    sequences: list[tuple[str, int]]


@dataclass
class FunctionCall:
    """Front end -> core: call a function with the engine and send back a `CallResult`. The
    function travels pickled by name (a module-level function), kept as bytes so that one the
    core cannot import is an error for its caller, not for the core."""

    function: bytes
    args: tuple = ()


@dataclass
class CallResult:
    """Core -> front end: the answer to an `EngineCall(reply=True)` or a `FunctionCall`."""

    value: Any = None
    error: BaseException | None = None


@dataclass
class EngineCoreOutputs:
    """Core -> front end, after a step: the step's outputs as deltas (token ids and logprobs,
    no text), the requests that `add_request` refused (with their error: that request fails,
    not the engine), when the step ended (time.monotonic, one clock for every process of the
    machine), and the core's load for the data-parallel router."""

    outputs: list[RequestOutput]
    errors: dict[str, BaseException] = field(default_factory=dict)
    timestamp: float = 0.0
    num_waiting: int = 0
    num_running: int = 0
    num_received: int = 0  # sequences of all AddRequests handled so far


# What the front end sends about requests (the rest are calls: EngineCall, FunctionCall).
CoreRequest = AddRequest | AbortRequests | AbortSequences


# --- the core, wherever it runs ------------------------------------------------------------------


class EngineCore:
    """An engine (`LLMEngine`, or anything with its calls) and the bookkeeping that turns its
    work into `EngineCoreOutputs`. Not thread-safe: one thread owns it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.deltas = OutputDeltas()
        self.errors: dict[str, BaseException] = {}  # refused since the last step
        self.num_received = 0

    def handle(self, message: CoreRequest) -> None:
        if isinstance(message, AddRequest):
            self.add_request(message)
        elif isinstance(message, AbortRequests):
            self.abort_requests(message.request_ids)
        else:
            self.engine.abort_sequences(message.sequences)

    def add_request(self, request: AddRequest) -> None:
        self.num_received += request.params.n
        try:
            self.engine.add_request(
                request.request_id, request.prompt, request.params, priority=request.priority
            )
        except Exception as error:  # a grammar that does not compile, a tokenizer quirk, ...
            self.errors[request.request_id] = picklable_error(error)
            return
        self.deltas.add(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
        self.deltas.forget(request_ids)
        for request_id in request_ids:
            self.errors.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.errors) or self.engine.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """One engine step (if requests are unfinished); its outputs as deltas."""
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        errors, self.errors = self.errors, {}
        return EngineCoreOutputs(self.deltas.split(outputs), errors, time.monotonic())


class EngineCoreProc(EngineCore):
    """The core in its own process: a busy loop over the input and output sockets."""

    def __init__(self, engine, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        super().__init__(engine)
        self.inputs, self.outputs = inputs, outputs

    def run_busy_loop(self) -> None:
        """Apply every message that arrived (wait for one when idle), then step if there is
        work and send what it produced; until a Shutdown."""
        while True:
            for message in self.receive(block=not self.has_work()):
                if isinstance(message, Shutdown):
                    return
                self.apply(message)
            if self.has_work():
                report = self.step()
                if report.outputs or report.errors:
                    scheduler = self.engine.scheduler
                    report.num_waiting, report.num_running = (
                        len(scheduler.waiting),
                        len(scheduler.running),
                    )
                    report.num_received = self.num_received
                    self.outputs.send_pyobj(report)

    def receive(self, block: bool) -> list:
        messages = [self.inputs.recv_pyobj()] if block else []
        while True:
            try:
                messages.append(self.inputs.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return messages

    def apply(self, message) -> None:
        if isinstance(message, CoreRequest):
            self.handle(message)
            return
        result = self.call(message)
        if isinstance(message, FunctionCall) or message.reply:
            self.outputs.send_pyobj(result)

    def call(self, message: EngineCall | FunctionCall) -> CallResult:
        """A call between two steps; an exception goes back to the caller, the core lives on."""
        try:
            if isinstance(message, FunctionCall):
                value = pickle.loads(message.function)(self.engine, *message.args)
            else:
                value = getattr(self.engine, message.method)(*message.args)
            pickle.dumps(value)  # a result that cannot travel is the caller's error too
            return CallResult(value)
        except Exception as error:
            return CallResult(error=picklable_error(error))


def exit_when_parent_dies() -> None:
    """A core whose server was killed outright (SIGKILL runs no cleanup) must not live on as an
    orphan. The parent's sentinel, which multiprocessing hands every spawned child, becomes
    readable when the parent exits, even one that died while this process was still starting
    (a watch that polls os.getppid() from here on would take the adoptive parent for ours)."""
    sentinel = multiprocessing.parent_process().sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def run_engine_core(
    config: EngineConfig, input_address: str, output_address: str, num_threads: int
) -> None:
    """The body of the engine-core process: build the engine, say Ready, run the loop. An
    exception is sent as `Failed` before the process exits; a parent that dies takes the
    process with it."""
    # Ctrl-C reaches every process of the terminal; the server handles it and stops the core.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_when_parent_dies()
    torch.set_num_threads(num_threads)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    engine = None
    try:
        engine = LLMEngine(config)
        outputs.send_pyobj(Ready(engine.max_model_len))
        EngineCoreProc(engine, inputs, outputs).run_busy_loop()
    except Exception as error:
        outputs.send_pyobj(Failed(picklable_error(error), traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if engine is not None:
            engine.shutdown()  # its tensor-parallel workers, if any
        inputs.close(linger=0)
        outputs.close(linger=CLOSE_LINGER_MS)
        context.term()
