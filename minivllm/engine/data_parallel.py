"""Chapter 07 — data parallelism: M copies of the engine behind one front end.

Tensor parallelism splits *one* model across devices. Data parallelism is the other way to use
more hardware: run M complete engines ("replicas"), each in its own process with its own model,
KV pool and scheduler, and give every new request to one of them. Throughput grows with M; a
single request is no faster, because it still runs on one replica.

    llm = LLM(data_parallel_size=2)      # LLM builds a DataParallelEngine instead of an LLMEngine

`DataParallelEngine` answers the calls `LLM` makes on an `LLMEngine` (add_request, step, ...).
Behind them it talks to each replica over a pipe, in plain picklable data:

    front end --- AddRequest, EngineCall(abort / metrics / ...), Shutdown --->  replica i
              <-- StepReport(outputs, waiting, running), Reply, Failed -----  (LLMEngine loop)

The router is vLLM's rule: a new request goes to the replica with the lowest score
`4 * waiting + running`. A waiting request weighs more than a running one because it still
owes its whole prefill and it is queued behind everything else. Every replica has its own prefix
cache, so cached blocks only help on the replica that computed them: when scores tie, the
router prefers the replica that last received the longest prefix of the new prompt, in whole KV
blocks (prefix affinity), so the turns of a conversation keep hitting the same cache.

Behind the server (chapter 09) the replicas are engine-core processes instead, reached over ZMQ
by `engine/core_client.MPClient` with the same router, so that a request or an abort never
waits for a replica's step; `DataParallelEngine.step()` may wait, since `LLM.generate` has
nothing else to do meanwhile.

Replicas are started with multiprocessing's "spawn" method, so a script that builds
`LLM(data_parallel_size=M)` needs the usual `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import atexit
import multiprocessing
import pickle
import queue
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from multiprocessing import connection
from multiprocessing.connection import Connection
from typing import Any

import torch

from minivllm.config import EngineConfig, resolve_device
from minivllm.core.prefix_cache import BlockHash, hash_blocks
from minivllm.engine.llm_engine import LLMEngine, Metric
from minivllm.engine.processor import Processor
from minivllm.executor.multiproc import fair_share_of_threads
from minivllm.models.loader import load_model_config, load_tokenizer, resolve_model_path
from minivllm.outputs import RequestOutput
from minivllm.sample.sampling_params import SamplingParams

# A waiting request counts four times a running one in a replica's load (vLLM's weight).
WAITING_WEIGHT = 4
# Prefix affinity remembers this many prompt blocks; the least recent is forgotten first.
MAX_REMEMBERED_BLOCKS = 65536
# How long shutdown() waits for replicas to stop by themselves before terminating them.
SHUTDOWN_TIMEOUT_S = 5.0


# --- routing: pure functions ------------------------------------------------------------------


def load_score(waiting: int, running: int) -> int:
    return WAITING_WEIGHT * waiting + running


def choose_replica(loads: Sequence[tuple[int, int]], preferred: int | None = None) -> int:
    """The replica a new request goes to, given each replica's (waiting, running) load: the
    lowest score; among equal scores the `preferred` one (prefix affinity), else the first."""
    scores = [load_score(waiting, running) for waiting, running in loads]
    best = min(scores)
    if preferred is not None and scores[preferred] == best:
        return preferred
    return scores.index(best)


class PrefixAffinity:
    """Which replica last received each prompt block, by chapter 05's chained block hashes:
    for a new prompt, the replica that holds its longest prefix, as far as the router knows
    (it may have evicted it since: affinity is a guess, never a correctness matter).

    A shared system prompt alone would send every request of every conversation to one
    replica if the router matched on the first block only; the longest match tells the
    conversations apart."""

    def __init__(self, block_size: int, capacity: int = MAX_REMEMBERED_BLOCKS):
        self.block_size = block_size
        self.capacity = capacity
        self.owner: dict[BlockHash, int] = {}  # block hash -> replica, least recent first

    def preferred_replica(self, hashes: list[BlockHash]) -> int | None:
        for block_hash in reversed(hashes):  # the longest known prefix first
            if block_hash in self.owner:
                return self.owner[block_hash]
        return None

    def remember(self, hashes: list[BlockHash], replica: int) -> None:
        for block_hash in hashes:
            self.owner.pop(block_hash, None)  # re-inserted last: the most recent
            self.owner[block_hash] = replica
        while len(self.owner) > self.capacity:
            del self.owner[next(iter(self.owner))]


# --- messages: plain data that crosses the pipes ----------------------------------------------


@dataclass
class AddRequest:
    """Front end -> replica. The prompt was already processed (and checked) by the front end."""

    request_id: str
    prompt: dict  # {"prompt": text or None, "prompt_token_ids": [...], "cache_salt": ...}
    params: SamplingParams
    priority: int = 0


@dataclass
class EngineCall:
    """Front end -> replica: call `engine.<method>(*args)`; send back a `Reply` if `reply`
    (an engine core, chapter 09, answers with a `CallResult`)."""

    method: str
    args: tuple = ()
    reply: bool = False


@dataclass
class Shutdown:
    """Front end -> replica: stop serving and exit."""


@dataclass
class Ready:
    """Replica -> front end, once: the engine is built; how long a sequence it takes."""

    max_model_len: int


@dataclass
class StepReport:
    """Replica -> front end, after every step: the step's outputs and the replica's load."""

    outputs: list[RequestOutput]
    num_waiting: int
    num_running: int
    num_received: int  # sequences of all AddRequests handled so far (the router's bookkeeping)


@dataclass
class Reply:
    """Replica -> front end: the result of an `EngineCall` with `reply=True`."""

    value: Any


@dataclass
class Failed:
    """Replica -> front end: an exception ended the replica (the traceback as text)."""

    error: BaseException
    traceback: str


# --- the replica process ----------------------------------------------------------------------


def run_replica(config: EngineConfig, conn: Connection, num_threads: int) -> None:
    """The body of one replica process: build an engine, then serve the front end until it
    says stop or goes away."""
    # Ctrl-C in a terminal reaches every process of the group; only the front end handles it
    # (it aborts the requests and shuts the replicas down).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(num_threads)  # M replicas share the cores, not oversubscribe them
    inbox = start_inbox(conn)
    engine = None
    try:
        engine = LLMEngine(config)
        conn.send(Ready(engine.max_model_len))
        serve(engine, conn, inbox)
    except ConnectionError:
        pass  # a send found the front end gone: there is nobody left to serve
    except Exception as error:
        report_failure(conn, error)
        raise SystemExit(1) from None
    finally:
        # An engine with worker processes of its own (tensor parallelism) must stop them too.
        if engine is not None:
            engine.shutdown()
        conn.close()


def start_inbox(conn: Connection) -> queue.SimpleQueue:
    """Receive the front end's messages in a thread, into a queue the engine loop reads
    between steps. The front end's sends never wait on a busy replica, so the two can't
    deadlock with both blocked in `send`. When the pipe closes (the front end exited or was
    killed), the thread posts a `Shutdown`, so no replica outlives its front end."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def receive_forever() -> None:
        while True:
            try:
                inbox.put(conn.recv())
            except (EOFError, OSError):
                inbox.put(Shutdown())
                return

    threading.Thread(target=receive_forever, name="front-end-inbox", daemon=True).start()
    return inbox


def serve(engine: LLMEngine, conn: Connection, inbox: queue.SimpleQueue) -> None:
    """The replica's loop: handle every message that arrived, then step if there is work.
    With no work, block until the front end sends something."""
    num_received = 0
    while True:
        messages = [inbox.get()] if not engine.has_unfinished_requests() else []
        messages += drain(inbox)
        for message in messages:
            if isinstance(message, Shutdown):
                return
            if isinstance(message, AddRequest):
                engine.add_request(
                    message.request_id, message.prompt, message.params, priority=message.priority
                )
                num_received += message.params.n
            else:
                result = getattr(engine, message.method)(*message.args)
                if message.reply:
                    conn.send(Reply(result))
        if engine.has_unfinished_requests():
            outputs = engine.step()
            scheduler = engine.scheduler
            conn.send(
                StepReport(outputs, len(scheduler.waiting), len(scheduler.running), num_received)
            )


def drain(inbox: queue.SimpleQueue) -> list:
    messages = []
    while True:
        try:
            messages.append(inbox.get_nowait())
        except queue.Empty:
            return messages


def report_failure(conn: Connection, error: BaseException) -> None:
    """Send the exception itself, so the front end raises the same type with the same message."""
    try:
        conn.send(Failed(picklable_error(error), traceback.format_exc()))
    except OSError:
        pass  # the front end is gone; nobody is left to tell


def picklable_error(error: BaseException) -> BaseException:
    """The exception itself if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


# --- the front end ----------------------------------------------------------------------------


class RemoteTraceback(Exception):
    """Where a replica's exception was raised, shown as the cause of the one the front end
    re-raises (concurrent.futures does the same for its worker processes)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\n{self.text}"


@dataclass
class ReplicaLoad:
    """What the router knows of one replica's load."""

    waiting: int = 0  # from its last StepReport
    running: int = 0
    num_sent: int = 0  # sequences sent to it, ever
    num_received: int = 0  # sequences it had received at its last StepReport

    @property
    def load(self) -> tuple[int, int]:
        """(waiting, running) as the router sees them: the last report, plus the sequences
        sent since that the replica had not received yet, counted as waiting."""
        return self.waiting + self.num_sent - self.num_received, self.running


@dataclass
class Replica(ReplicaLoad):
    """The front end's handle on one replica: its process, its pipe and its load."""

    index: int = 0
    process: multiprocessing.process.BaseProcess | None = None
    conn: Connection | None = None

    def failed(self, failure: Failed) -> RuntimeError:
        error = RuntimeError(
            f"data-parallel replica {self.index} failed: "
            f"{type(failure.error).__name__}: {failure.error}"
        )
        error.__cause__ = failure.error
        failure.error.__cause__ = RemoteTraceback(failure.traceback)
        return error

    def died(self) -> RuntimeError:
        self.process.join(timeout=5)  # reap it, so the exit code is known
        return RuntimeError(
            f"data-parallel replica {self.index} (pid {self.process.pid}) died with exit code "
            f"{self.process.exitcode}"
        )


class DataParallelEngine:
    """`config.data_parallel_size` engine replicas, each in its own process, behind the calls
    `LLM` makes on one `LLMEngine`."""

    def __init__(self, config: EngineConfig):
        self.config = config
        # Resolved once, here: the embedded model is converted on first use, and M replicas
        # must not race to convert it.
        self.model_path = resolve_model_path(config.model)
        num_replicas = config.data_parallel_size
        replica_config = replace(config, model=str(self.model_path), data_parallel_size=1)
        num_threads = fair_share_of_threads(num_replicas)
        self.replicas: list[Replica] = []
        # Replicas are not daemons (a replica may start tensor-parallel workers of its own), so
        # nothing stops them for us: `del llm`, garbage collection and interpreter exit all
        # run this finalizer. It is also registered with atexit now, because multiprocessing's
        # own exit hook joins every non-daemonic child and must find them already stopped
        # (atexit runs the latest registration first).
        self._finalizer = weakref.finalize(self, shutdown_replicas, self.replicas)
        atexit.register(self._finalizer)
        try:
            for index in range(num_replicas):
                self.replicas.append(
                    start_replica(index, replica_device(replica_config, index), num_threads)
                )
            # The front end needs the tokenizer too; it loads it while the replicas load models.
            self.tokenizer = load_tokenizer(self.model_path)
            self.model_config = load_model_config(self.model_path)
            max_model_lens = [wait_until_ready(replica) for replica in self.replicas]
        except BaseException:
            self.shutdown()
            raise
        # Replicas agree on everything but possibly their pool size; a request must fit anywhere.
        self.max_model_len = min(max_model_lens)
        self.processor = Processor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.request_replica: dict[str, Replica] = {}  # unfinished request id -> its replica
        # Prefer, among equally loaded replicas, the one that holds a prompt's prefix; switch it
        # off to measure what it buys.
        self.prefix_affinity: PrefixAffinity | None = PrefixAffinity(config.block_size)
        self.pending: list[RequestOutput] = []  # outputs read while waiting for a Reply

    @classmethod
    def from_config(cls, config: EngineConfig) -> DataParallelEngine:
        return cls(config)

    # --- requests ---

    def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
    ) -> None:
        """Validate a request here (ValueError/TypeError, nothing sent), then route it."""
        if request_id in self.request_replica:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed, params = self.processor.process_request(prompt, params)

        affinity, preferred = self.prefix_affinity, None
        if affinity is not None:
            hashes = hash_blocks(processed.token_ids, self.config.block_size, processed.cache_salt)
            preferred = affinity.preferred_replica(hashes)
        replica = self.replicas[choose_replica([r.load for r in self.replicas], preferred)]
        send(replica, AddRequest(request_id, processed.as_prompt(), params, priority))
        replica.num_sent += params.n
        self.request_replica[request_id] = replica
        if affinity is not None:
            affinity.remember(hashes, replica.index)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests wherever they are; unknown or finished ids are ignored."""
        request_ids = [request_id] if isinstance(request_id, str) else request_id
        self._call_owners("abort_request", [(rid, rid) for rid in request_ids], forget=True)

    def abort_sequences(self, sequences: list[tuple[str, int]]) -> None:
        """Stop single sequences (request id, index): LLMEngine.abort_sequences."""
        self._call_owners("abort_sequences", [(rid, (rid, i)) for rid, i in sequences])

    def _call_owners(self, method: str, items: list[tuple[str, Any]], forget: bool = False) -> None:
        """Call `method` on each replica with the items (request id, item) of its requests;
        `forget`: the requests are gone from the router too."""
        by_replica: dict[int, list] = {}
        for request_id, item in items:
            if forget:
                replica = self.request_replica.pop(request_id, None)
            else:
                replica = self.request_replica.get(request_id)
            if replica is not None:
                by_replica.setdefault(replica.index, []).append(item)
        for index, batch in by_replica.items():
            try:
                self.replicas[index].conn.send(EngineCall(method, (batch,)))
            except OSError:
                pass  # a dead replica's requests are gone already

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_replica) or bool(self.pending)

    def get_num_unfinished_requests(self) -> int:
        """Requests not finished yet (LLMEngine counts their sequences; n > 1 counts once here)."""
        return len(self.request_replica)

    # --- the loop ---

    def step(self) -> list[RequestOutput]:
        """The outputs the replicas sent since the last call; waits until there is at least
        one while requests are unfinished. A replica that died raises RuntimeError."""
        outputs, self.pending = self.pending, []
        while not outputs and self.request_replica:
            # Sleep until a replica sends something or a replica process ends (its sentinel).
            handles = [h for r in self.replicas for h in (r.conn, r.process.sentinel)]
            ready = connection.wait(handles)
            for replica in self.replicas:
                if replica.conn in ready or replica.process.sentinel in ready:
                    outputs += self.read_available(replica)
        return outputs

    def read_available(self, replica: Replica) -> list[RequestOutput]:
        """Handle every message the replica has sent so far; its outputs."""
        outputs: list[RequestOutput] = []
        if not replica.conn.poll():
            raise replica.died()  # woken by its process sentinel with nothing to read
        while replica.conn.poll():
            message = receive(replica)
            if isinstance(message, StepReport):
                outputs += self.take_report(replica, message)
            elif isinstance(message, Failed):
                raise replica.failed(message)
            # A stray Reply belongs to a call interrupted by Ctrl-C; nobody waits for it.
        return outputs

    def take_report(self, replica: Replica, report: StepReport) -> list[RequestOutput]:
        replica.waiting, replica.running = report.num_waiting, report.num_running
        replica.num_received = report.num_received
        # Outputs of requests aborted while this step ran are dropped, as LLMEngine never
        # returns one after an abort.
        outputs = [o for o in report.outputs if self.request_replica.get(o.request_id) is replica]
        for output in outputs:
            if output.finished:
                del self.request_replica[output.request_id]
        return outputs

    # --- calls every replica answers ---

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """`engine.<method>(*args)` on every replica (all at once); their results in order.
        Step reports that arrive first are kept for the next `step()`."""
        for replica in self.replicas:
            send(replica, EngineCall(method, args, reply=True))
        results = []
        for replica in self.replicas:
            while True:
                message = receive(replica)
                if isinstance(message, Reply):
                    results.append(message.value)
                    break
                if isinstance(message, StepReport):
                    self.pending += self.take_report(replica, message)
                elif isinstance(message, Failed):
                    raise replica.failed(message)
        return results

    def reset_prefix_cache(self) -> bool:
        """Every replica forgets its cached prefixes; True only if all of them could."""
        return all(self.call_all("reset_prefix_cache"))

    def get_replica_metrics(self) -> list[list[Metric]]:
        """Each replica's own metrics, in replica order."""
        return self.call_all("get_metrics")

    def get_metrics(self) -> list[Metric]:
        return aggregate_metrics(self.get_replica_metrics())

    def shutdown(self) -> None:
        """Stop every replica (idempotent; also run by garbage collection and at exit)."""
        self._finalizer()
        atexit.unregister(self._finalizer)


def aggregate_metrics(per_replica: list[list[Metric]]) -> list[Metric]:
    """One list of metrics for the whole engine, by name: counters, request counts and the KV
    pools' bytes are summed (the engine's total), other gauges (KV-cache usage, hit rates) are
    averaged over the replicas. An average of hit rates is not the hit rate of the summed
    counts, but it is close when the router spreads the work evenly, and the summed counters
    are there for exactness."""
    summed_gauges = {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "minivllm:kv_cache_bytes",
        "minivllm:kv_cache_touched_bytes",
    }
    by_name: dict[str, list[Metric]] = {}
    for metrics in per_replica:
        for metric in metrics:
            by_name.setdefault(metric.name, []).append(metric)
    combined = []
    for name, same_name in by_name.items():
        first = same_name[0]
        total = sum(metric.value for metric in same_name)
        if first.kind != "counter" and name not in summed_gauges:
            total /= len(same_name)
        combined.append(Metric(name, first.kind, total, first.description))
    return combined


# --- starting and stopping replicas -----------------------------------------------------------


def replica_device(config: EngineConfig, index: int) -> EngineConfig:
    """On GPUs, replica i gets GPUs of its own: i * tensor_parallel_size and the next ones (its
    tensor-parallel ranks count on from its first); on the CPU replicas share the cores."""
    device = resolve_device(config.device)
    if device.type != "cuda":
        return config
    first = (device.index or 0) + index * config.tensor_parallel_size
    return replace(config, device=f"cuda:{first}")


def start_replica(index: int, config: EngineConfig, num_threads: int) -> Replica:
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch state
    conn, child_conn = context.Pipe()
    process = context.Process(
        target=run_replica,
        args=(config, child_conn, num_threads),
        name=f"minivllm-dp-replica-{index}",
        daemon=False,  # a replica may start processes of its own (tensor parallelism)
    )
    process.start()
    # Drop our copy of the replica's end: when the replica dies, its end closes and our
    # recv raises EOFError instead of waiting forever.
    child_conn.close()
    return Replica(index=index, process=process, conn=conn)


def wait_until_ready(replica: Replica) -> int:
    """The replica's max_model_len once its engine is built; its exception if building failed."""
    message = receive(replica)
    if isinstance(message, Failed):
        message.error.__cause__ = RemoteTraceback(message.traceback)
        raise message.error
    assert isinstance(message, Ready), message
    return message.max_model_len


def send(replica: Replica, message: Any) -> None:
    try:
        replica.conn.send(message)
    except OSError:
        raise replica.died() from None


def receive(replica: Replica) -> Any:
    try:
        return replica.conn.recv()
    except (EOFError, OSError):
        raise replica.died() from None


def shutdown_replicas(replicas: list[Replica]) -> None:
    """Ask each replica to stop, give them SHUTDOWN_TIMEOUT_S together, then terminate and at
    last kill whatever is still running. No process is left behind."""
    for replica in replicas:
        try:
            replica.conn.send(Shutdown())
        except OSError:
            pass  # already gone
    stop_processes([replica.process for replica in replicas])
    for replica in replicas:
        replica.conn.close()


def stop_processes(processes: list) -> None:
    """Give processes that were asked to stop SHUTDOWN_TIMEOUT_S together, then terminate and
    at last kill whatever is still running."""
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=2)
        if process.is_alive():
            process.kill()
            process.join()
