"""Chapter 09 — how the front end reaches the engine core: in a thread, or in other processes.

`AsyncLLM` talks to the core through an `EngineCoreClient` (vLLM's name) and does not care
where the core runs:

- `InprocClient`: the core in a background thread of this process. The engine is not
  thread-safe, so only that thread calls it: requests and aborts go through an inbox, and the
  thread wakes up when the inbox fills. Offline tools and tests with fake engines use it.
- `MPClient`: the core in a process of its own (engine/core.py), one per data-parallel
  replica, reached over ZMQ sockets. Sending a request or an abort never waits for a step:
  ZMQ queues the message and the core reads it between two steps. An output thread receives
  every core's outputs and watches the processes, so a core that dies is an error at once.

Both call `on_outputs(EngineCoreOutputs)` from their own thread after every step, and
`on_failure(error)` once if the core stops.

Core processes are started with multiprocessing's "spawn" method (a fresh interpreter, no
forked torch or CUDA state), so a script that builds `AsyncLLM.from_config(...)` at top level
needs the usual `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import atexit
import multiprocessing
import pickle
import shutil
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import zmq

from minivllm.config import EngineConfig
from minivllm.core.prefix_cache import hash_blocks
from minivllm.engine.core import (
    AbortRequests,
    AbortSequences,
    CallResult,
    CoreRequest,
    EngineCore,
    EngineCoreOutputs,
    FunctionCall,
    run_engine_core,
)
from minivllm.engine.data_parallel import (
    AddRequest,
    EngineCall,
    Failed,
    PrefixAffinity,
    Ready,
    RemoteTraceback,
    ReplicaLoad,
    Shutdown,
    aggregate_metrics,
    choose_replica,
    replica_device,
    stop_processes,
)
from minivllm.engine.llm_engine import Metric
from minivllm.engine.processor import Processor
from minivllm.executor.multiproc import STARTUP_TIMEOUT_S, fair_share_of_threads
from minivllm.models.loader import load_model_config, load_tokenizer, resolve_model_path

OutputHandler = Callable[[EngineCoreOutputs], None]
FailureHandler = Callable[[BaseException], None]


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or a step raised); no request can run."""


class EngineCoreClient(ABC):
    """The front end's handle on the engine core. `tokenizer`, `processor`, `max_model_len`
    and `model_path` are what the front end needs to check and answer requests itself."""

    tokenizer: Any
    processor: Processor
    max_model_len: int
    model_path: Any

    @abstractmethod
    def start(self, on_outputs: OutputHandler, on_failure: FailureHandler) -> None:
        """Start delivering: `on_outputs` after every step, `on_failure` once if the core
        stops. Both run on a thread of the client's."""

    @abstractmethod
    def add_request(self, request: AddRequest) -> None:
        """Queue a processed request; never waits for a step."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop requests before the core's next step; never waits for a step."""

    @abstractmethod
    def abort_sequences(self, sequences: list[tuple[str, int]]) -> None:
        """Stop single sequences (request id, index) of requests whose other sequences go
        on, as `abort_requests` does requests."""

    @abstractmethod
    def call_engine(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(engine, *args)` between two steps, and its result; blocks until then."""

    @abstractmethod
    def get_replica_metrics(self) -> list[list[Metric]]:
        """Each engine core's metrics (one list without data parallelism); blocks as above."""

    def get_metrics(self) -> list[Metric]:
        per_replica = self.get_replica_metrics()
        return per_replica[0] if len(per_replica) == 1 else aggregate_metrics(per_replica)

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the core (idempotent); no thread or process is left behind."""


# --- the core in a thread of this process --------------------------------------------------------


class InprocClient(EngineCoreClient):
    """The core stepped by a background thread, fed through an inbox."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.core = EngineCore(engine)
        self._inbox: list[CoreRequest] = []
        self._wakeup = threading.Condition()
        # Held around every engine call: the thread's steps, and calls from other threads.
        self._engine_lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # The engine's own answers (read when asked: a test's fake engine may lack some).
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def processor(self) -> Processor:
        return self.engine.processor

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_path(self):
        return self.engine.model_path

    def start(self, on_outputs: OutputHandler, on_failure: FailureHandler) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(on_outputs, on_failure), name="minivllm-engine", daemon=True
        )
        self._thread.start()

    def add_request(self, request: AddRequest) -> None:
        self._post(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._post(AbortRequests(request_ids))

    def abort_sequences(self, sequences: list[tuple[str, int]]) -> None:
        self._post(AbortSequences(sequences))

    def _post(self, message: CoreRequest) -> None:
        with self._wakeup:
            self._inbox.append(message)
            self._wakeup.notify()

    def call_engine(self, function: Callable[..., Any], *args: Any) -> Any:
        with self._engine_lock:
            return function(self.engine, *args)

    def get_replica_metrics(self) -> list[list[Metric]]:
        if hasattr(self.engine, "get_replica_metrics"):  # chapter 07's DataParallelEngine
            return self.call_engine(lambda engine: engine.get_replica_metrics())
        return [self.call_engine(lambda engine: engine.get_metrics())]

    def shutdown(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()
        self.engine.shutdown()

    # --- the engine thread ---

    def _run(self, on_outputs: OutputHandler, on_failure: FailureHandler) -> None:
        try:
            while self._wait_for_work():
                with self._engine_lock:
                    for message in self._take_inbox():
                        self.core.handle(message)
                    report = self.core.step() if self.core.has_work() else None
                if report is not None and (report.outputs or report.errors):
                    on_outputs(report)
        except BaseException as error:  # a failed step: the front end tells every stream
            on_failure(error)

    def _wait_for_work(self) -> bool:
        """Sleep until there is something to do; False when shutting down."""
        with self._wakeup:
            while not (self._stopping or self._inbox or self.core.has_work()):
                self._wakeup.wait()
            return not self._stopping

    def _take_inbox(self) -> list[CoreRequest]:
        with self._wakeup:
            messages, self._inbox = self._inbox, []
        return messages


# --- the core in processes of its own -----------------------------------------------------------


@dataclass
class CoreProcess(ReplicaLoad):
    """One engine-core process: its sockets, its calls awaiting a reply (answered in order)
    and, with data parallelism, its load as the router knows it."""

    index: int = 0
    process: Any = None
    inputs: Any = None  # zmq PUSH socket, front end -> core
    outputs: Any = None  # zmq PULL socket, core -> front end
    calls: deque[Future] = field(default_factory=deque)

    def died(self) -> EngineDeadError:
        self.process.join(timeout=5)  # reap it, so the exit code is known
        return EngineDeadError(
            f"the engine core process {self.index} (pid {self.process.pid}) died with exit "
            f"code {self.process.exitcode}"
        )


@dataclass
class CoreProcesses:
    """Everything a shutdown needs, apart from the client (so a finalizer can run it)."""

    context: Any  # zmq.Context
    ipc_dir: str
    cores: list[CoreProcess] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    output_thread: threading.Thread | None = None
    closing: bool = False
    failure: BaseException | None = None  # why the cores stopped serving

    def shutdown(self) -> None:
        """Ask every core to stop, wait, then terminate/kill; close the sockets."""
        with self.lock:
            already_closing, self.closing = self.closing, True
        if already_closing:
            return
        for core in self.cores:
            try:
                core.inputs.send_pyobj(Shutdown(), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # it is gone already
        stop_processes([core.process for core in self.cores])
        if self.output_thread is not None and self.output_thread is not threading.current_thread():
            self.output_thread.join()
        for core in self.cores:
            core.inputs.close(linger=0)
            core.outputs.close(linger=0)
        self.context.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


class MPClient(EngineCoreClient):
    """`config.data_parallel_size` engine-core processes (one without data parallelism)."""

    def __init__(self, config: EngineConfig) -> None:
        # Resolved once, here: the embedded model is converted on first use, and the cores
        # must not race to convert it.
        self.model_path = resolve_model_path(config.model)
        core_config = replace(config, model=str(self.model_path), data_parallel_size=1)
        num_cores = config.data_parallel_size
        # A private directory (mode 0700) for the sockets: only this user can send us pickles.
        self.state = CoreProcesses(zmq.Context(), tempfile.mkdtemp(prefix="minivllm-core-"))
        # Core processes are not daemons (a core may start tensor-parallel workers), so the
        # finalizer stops them on shutdown(), garbage collection or interpreter exit.
        self._finalizer = weakref.finalize(self, self.state.shutdown)
        atexit.register(self._finalizer)
        try:
            threads = fair_share_of_threads(num_cores)
            for index in range(num_cores):
                self.state.cores.append(
                    self._start_core(index, replica_device(core_config, index), threads)
                )
            # The front end tokenizes and checks requests itself, while the cores load models.
            self.tokenizer = load_tokenizer(self.model_path)
            vocab_size = load_model_config(self.model_path).vocab_size
            self.max_model_len = min(wait_until_ready(core) for core in self.state.cores)
        except BaseException:
            self.shutdown()
            raise
        self.processor = Processor(self.tokenizer, vocab_size, self.max_model_len)
        self.block_size = config.block_size
        # Unfinished request -> its core. AsyncLLM never uses a request id twice (a caller's
        # id used again is another id for the core), so a late final report of an aborted
        # request cannot take the route of a request that came after it.
        self.request_core: dict[str, CoreProcess] = {}
        self.prefix_affinity = PrefixAffinity(config.block_size) if num_cores > 1 else None

    def _start_core(self, index: int, config: EngineConfig, num_threads: int) -> CoreProcess:
        addresses = [f"ipc://{self.state.ipc_dir}/{name}-{index}" for name in ("in", "out")]
        inputs = self.state.context.socket(zmq.PUSH)
        outputs = self.state.context.socket(zmq.PULL)
        try:
            inputs.setsockopt(zmq.SNDHWM, 0)  # never drop or refuse a message: queue it
            inputs.bind(addresses[0])
            outputs.setsockopt(zmq.RCVHWM, 0)
            outputs.bind(addresses[1])
            process = multiprocessing.get_context("spawn").Process(
                target=run_engine_core,
                args=(config, *addresses, num_threads),
                name=f"minivllm-engine-core-{index}",
                daemon=False,
            )
            process.start()
        except BaseException:
            # Not a core of state.cores yet, so shutdown() would not close these, and its
            # context.term() waits for every socket of the context: the start-up error would
            # become a hang.
            inputs.close(linger=0)
            outputs.close(linger=0)
            raise
        return CoreProcess(index=index, process=process, inputs=inputs, outputs=outputs)

    @property
    def cores(self) -> list[CoreProcess]:
        return self.state.cores

    def start(self, on_outputs: OutputHandler, on_failure: FailureHandler) -> None:
        self.state.output_thread = threading.Thread(
            target=self._receive_outputs,
            args=(on_outputs, on_failure),
            name="minivllm-core-outputs",
            daemon=True,
        )
        self.state.output_thread.start()

    # --- the front end's calls (from the event loop and from other threads) ---

    def add_request(self, request: AddRequest) -> None:
        with self.state.lock:
            core = self._route(request)
            core.num_sent += request.params.n
            self.request_core[request.request_id] = core
            self._send(core, request)

    def _route(self, request: AddRequest) -> CoreProcess:
        """Chapter 07's router: the least loaded core, preferring the one that holds the
        prompt's prefix."""
        affinity = self.prefix_affinity
        if affinity is None:
            return self.cores[0]
        prompt = request.prompt
        hashes = hash_blocks(prompt["prompt_token_ids"], self.block_size, prompt.get("cache_salt"))
        preferred = affinity.preferred_replica(hashes)
        core = self.cores[choose_replica([c.load for c in self.cores], preferred)]
        affinity.remember(hashes, core.index)
        return core

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send_to_owners(AbortRequests, [(rid, rid) for rid in request_ids], forget=True)

    def abort_sequences(self, sequences: list[tuple[str, int]]) -> None:
        self._send_to_owners(AbortSequences, [(rid, (rid, i)) for rid, i in sequences])

    def _send_to_owners(
        self, message: Callable[[list], Any], items: list[tuple[str, Any]], forget: bool = False
    ) -> None:
        """Send each core `message(items)` for the items (request id, item) of its requests;
        `forget`: the requests are gone from the router too."""
        with self.state.lock:
            by_core: dict[int, list] = {}
            for request_id, item in items:
                if forget:
                    core = self.request_core.pop(request_id, None)
                else:
                    core = self.request_core.get(request_id)
                if core is not None:
                    by_core.setdefault(core.index, []).append(item)
            for index, batch in by_core.items():
                try:
                    self._send(self.cores[index], message(batch))
                except EngineDeadError:
                    pass  # its requests died with it; the output thread reports the death

    def call_engine(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(engine, *args)` in the engine-core process: `function` must pickle by name
        (a module-level function, not a lambda). Needs a single core."""
        if len(self.cores) > 1:
            raise ValueError(
                "call_engine needs a single engine core; with data parallelism use "
                "get_replica_metrics()"
            )
        return self._call_all(FunctionCall(pickle.dumps(function), args))[0]

    def get_replica_metrics(self) -> list[list[Metric]]:
        return self._call_all(EngineCall("get_metrics", reply=True))

    def _call_all(self, message: EngineCall | FunctionCall) -> list[Any]:
        """Send `message` to every core; their results in core order. A core that dies before
        it answers fails the call with EngineDeadError instead of leaving it waiting."""
        futures = []
        with self.state.lock:
            for core in self.cores:
                future: Future = Future()
                if self.state.failure is not None or self.state.closing:
                    raise EngineDeadError("the engine core is not running") from self.state.failure
                core.calls.append(future)
                self._send(core, message)
                futures.append(future)
        return [future.result() for future in futures]

    def _send(self, core: CoreProcess, message: Any) -> None:
        """Queue a message for a core (hold state.lock: zmq sockets are not thread-safe). ZMQ
        queues without limit, so this only waits while the core is not connected, that is,
        dead: then it raises."""
        while True:
            try:
                core.inputs.send_pyobj(message, zmq.NOBLOCK)
                return
            except zmq.Again:
                if not core.process.is_alive():
                    raise core.died() from None
                core.inputs.poll(100, zmq.POLLOUT)

    def shutdown(self) -> None:
        self._finalizer()
        atexit.unregister(self._finalizer)

    # --- the output thread ---

    def _receive_outputs(self, on_outputs: OutputHandler, on_failure: FailureHandler) -> None:
        """Every core's messages, as they come; a core that exits (its process sentinel wakes
        the poll) ends the engine with EngineDeadError, unless we are shutting down."""
        poller = zmq.Poller()
        for core in self.cores:
            poller.register(core.outputs, zmq.POLLIN)
            poller.register(core.process.sentinel, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                for core in self.cores:
                    self._read_available(core, on_outputs)
                for core in self.cores:
                    if core.process.sentinel in ready:
                        if self.state.closing:
                            return
                        self._read_available(core, on_outputs)  # a last Failed, if any
                        raise core.died()
        except BaseException as error:
            with self.state.lock:
                if self.state.closing:
                    return
                self.state.failure = error
                for core in self.cores:
                    for future in core.calls:
                        future.set_exception(EngineDeadError(f"the engine stopped: {error}"))
                    core.calls.clear()
            on_failure(error)

    def _read_available(self, core: CoreProcess, on_outputs: OutputHandler) -> None:
        while True:
            try:
                message = core.outputs.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            if isinstance(message, EngineCoreOutputs):
                self._take_report(core, message)
                on_outputs(message)
            elif isinstance(message, CallResult):
                with self.state.lock:
                    future = core.calls.popleft()
                if message.error is None:
                    future.set_result(message.value)
                else:
                    future.set_exception(message.error)
            elif isinstance(message, Failed):
                error = message.error
                error.__cause__ = RemoteTraceback(message.traceback)
                raise EngineDeadError(
                    f"the engine core {core.index} failed: {type(error).__name__}: {error}"
                ) from error

    def _take_report(self, core: CoreProcess, report: EngineCoreOutputs) -> None:
        with self.state.lock:
            core.waiting, core.running = report.num_waiting, report.num_running
            core.num_received = report.num_received
            ended = [o.request_id for o in report.outputs if o.finished] + list(report.errors)
            for request_id in ended:
                if self.request_core.get(request_id) is core:
                    del self.request_core[request_id]


def wait_until_ready(core: CoreProcess) -> int:
    """The core's max_model_len once its engine is built; its exception if building failed,
    an error if the process exits or takes longer than STARTUP_TIMEOUT_S."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not core.outputs.poll(100):
        if not core.process.is_alive():
            raise core.died()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine core did not start in {STARTUP_TIMEOUT_S} s")
    message = core.outputs.recv_pyobj()
    if isinstance(message, Failed):
        message.error.__cause__ = RemoteTraceback(message.traceback)
        raise message.error
    assert isinstance(message, Ready), message
    return message.max_model_len
