"""Chapter 07 — the multiprocess executor: one engine, one model split over N processes.

    engine process                                   worker processes (spawned)
    Scheduler -> SchedulerOutput
    rank 0: Worker  --- broadcast (method, args) --->  rank 1..N-1: Worker
       forward on its shard  <---- all-reduces ---->     forward on theirs
       logits gathered, sample
    <- ModelRunnerOutput (rank 0's)

The engine still makes the three calls of chapter 04 (`executor/base.py`); only
`collective_rpc` changes: rank 0 broadcasts the method's name and arguments (the step's
plain-data `SchedulerOutput`), every rank calls it on its own `Worker`, and the forward passes
meet in the all-reduces of the split layers (`models/parallel_layers.py`). Rank 0 samples, so
its result is the step's.

How the processes find each other is torch.distributed's rendezvous: on one machine rank 0
opens a TCP store on a free loopback port and spawns the others; across machines `torchrun`
(or MASTER_ADDR/MASTER_PORT, RANK and WORLD_SIZE) starts one process per rank, rank 0 becomes
the engine and every other rank serves as a worker until the engine shuts down.

Processes fail, and an engine must not hang when they do. A thread of rank 0 watches every
spawned worker's process (`watch_workers`): the moment one ends, the executor is marked broken
and the tensor collectives are aborted, so rank 0 never waits in an all-reduce for a rank that
is gone (gloo reports a closed connection at once; NCCL would wait out its timeout). The next
call, or the one in flight, then stops the others and raises an error that names the rank and
its exit code.

The ranks on one machine share its cores, so rank 0 computes on its fair share of threads
(`fair_share_of_threads`) — but only while it computes: the thread count is a setting of the
whole process, and another engine in the same process (a benchmark's TP=1 beside TP=3) must
keep its own.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.config import EngineConfig, resolve_device
from minivllm.core.scheduler_output import SchedulerOutput
from minivllm.distributed.parallel_state import (
    TensorParallelGroup,
    abort_collectives,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from minivllm.executor.base import Executor
from minivllm.outputs import ModelRunnerOutput
from minivllm.worker.worker import Worker

STARTUP_TIMEOUT_S = 300  # spawning a process and importing torch takes seconds, not minutes
SHUTDOWN_TIMEOUT_S = 5
WORKERS_STARTED_KEY = "minivllm/workers_started"


@dataclass
class Launch:
    """Where this process stands in the group: its rank, the rendezvous every rank joins, and
    the ranks it must start itself (all but 0 on one machine; none under torchrun)."""

    rank: int
    local_rank: int  # which GPU of this machine
    init_method: str
    spawn_ranks: list[int]
    store: Any = None  # rank 0's open rendezvous on one machine


def fair_share_of_threads(num_ranks: int) -> int:
    """CPU threads for each of `num_ranks` processes on this machine: together no more than
    its cores (more would make the ranks fight for them)."""
    return max(1, len(os.sched_getaffinity(0)) // num_ranks)


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """torch computes on `num_threads` threads inside the block, on as many as before after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def launch_from_environment(size: int) -> Launch | None:
    """torchrun's (or a hand-set) rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != size:
        raise ValueError(
            f"tensor_parallel_size={size} but the launcher started WORLD_SIZE={world_size} "
            "processes; they must be equal"
        )
    rank = int(os.environ["RANK"])
    return Launch(rank, int(os.environ.get("LOCAL_RANK", rank)), "env://", spawn_ranks=[])


def open_local_rendezvous(size: int) -> Launch:
    """Rank 0 opens a TCP store on loopback for the workers it will spawn. The port is
    MASTER_PORT when set (an error if it is busy), else a free one (another if it was taken
    in the meantime)."""
    chosen = os.environ.get("MASTER_PORT")
    for _ in range(5):
        port = int(chosen) if chosen else free_port()
        try:
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                size,
                is_master=True,
                timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as error:  # the port is in use
            if chosen:
                raise RuntimeError(
                    f"the rendezvous port MASTER_PORT={chosen} is in use ({error}); set "
                    "MASTER_PORT to a free port, or unset it to let minivllm pick one"
                ) from error
            continue
        return Launch(0, 0, f"tcp://127.0.0.1:{port}", list(range(1, size)), store)
    raise RuntimeError("found no free port for the tensor-parallel rendezvous")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    """Each rank on its own GPU of the machine, counting from the engine's device (cuda:2 for
    rank 0 puts rank 1 on cuda:3); CPU ranks share the CPU."""
    device = resolve_device(config.device)
    if device.type == "cuda":
        return dataclasses.replace(config, device=f"cuda:{(device.index or 0) + local_rank}")
    return config


class MultiprocExecutor(Executor):
    """Rank 0's worker in this process, ranks 1..N-1 in others, one model split across all."""

    def __init__(self, config: EngineConfig, model_path: Path):
        size = config.tensor_parallel_size
        launch = launch_from_environment(size) or open_local_rendezvous(size)
        # The ranks on this machine share its cores: all of them when we spawn the ranks, the
        # launcher's count (torchrun's LOCAL_WORLD_SIZE) otherwise.
        ranks_here = size if launch.spawn_ranks else int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        threads = fair_share_of_threads(ranks_here)
        if launch.rank != 0:
            # Launched by torchrun on a rank that is not the engine's: serve as a worker until
            # the engine shuts down, then leave (the rest of the user's script is rank 0's).
            run_worker(config, model_path, launch.rank, size, launch.init_method, threads)
            raise SystemExit(0)

        context = mp.get_context("spawn")
        processes = [
            context.Process(
                target=run_worker,
                args=(config, model_path, rank, size, launch.init_method, threads, True),
                name=f"minivllm-tp-rank{rank}",
                daemon=True,  # never outlive the engine's process
            )
            for rank in launch.spawn_ranks
        ]
        for process in processes:
            process.start()
        # Everything a shutdown needs, apart from `self`, so that the finalizer (called on
        # `del llm`, at exit, or after a failure) can run without keeping the executor alive.
        self.state = _ExecutorState(processes)
        self._finalizer = weakref.finalize(self, self.state.shutdown)
        watch_workers(processes, self.state.worker_died)
        self.threads = threads
        try:
            if launch.store is not None:
                wait_for_workers(launch.store, processes)
            self.tp = init_tensor_parallel(
                0, size, launch.init_method, resolve_device(config.device), launch.store
            )
            self.state.tp = self.tp
            with torch_threads(threads):
                self.driver_worker = Worker(rank_config(config, 0), model_path, self.tp)
        except BaseException as error:
            self._fail(error)

    def collective_rpc(self, method: str, args: tuple = (), reply: bool = True) -> list[Any]:
        """Every rank calls `worker.method(*args)`; with `reply`, every rank's result comes
        back in rank order, else rank 0's alone (a step's output: the others have none)."""
        if self.state.closed:
            raise RuntimeError(
                "the tensor-parallel workers have stopped (after an error or an interrupt); "
                "create a new LLM"
            )
        if self.state.dead_workers:  # seen by the watcher: no collective can succeed
            self._fail(RuntimeError("a worker process ended"))
        try:
            self.tp.broadcast_object((method, args, reply))
            with torch_threads(self.threads):
                result = getattr(self.driver_worker, method)(*args)
            return self.tp.gather_objects(result) if reply else [result]
        except BaseException as error:
            self._fail(error)

    def _fail(self, error: BaseException):
        """A collective that fails or is interrupted leaves the ranks at different points of
        the step: the group cannot go on. Stop every worker and say why."""
        explained = self.state.explain(error)
        self.state.broken = True
        self.shutdown()
        if explained is error:
            raise error
        raise explained from error

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,), reply=False)[0]

    def shutdown(self) -> None:
        self._finalizer()


@dataclass
class _ExecutorState:
    processes: list
    tp: TensorParallelGroup | None = None
    broken: bool = False
    closed: bool = False
    dead_workers: list = dataclasses.field(default_factory=list)  # found by `watch_workers`

    def worker_died(self, dead: list) -> None:
        """Called by the watcher thread: a worker ended while the engine still ran. Collectives
        with it can never finish, so abort them: a step waiting in one raises now."""
        if self.closed:
            return  # a shutdown stopping its workers
        self.dead_workers = dead
        self.broken = True
        abort_collectives()

    def shutdown(self) -> None:
        """Tell the workers to stop (unless the group is broken), then make sure they have."""
        if self.closed:
            return
        self.closed = True
        if self.tp is not None and not self.broken:
            try:
                self.tp.broadcast_object(("shutdown", (), False))
            except RuntimeError:
                pass  # a worker already gone: it is stopped below either way
        for process in self.processes:
            process.join(SHUTDOWN_TIMEOUT_S if not self.broken else 0.5)
            if process.is_alive():
                process.kill()
                process.join()
        destroy_tensor_parallel()

    def explain(self, error: BaseException) -> BaseException:
        """A clear error naming the workers that died, when some did (a dying worker's
        connections close a moment before its exit code is known: wait a little for it)."""
        if isinstance(error, KeyboardInterrupt) or not self.processes:
            return error
        deadline = time.monotonic() + 2.0
        while not (dead := [p for p in self.processes if p.exitcode is not None]):
            if time.monotonic() > deadline:
                return error
            time.sleep(0.05)
        names = ", ".join(f"{p.name} (pid {p.pid}, exit code {p.exitcode})" for p in dead)
        return RuntimeError(
            f"tensor-parallel worker {names} died; the engine cannot continue (its own error, "
            f"if it had one, is printed above). Cause seen by rank 0: {error}"
        )


def watch_workers(processes: list, on_death) -> None:
    """Call `on_death(ended)` from a daemon thread as soon as any of `processes` ends. A process's
    sentinel is a handle the OS marks ready when the process exits, however it exits (a crash,
    SIGKILL, the OOM killer): waiting on the sentinels takes no collective and no polling."""
    if not processes:
        return  # torchrun's ranks are not our children: their launcher watches them

    def watch():
        sentinels = {process.sentinel: process for process in processes}
        ready = multiprocessing.connection.wait(list(sentinels))
        on_death([sentinels[sentinel] for sentinel in ready])

    threading.Thread(target=watch, daemon=True, name="tp-worker-watch").start()


def wait_for_workers(store, processes: list) -> None:
    """Wait until every spawned worker has reached the rendezvous; raise at once if one exits
    first (an import error, a bad device), instead of waiting out a timeout."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while store.add(WORKERS_STARTED_KEY, 0) < len(processes):
        for process in processes:
            if not process.is_alive():
                raise RuntimeError(
                    f"{process.name} (pid {process.pid}) exited with code {process.exitcode} "
                    "during startup; its error is printed above"
                )
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel workers did not start in {STARTUP_TIMEOUT_S} s")
        time.sleep(0.05)


def run_worker(
    config: EngineConfig,
    model_path: Path,
    rank: int,
    size: int,
    init_method: str,
    num_threads: int,
    spawned: bool = False,
) -> None:
    """A follower rank: join the group, load its shard, then run whatever rank 0 broadcasts
    until it says "shutdown"."""
    torch.set_num_threads(num_threads)
    if spawned:
        # Ctrl-C reaches every process of the terminal; the engine handles it and stops us.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _exit_when_parent_dies()
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(host, int(port), size, is_master=False)
        store.add(WORKERS_STARTED_KEY, 1)
    else:
        store = None
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    config = rank_config(config, local_rank)
    try:
        tp = init_tensor_parallel(rank, size, init_method, resolve_device(config.device), store)
        worker = Worker(config, model_path, tp)
        while True:
            method, args, reply = tp.broadcast_object()
            if method == "shutdown":
                break
            result = getattr(worker, method)(*args)
            if reply:
                tp.gather_objects(result)
    except Exception:
        # Rank 0 learns of it from the closed connection; the traceback is for the user.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    destroy_tensor_parallel()


def _exit_when_parent_dies() -> None:
    """A worker whose engine process was killed outright (SIGKILL runs no cleanup) must not
    live on as an orphan: watch the parent and leave when it is gone."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
