"""Chapter 09: the async engine. Outputs stream while the engine core steps in its own process,
many requests share the steps, a consumer that stops early aborts its request, an overloaded or
stopped engine refuses work with a clear error, and a core that dies is an error at once.
Text is made in the front end: the core sends token ids only, and a stop string found in the
front end ends its sequence there and frees its blocks in the core.
The fake-engine tests pin what holds wherever the core runs: only the event loop touches the
streams, a stalled stream holds one output, and a refused request fails alone."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace

import httpx
import pytest
import zmq
from conftest import ENGINE_TEST_FAMILY, assert_pool_is_empty
from engine_core_calls import engine_is_idle, pool_is_empty
from hypothesis import given
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineOverloadedError,
    RequestStream,
)
from minivllm.engine.core import (
    AbortRequests,
    AbortSequences,
    CallResult,
    EngineCore,
    EngineCoreOutputs,
    EngineCoreProc,
    FunctionCall,
)
from minivllm.engine.core_client import InprocClient, MPClient
from minivllm.engine.data_parallel import AddRequest, EngineCall, Shutdown
from minivllm.engine.deltas import OutputDeltas, merge_delta, new_request_output, snapshot
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.output_processor import (
    OutputProcessor,
    SequenceState,
    cumulative_logprob_after,
)
from minivllm.entrypoints.openai.api_server import BackgroundServer
from minivllm.models.loader import load_tokenizer
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.tokenizer import REPLACEMENT_CHAR

# A small pool: every engine-core process holds its own.
SETTINGS = dict(
    device="cpu", dtype="float32", block_size=4, max_model_len=128, kv_cache_memory_bytes=32 << 20
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
HANG_GUARD_S = 60  # a wait that ends long before this, unless something hangs
VOCAB_SIZE = 49152  # the embedded tokenizer's, shared by the tiny models


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs[ENGINE_TEST_FAMILY]


def caller_id(core_id: str) -> str:
    """The caller's request id of an id the core knows a request by ("r" of "r-7")."""
    return core_id.rpartition("-")[0]


class RecordingClient(MPClient):
    """The engine core in its own process, with a record of what crossed: every report the
    core sent, every abort the front end sent (named by the callers' request ids)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.reports: list = []  # EngineCoreOutputs, as received
        self.aborted: list[str] = []
        self.aborted_sequences: list[tuple[str, int]] = []

    def start(self, on_outputs, on_failure) -> None:
        def record(report) -> None:
            self.reports.append(report)
            on_outputs(report)

        super().start(record, on_failure)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += [caller_id(request_id) for request_id in request_ids]
        super().abort_requests(request_ids)

    def abort_sequences(self, sequences: list[tuple[str, int]]) -> None:
        self.aborted_sequences += [(caller_id(request_id), i) for request_id, i in sequences]
        super().abort_sequences(sequences)

    def deltas_of(self, request_id: str) -> list[RequestOutput]:
        return [o for r in self.reports for o in r.outputs if caller_id(o.request_id) == request_id]


def num_running(engine) -> int:
    return len(engine.scheduler.running)


def fail_on_purpose(engine) -> None:
    raise RuntimeError("failed on purpose")


class CoreOverSockets:
    """`EngineCoreProc`'s loop in a thread of this process, over in-process ZMQ sockets: the
    front end's side of the engine-core process, without the process."""

    def __init__(self, engine) -> None:
        self.context = zmq.Context()
        name = f"inproc://core-{id(self)}"
        self.to_core = self.context.socket(zmq.PUSH)
        self.to_core.bind(name + "-in")
        core_inputs = self.context.socket(zmq.PULL)
        core_inputs.connect(name + "-in")
        core_outputs = self.context.socket(zmq.PUSH)
        core_outputs.bind(name + "-out")
        self.from_core = self.context.socket(zmq.PULL)
        self.from_core.connect(name + "-out")
        self.from_core.setsockopt(zmq.RCVTIMEO, HANG_GUARD_S * 1000)
        self.core = EngineCoreProc(engine, core_inputs, core_outputs)
        self.thread = threading.Thread(target=self.core.run_busy_loop, daemon=True)
        self.thread.start()

    def send(self, message) -> None:
        self.to_core.send_pyobj(message)

    def receive(self):
        return self.from_core.recv_pyobj()

    def close(self) -> None:
        """Stop the loop, then close every socket (pending messages dropped) and the context."""
        self.send(Shutdown())
        self.thread.join(HANG_GUARD_S)
        self.context.destroy(linger=0)

    def call(self, message) -> CallResult:
        """Send a call; its answer, passing over the step reports sent before it."""
        self.send(message)
        while not isinstance(result := self.receive(), CallResult):
            assert isinstance(result, EngineCoreOutputs), result
        return result


@pytest.fixture
def core(model_dir):
    core = CoreOverSockets(LLMEngine(EngineConfig(model=str(model_dir), **SETTINGS)))
    yield core
    core.close()
    assert not core.thread.is_alive(), "Shutdown did not end the loop"


def test_the_core_loop_serves_requests_calls_and_aborts_over_its_sockets(core, tiny_greedy):
    """Requests in, deltas out, until each ends; a request the engine refuses comes back as
    that request's error; calls are answered between steps, their errors sent back to the
    caller; an abort ends a request and stops its deltas; Shutdown ends the loop."""
    prompt = [5, 6, 7, 8]
    params = SamplingParams(temperature=0.0, max_tokens=10, detokenize=False)
    core.send(AddRequest("a", {"prompt_token_ids": prompt}, params))
    core.send(AddRequest("bad", {"prompt_token_ids": [VOCAB_SIZE + 5]}, params))
    tokens, errors, finished = [], {}, False
    while not (finished and errors):
        report = core.receive()
        assert isinstance(report, EngineCoreOutputs)
        assert report.num_waiting + report.num_running <= 1  # "bad" never queued
        errors.update(report.errors)
        for output in report.outputs:
            tokens += output.outputs[0].token_ids
            finished = output.finished
    assert tokens == tiny_greedy(prompt, 10)
    assert list(errors) == ["bad"] and "vocabulary" in str(errors["bad"])
    assert report.num_received == 2

    assert core.call(EngineCall("get_num_unfinished_requests", reply=True)).value == 0
    assert core.call(FunctionCall(pickle.dumps(num_running))).value == 0
    failed = core.call(FunctionCall(pickle.dumps(fail_on_purpose))).error
    assert isinstance(failed, RuntimeError) and "failed on purpose" in str(failed)
    assert isinstance(core.call(EngineCall("no_such_method", reply=True)).error, AttributeError)

    core.send(AddRequest("long", {"prompt_token_ids": prompt}, LONG))
    assert core.receive().outputs[0].request_id.startswith("long")
    core.send(AbortRequests(["long"]))
    while core.call(FunctionCall(pickle.dumps(num_running))).value:
        pass
    assert_pool_is_empty(core.core.engine)


def test_the_engine_thread_reports_only_what_a_front_end_must_hear():
    """The in-process client's thread (a daemon named minivllm-engine, so that a forgotten
    shutdown does not keep the process alive) wakes for every message; a wake that leaves
    nothing to do sends nothing and is no failure; a refused request is reported. A client
    shut down before it started just shuts its engine down."""
    InprocClient(idle := FakeEngine()).shutdown()
    assert idle.calls == [("shutdown",)]

    engine = FakeEngine(fail_add=("r",))
    client = InprocClient(engine)
    reports, failures = [], []

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + HANG_GUARD_S
        while not condition():
            assert not failures, failures
            assert time.monotonic() < deadline, f"{what} never happened"
            time.sleep(0.01)

    client.start(reports.append, failures.append)
    try:
        assert any(t.name == "minivllm-engine" and t.daemon for t in threading.enumerate())
        client.abort_requests(["nobody"])
        wait_for(lambda: engine.calls, "the abort")
        params = SamplingParams(max_tokens=1)
        client.add_request(AddRequest("r-0", {"prompt_token_ids": [5]}, params))
        wait_for(lambda: reports, "the refusal's report")
    finally:
        client.shutdown()
    assert failures == [] and [list(report.errors) for report in reports] == [["r-0"]]
    assert [call[0] for call in engine.calls] == ["abort_request", "add_request", "shutdown"]


def test_the_core_hands_each_message_to_the_engine_and_counts_sequences():
    engine = FakeEngine()
    core = EngineCore(engine)
    prompt = {"prompt_token_ids": [5, 6]}
    two = SamplingParams(n=2, max_tokens=1)
    core.handle(AddRequest("a", prompt, two, priority=3))
    core.handle(AddRequest("b", prompt, SamplingParams(max_tokens=1)))
    core.handle(AbortSequences([("a", 1)]))
    core.handle(AbortRequests(["b"]))
    assert engine.calls[0] == ("add_request", "a", prompt, two, 3)
    assert [call[0] for call in engine.calls] == [
        "add_request",
        "add_request",
        "abort_sequences",
        "abort_request",
    ]
    assert engine.calls[2:] == [("abort_sequences", [("a", 1)]), ("abort_request", ["b"])]
    assert core.num_received == 3  # sequences: two of a, one of b


def test_a_refused_request_aborted_before_the_next_step_is_not_reported():
    """The core keeps a refused request's error for the next report; an abort of that request
    in the meantime drops it (nobody waits for it), leaving the core with no work. With no
    request unfinished, the report is made without stepping the engine."""
    engine = FakeEngine(fail_add=("kept", "dropped"))
    core = EngineCore(engine)
    params = SamplingParams(max_tokens=1)
    core.add_request(AddRequest("kept-0", {"prompt_token_ids": [5]}, params))
    core.add_request(AddRequest("dropped-0", {"prompt_token_ids": [5]}, params))
    core.abort_requests(["dropped-0"])
    assert core.has_work()
    before = time.monotonic()
    report = core.step()
    assert list(report.errors) == ["kept-0"] and before <= report.timestamp <= time.monotonic()
    assert not core.has_work() and ("step",) not in engine.calls


def test_forgetting_a_request_drops_its_progress_even_an_unknown_one():
    deltas = OutputDeltas()
    deltas.add("r")
    deltas.forget(["r", "never-added"])
    assert deltas.progress == {}


def test_the_kept_tokens_cumulative_logprob_is_summed_from_the_previous_one():
    """A stop string cut the last of three new tokens: the cumulative logprob is the previous
    one plus the two kept tokens' logprobs, not the core's value for all three."""
    sequence = SequenceState(detokenizer=None, cumulative_logprob=-1.0)
    new = CompletionOutput(0, "", [4, 5, 6], -7.0, None)
    logprobs = [{4: Logprob(-2.0, 1)}, {5: Logprob(-0.5, 1)}]
    assert cumulative_logprob_after(sequence, [4, 5], logprobs, new) == -3.5
    assert (
        cumulative_logprob_after(sequence, [4, 5, 6], logprobs + [{6: Logprob(-3.5, 1)}], new)
        == -7.0
    )
    assert cumulative_logprob_after(sequence, [4, 5], None, new) == -7.0


@pytest.fixture(scope="module")
def async_llm(model_dir):
    llm = AsyncLLM(RecordingClient(EngineConfig(model=str(model_dir), **SETTINGS)))
    yield llm
    llm.shutdown()


def metrics(llm: AsyncLLM) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics()}


def settle(llm: AsyncLLM) -> None:
    """Wait for the aborts to land; then the core's metrics say nothing runs, waits or holds a
    block, and its pool is checked block by block."""
    deadline = time.monotonic() + HANG_GUARD_S
    while llm.num_open_requests or not llm.call_engine(engine_is_idle):
        assert time.monotonic() < deadline, "requests never finished"
        time.sleep(0.01)
    values = metrics(llm)
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:num_requests_waiting"] == 0
    assert values["vllm:kv_cache_usage_perc"] == 0
    llm.call_engine(pool_is_empty)


def test_concurrent_streams_equal_llm_generate(async_llm, model_dir):
    """Eight requests at once over the engine-core process: each stream's outputs only grow,
    and the last is what the in-process LLM.generate returns for the same prompt."""
    prompts = [{"prompt_token_ids": list(range(10 + i, 20 + 2 * i))} for i in range(8)]
    expected = LLM(model=str(model_dir), **SETTINGS).generate(prompts, GREEDY, use_tqdm=False)

    async def collect(index: int) -> list:
        return [o async for o in async_llm.generate(prompts[index], GREEDY, f"r{index}")]

    async def run_all():
        return await asyncio.gather(*(collect(i) for i in range(8)))

    for outputs, reference in zip(asyncio.run(run_all()), expected):
        tokens = [o.outputs[0].token_ids for o in outputs]
        assert all(a == b[: len(a)] and len(a) < len(b) for a, b in zip(tokens, tokens[1:]))
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].outputs[0].token_ids == reference.outputs[0].token_ids
        assert outputs[-1].outputs[0].text == reference.outputs[0].text
        assert outputs[-1].prompt_token_ids == reference.prompt_token_ids
    settle(async_llm)


def test_a_consumer_that_stops_aborts_its_request(async_llm):
    async def take_two():
        stream = async_llm.generate({"prompt_token_ids": [5, 6, 7]}, LONG, "early")
        outputs = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return outputs

    outputs = asyncio.run(take_two())
    assert not outputs[-1].finished
    settle(async_llm)


@pytest.fixture
def inproc_llm(model_dir):
    """AsyncLLM with its engine stepped in a thread of this process, at most 3 waiting."""
    config = EngineConfig(model=str(model_dir), **SETTINGS)
    llm = AsyncLLM.from_config(config, max_waiting_requests=3, multiprocess=False)
    yield llm
    llm.shutdown()


def test_from_config_without_processes_steps_the_given_engine_in_this_process(
    inproc_llm, model_dir
):
    assert type(inproc_llm.client) is InprocClient
    assert isinstance(inproc_llm.engine, LLMEngine)
    assert inproc_llm.engine.config.model == str(model_dir)
    assert inproc_llm.max_waiting_requests == 3


def test_an_aborted_stream_ends_for_its_reader_and_listeners_hear_its_id(inproc_llm):
    """After `abort`, the stream yields nothing more (not even output that arrived before the
    abort and was not read yet), and every listener is told the caller's request id."""
    aborted: list[str] = []
    inproc_llm.add_listener(
        SimpleNamespace(on_step=lambda outputs, now: None, on_abort=aborted.extend)
    )

    async def read_one_then_abort():
        stream = inproc_llm.add_request("r", {"prompt_token_ids": [5, 6, 7]}, LONG)
        await anext(stream)
        inproc_llm.abort("r")
        return [output async for output in stream]

    assert asyncio.run(asyncio.wait_for(read_one_then_abort(), HANG_GUARD_S)) == []
    assert aborted == ["r"]
    settle(inproc_llm)


def test_a_closed_stream_yields_nothing_more_even_its_unread_last_output(inproc_llm):
    """The request has finished in the front end (its stream forgotten), its last output not
    read yet; `close()` ends the stream all the same."""

    async def close_after_the_end():
        stream = inproc_llm.add_request("c", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
        while not stream.output.finished:
            await asyncio.sleep(0.01)
        stream.close()
        return [output async for output in stream]

    assert asyncio.run(asyncio.wait_for(close_after_the_end(), HANG_GUARD_S)) == []


def test_shutdown_ends_an_open_stream_with_engine_dead_saying_why(inproc_llm):
    """A reader still in a stream at shutdown gets what had arrived, then EngineDeadError."""

    async def read_through_shutdown():
        stream = inproc_llm.add_request("r", {"prompt_token_ids": [5, 6, 7]}, LONG)
        await anext(stream)
        await asyncio.to_thread(inproc_llm.shutdown)
        with pytest.raises(EngineDeadError, match="^the engine was shut down$"):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(read_through_shutdown(), HANG_GUARD_S))


def test_an_async_engine_shut_down_before_any_request_ends_quietly(inproc_llm):
    inproc_llm.shutdown()  # no loop was ever used: nothing to tell
    assert not inproc_llm.is_running


def test_mp_client_starts_one_spawned_plain_engine_core_per_replica(model_dir):
    """Two cores: each a fresh interpreter (spawned: no forked torch threads or sockets), not a
    daemon (a core may start tensor-parallel workers, which a daemon may not), named and
    numbered by its index; each runs one engine with one pool of the configured size (the data
    parallelism is the client's, not nested in the cores), and the client routes by prefix in
    the engine's blocks. Its queues to and from each core have no bound (a high-water mark of
    0): a send never waits for a busy core to read, a report never waits for the front end."""
    config = EngineConfig(model=str(model_dir), **{**SETTINGS, "data_parallel_size": 2})
    client = MPClient(config)
    try:
        assert [core.index for core in client.cores] == [0, 1]
        for core in client.cores:
            assert core.process.name == f"minivllm-engine-core-{core.index}"
            assert core.process.daemon is False
            assert isinstance(core.process, multiprocessing.context.SpawnProcess)
            assert core.inputs.getsockopt(zmq.SNDHWM) == 0
            assert core.outputs.getsockopt(zmq.RCVHWM) == 0
        assert client.prefix_affinity.block_size == config.block_size
        client.start(lambda report: None, lambda error: None)
        # A daemon: a client nobody shut down must not keep the interpreter from exiting.
        thread = client.state.output_thread
        assert thread.name == "minivllm-core-outputs" and thread.daemon is True
        for metrics in client.get_replica_metrics():
            pool_bytes = next(m.value for m in metrics if m.name == "minivllm:kv_cache_bytes")
            assert 0 < pool_bytes <= config.kv_cache_memory_bytes
    finally:
        client.shutdown()


# --- detokenization in the front end -----------------------------------------------------------


@pytest.fixture(scope="module")
def offline_llm(model_dir):
    """The reference: LLM.generate, whose engine detokenizes in this process."""
    return LLM(model=str(model_dir), **SETTINGS)


def stop_string_across_two_tokens(tokenizer, token_ids: list[int], elsewhere=()) -> str:
    """Four characters of a generated text, the last two of one token and the first two of
    the next, that occur neither earlier in the text nor in the `elsewhere` texts."""
    texts = [
        tokenizer.decode(
            token_ids[:k], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        for k in range(len(token_ids) + 1)
    ]
    full = texts[-1]
    for k in range(1, len(token_ids)):  # the boundary between tokens k - 1 and k
        before, middle, after = texts[k - 1 : k + 2]
        if (
            not (middle.startswith(before) and after.startswith(middle))
            or REPLACEMENT_CHAR in after
        ):
            continue
        boundary = len(middle)
        if boundary - len(before) < 2 or len(after) - boundary < 2:
            continue
        stop = full[boundary - 2 : boundary + 2]
        if full.find(stop) == boundary - 2 and not any(stop in text for text in elsewhere):
            return stop
    pytest.fail(f"no stop string across two tokens in {full!r}")


def assert_same_completion(actual: CompletionOutput, expected: CompletionOutput) -> None:
    """The same text, tokens, reasons and logprob candidates with their decoded tokens; the
    logprob values up to float noise (the two engines batch and cache prefixes differently)."""
    assert (actual.text, actual.token_ids, actual.finish_reason, actual.stop_reason) == (
        expected.text,
        expected.token_ids,
        expected.finish_reason,
        expected.stop_reason,
    )
    if expected.logprobs is None:
        assert actual.logprobs is None and actual.cumulative_logprob is None
        return
    assert decoded_tokens(actual.logprobs) == decoded_tokens(expected.logprobs)
    assert logprob_values(actual.logprobs) == pytest.approx(logprob_values(expected.logprobs))
    assert actual.cumulative_logprob == pytest.approx(expected.cumulative_logprob)


def decoded_tokens(logprobs: list) -> list:
    return [None if e is None else {t: c.decoded_token for t, c in e.items()} for e in logprobs]


def logprob_values(logprobs: list) -> list[float]:
    return [c.logprob for e in logprobs if e is not None for c in e.values()]


def generate_all(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str) -> list:
    async def run():
        return [output async for output in llm.generate(prompt, params, request_id)]

    return asyncio.run(run())


def test_a_stop_string_across_two_tokens_ends_the_request_in_the_front_end(async_llm, offline_llm):
    """Only the text shows a stop string that spans two tokens, and the core has no text: the
    front end finds it, ends the request as LLM.generate's engine does, and tells the core to
    abort it. The core never names the string, and afterwards holds no block."""
    prompt = {"prompt_token_ids": [300, 301, 302, 303, 304]}
    free = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=2)
    free_run = offline_llm.generate(prompt, free, use_tqdm=False)[0].outputs[0]
    tokenizer = offline_llm.get_tokenizer()
    stop = stop_string_across_two_tokens(tokenizer, free_run.token_ids[:30])
    params = replace(free, stop=[stop])
    expected = offline_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert expected.stop_reason == stop and len(expected.token_ids) < len(free_run.token_ids)
    assert stop not in tokenizer.decode(expected.token_ids[-1:])

    outputs = generate_all(async_llm, prompt, params, "two-token-stop")
    assert_same_completion(outputs[-1].outputs[0], expected)
    assert outputs[-1].finished
    client = async_llm.client
    assert "two-token-stop" in client.aborted
    deltas = client.deltas_of("two-token-stop")
    assert deltas and all(c.stop_reason != stop for d in deltas for c in d.outputs)
    settle(async_llm)


def test_the_core_sends_token_ids_and_the_front_end_makes_the_text(async_llm, offline_llm):
    """What crosses from the core holds no text: every delta's text is empty and no logprob,
    sampled or of the prompt, has a decoded token. The stream's outputs have them all, as
    LLM.generate's do."""
    prompt = {"prompt_token_ids": [400, 401, 402, 403, 404, 405]}
    params = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    (expected,) = offline_llm.generate(prompt, params, use_tqdm=False)
    outputs = generate_all(async_llm, prompt, params, "no-text-crosses")

    deltas = async_llm.client.deltas_of("no-text-crosses")
    assert deltas and all(c.text == "" for d in deltas for c in d.outputs)
    candidates = [
        candidate
        for d in deltas
        for entries in [*(d.prompt_logprobs or []), *d.outputs[0].logprobs]
        if entries is not None
        for candidate in entries.values()
    ]
    assert candidates and all(candidate.decoded_token is None for candidate in candidates)
    assert sum(d.prompt_logprobs is not None for d in deltas) == 1

    final = outputs[-1]
    assert final.outputs[0].text and final.outputs[0].text == expected.outputs[0].text
    assert_same_completion(final.outputs[0], expected.outputs[0])
    assert decoded_tokens(final.prompt_logprobs) == decoded_tokens(expected.prompt_logprobs)
    assert logprob_values(final.prompt_logprobs) == pytest.approx(
        logprob_values(expected.prompt_logprobs)
    )
    settle(async_llm)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_n_2_with_stop_strings_equals_llm_generate(async_llm, offline_llm, sampling):
    """n = 2 with stop strings over the server's engine: each completion ends where
    LLM.generate's does, with the same text, tokens (so the same usage counts) and reasons.
    Seeded, the two differ and the stop string is in the first only: it ends in the front end
    and is aborted in the core alone, while the second runs on to its max_tokens."""
    greedy = sampling == "greedy"
    prompt = {"prompt_token_ids": list(range(500 if greedy else 600, 507 if greedy else 607))}
    free = SamplingParams(
        n=2,
        max_tokens=24,
        ignore_eos=True,
        temperature=0.0 if greedy else 1.0,
        seed=None if greedy else 7,
    )
    first, second = offline_llm.generate(prompt, free, use_tqdm=False)[0].outputs
    elsewhere = [] if greedy else [second.text]
    # Within the first half: the first completion stops well before the second ends.
    stop = stop_string_across_two_tokens(
        offline_llm.get_tokenizer(), first.token_ids[:12], elsewhere
    )
    params = replace(free, stop=[stop, "no such text"])
    (expected,) = offline_llm.generate(prompt, params, use_tqdm=False)
    assert expected.outputs[0].stop_reason == stop

    request_id = f"n2-{sampling}"
    final = generate_all(async_llm, prompt, params, request_id)[-1]
    assert final.finished and len(final.outputs) == 2
    for actual, reference in zip(final.outputs, expected.outputs, strict=True):
        assert_same_completion(actual, reference)
    if not greedy:
        assert expected.outputs[1].finish_reason == "length"
        assert (request_id, 0) in async_llm.client.aborted_sequences
    settle(async_llm)


@st.composite
def cumulative_outputs(draw) -> list[RequestOutput]:
    """One request's cumulative outputs over its steps, as LLMEngine.step returns them: n
    completions that each grow by 0-3 tokens a step (with logprobs or without), a finish
    reason on the last step, the cached-token count and prompt logprobs set on every step."""
    n, num_steps = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    with_logprobs = draw(st.booleans())
    prompt_logprobs = draw(st.none() | st.just([None, {2: Logprob(-0.5, 1)}]))
    tokens: list[list[int]] = [[] for _ in range(n)]
    steps = []
    for step in range(num_steps):
        last = step == num_steps - 1
        completions = []
        for i in range(n):
            tokens[i] += draw(st.lists(st.integers(0, 99), max_size=3))
            logprobs = [{t: Logprob(-float(t), 1)} for t in tokens[i]] if with_logprobs else None
            completions.append(
                CompletionOutput(
                    i, "", list(tokens[i]), -1.0 * step, logprobs, "length" if last else None
                )
            )
        steps.append(
            RequestOutput(
                "r", None, [1, 2], completions, last, None, step, prompt_logprobs=prompt_logprobs
            )
        )
    return steps


@given(steps=cumulative_outputs())
def test_deltas_carry_only_what_is_new_and_join_back_into_each_cumulative_output(steps):
    """The core's side cuts each cumulative output into what is new since the last one; the
    front end's side joins the deltas back, step by step, into exactly the cumulative output
    (a snapshot taken on the way is not changed by later deltas). Prompt logprobs travel
    once; a finished request is forgotten; a request the core does not know is left out."""
    splitter = OutputDeltas()
    splitter.add("r")
    joined = new_request_output("r", {"prompt": None, "prompt_token_ids": [1, 2]})
    previous, snapshots = [[] for _ in steps[0].outputs], []
    prompt_logprobs_sent = 0
    for output in steps:
        (delta,) = splitter.split([replace(output, request_id="unknown"), output])
        assert (delta.prompt, delta.prompt_token_ids) == (None, [])  # the front end has it
        for i, completion in enumerate(delta.outputs):
            assert completion.token_ids == output.outputs[i].token_ids[len(previous[i]) :]
            previous[i] = output.outputs[i].token_ids
        prompt_logprobs_sent += delta.prompt_logprobs is not None
        merge_delta(joined, delta)
        assert joined == output
        snapshots.append(snapshot(joined))
    assert snapshots == steps
    assert prompt_logprobs_sent == (steps[0].prompt_logprobs is not None)
    assert splitter.progress == {}


def test_the_front_end_streams_only_text_that_can_no_longer_change(embedded_dir):
    """Token by token through the output processor, as the core sends them (ids, no text): a
    half character and a tail that may begin the stop string are held back, so every joined
    text is a prefix of the final one; the stop string ends the request, cuts the text before
    it and keeps the tokens up to the one that completed it, and the core is told to abort."""
    tokenizer = load_tokenizer(embedded_dir)
    token_ids = tokenizer.encode("Café 🙂 then STOP and more")
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", [1], SamplingParams(stop=["STOP"], max_tokens=len(token_ids)))
    joined = new_request_output("r", {"prompt": None, "prompt_token_ids": [1]})
    texts = []
    for token_id in token_ids:
        delta = RequestOutput("r", None, [], [CompletionOutput(0, "", [token_id])], False)
        processed = processor.process_outputs([delta])
        merge_delta(joined, processed.outputs[0])
        texts.append(joined.outputs[0].text)
        if joined.finished:
            break
    final = joined.outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == ("Café 🙂 then ", "stop", "STOP")
    assert all(final.text.startswith(text) for text in texts)
    assert not any(REPLACEMENT_CHAR in text or text.endswith(("S", "ST", "STO")) for text in texts)
    kept = final.token_ids
    assert "STOP" in tokenizer.decode(kept) and "STOP" not in tokenizer.decode(kept[:-1])
    assert processed.requests_to_abort == ["r"] and processor.requests == {}


def test_bad_requests_and_overload_are_refused_up_front(async_llm):
    async def add(prompt, params=GREEDY, request_id="bad"):
        return async_llm.add_request(request_id, prompt, params)

    with pytest.raises(ValueError, match="context"):
        asyncio.run(add({"prompt_token_ids": list(range(10, 200))}))
    async_llm.max_waiting_requests = 0
    try:
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
            asyncio.run(add("Hello"))
    finally:
        async_llm.max_waiting_requests = 1024
    settle(async_llm)


def test_shutdown_ends_open_streams_and_leaves_no_process(model_dir):
    llm = AsyncLLM.from_config(EngineConfig(model=str(model_dir), **SETTINGS))
    core = llm.client.cores[0].process

    async def read_while_shutting_down():
        stream = llm.add_request("r", "Hello", LONG)
        await anext(stream)
        await asyncio.to_thread(llm.shutdown)
        return [output async for output in stream]

    with pytest.raises(EngineDeadError):
        asyncio.run(read_while_shutting_down())

    async def add_after_shutdown():
        return llm.add_request("s", "Hi", LONG)

    with pytest.raises(EngineDeadError):
        asyncio.run(add_after_shutdown())
    assert core.exitcode is not None and core not in multiprocessing.active_children()


def test_a_killed_engine_core_fails_every_stream_and_health(model_dir):
    """SIGKILL the core mid-stream: every open stream raises EngineDeadError (no hang), the
    engine says it is not running and /health answers 503."""
    server = BackgroundServer(AsyncLLM.from_config(EngineConfig(model=str(model_dir), **SETTINGS)))
    llm = server.engine
    try:

        async def kill_mid_stream():
            prompts = [{"prompt_token_ids": [5, 6, 7 + i]} for i in range(3)]
            streams = [llm.add_request(f"k{i}", p, LONG) for i, p in enumerate(prompts)]
            await anext(streams[0])
            os.kill(llm.client.cores[0].process.pid, signal.SIGKILL)

            async def drain(stream: RequestStream):
                async for _ in stream:
                    pass

            results = await asyncio.wait_for(
                asyncio.gather(*(drain(s) for s in streams), return_exceptions=True),
                HANG_GUARD_S,
            )
            return results

        results = asyncio.run(kill_mid_stream())
        assert all(isinstance(result, EngineDeadError) for result in results), results
        assert not llm.is_running
        assert httpx.get(server.base_url + "/health", timeout=HANG_GUARD_S).status_code == 503
    finally:
        server.stop()


PARENT_SCRIPT = """
import multiprocessing, os, sys, threading, time
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM
config = EngineConfig(model=sys.argv[1], device="cpu", dtype="float32", block_size=4,
                      max_model_len=128, kv_cache_memory_bytes=32 << 20)
if sys.argv[2] == "starting":  # die while the core is still starting up
    threading.Thread(target=AsyncLLM.from_config, args=(config,), daemon=True).start()
    while not multiprocessing.active_children():
        time.sleep(0.01)
    pid = next(p.pid for p in multiprocessing.active_children() if "engine-core" in p.name)
else:
    pid = AsyncLLM.from_config(config).client.cores[0].process.pid
print(pid, flush=True)
os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("moment", ["starting", "serving"])
def test_an_engine_core_does_not_outlive_a_killed_server(model_dir, moment):
    parent = subprocess.run(
        [sys.executable, "-c", PARENT_SCRIPT, str(model_dir), moment],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S * 5,
    )
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    core_pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + HANG_GUARD_S
    while process_exists(core_pid):
        assert time.monotonic() < deadline, "the engine core outlived its server"
        time.sleep(0.1)


def process_exists(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by init, but maybe not at once)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- fake engines: the stream bookkeeping, in the engine thread of this process ---------------


@dataclass
class FakePrompt:
    token_ids: list[int]

    def as_prompt(self) -> dict:
        return {"prompt": None, "prompt_token_ids": self.token_ids}


class FakeProcessor:
    def process_request(self, prompt, params):
        return FakePrompt([1]), params or SamplingParams()


class FakeTokenizer:
    """Every token reads "t"."""

    def decode(self, token_ids: list[int], **options) -> str:
        return "t" * len(token_ids)


class FakeEngine:
    """Each request runs `steps` steps, one token each, and returns cumulative outputs as
    LLMEngine does for the server (token ids, no text: the front end makes it, "t" a token);
    `fail_add` requests (by the callers' ids) are refused by add_request with a RuntimeError.
    `calls` records what it was asked, in order (name and arguments)."""

    def __init__(self, steps: int = 1, fail_add: tuple[str, ...] = ()) -> None:
        self.processor = FakeProcessor()
        self.tokenizer = FakeTokenizer()
        self.steps, self.fail_add = steps, fail_add
        self.progress: dict[str, int] = {}
        self.fail_next_step = False
        self.calls: list[tuple] = []

    def add_request(self, request_id, prompt, params, priority=0):
        self.calls.append(("add_request", request_id, prompt, params, priority))
        if caller_id(request_id) in self.fail_add:
            raise RuntimeError(f"cannot build a grammar for {request_id}")
        self.progress[request_id] = 0

    def abort_request(self, request_ids):
        self.calls.append(("abort_request", request_ids))
        for request_id in request_ids:
            self.progress.pop(request_id, None)

    def abort_sequences(self, sequences):
        self.calls.append(("abort_sequences", sequences))

    def has_unfinished_requests(self) -> bool:
        return bool(self.progress) or self.fail_next_step

    def step(self) -> list[RequestOutput]:
        self.calls.append(("step",))
        if self.fail_next_step:
            raise RuntimeError("the step failed")
        outputs = []
        for request_id in list(self.progress):
            count = self.progress[request_id] = self.progress[request_id] + 1
            finished = count == self.steps
            completion = CompletionOutput(
                0, "", list(range(count)), finish_reason="length" if finished else None
            )
            outputs.append(RequestOutput(request_id, None, [1], [completion], finished))
            if finished:
                del self.progress[request_id]
        return outputs

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))


def test_a_stream_closed_while_its_output_is_delivered_does_not_kill_the_engine():
    """Force a client disconnect at the worst moment: while its last output is being handed to
    its stream. Only the event loop touches the streams, so the two cannot interleave."""
    handing_over, closed = threading.Event(), threading.Event()
    original_setattr = RequestStream.__setattr__
    loop_thread = threading.get_ident()

    def disconnect_during_delivery(self, name, value):
        if name == "started" and self.request_id == "victim":
            if threading.get_ident() != loop_thread:  # the engine's thread, mid-delivery
                handing_over.set()
                closed.wait(HANG_GUARD_S)
        original_setattr(self, name, value)

    async def main(llm: AsyncLLM):
        bystander = llm.add_request("bystander", "p")
        victim = llm.add_request("victim", "p")
        # An engine thread that handed outputs to streams itself would stop here, mid-way.
        await asyncio.to_thread(handing_over.wait, 1.0)
        victim.close()  # the victim's client leaves
        closed.set()
        outputs = [o async for o in bystander]
        assert outputs[-1].finished and outputs[-1].outputs[0].text == "t"
        assert llm.is_running, llm._error
        later = [o async for o in llm.add_request("later", "p")]
        assert later[-1].finished

    RequestStream.__setattr__ = disconnect_during_delivery
    llm = AsyncLLM(FakeEngine(), max_waiting_requests=None)
    try:
        asyncio.run(main(llm))
    finally:
        RequestStream.__setattr__ = original_setattr
        closed.set()
        llm.shutdown()


def test_a_request_added_as_the_engine_fails_gets_the_error():
    """The engine fails while add_request is half way (after its is_running check): the new
    stream still ends with EngineDeadError, never waits forever."""
    engine = FakeEngine(steps=10**9)  # the first request keeps the engine stepping
    llm = AsyncLLM(engine, max_waiting_requests=None)
    original = engine.processor.process_request

    def fail_the_engine_meanwhile(prompt, params):
        engine.fail_next_step = True
        deadline = time.monotonic() + HANG_GUARD_S
        while llm.is_running and time.monotonic() < deadline:
            time.sleep(0.01)
        return original(prompt, params)

    async def main():
        busy = llm.add_request("busy", "p")
        await anext(busy)
        engine.processor.process_request = fail_the_engine_meanwhile
        stream = llm.add_request("r", "p")
        for open_stream in (busy, stream):
            with pytest.raises(EngineDeadError, match="the step failed"):
                while True:
                    await asyncio.wait_for(anext(open_stream), HANG_GUARD_S)

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()


def test_a_stalled_stream_holds_one_output_and_reads_the_whole_text_late():
    """Nobody reads while the engine runs 300 steps: the stream keeps one cumulative output
    (O(n) tokens), not a copy per step (O(n^2)); the late reader gets everything at once."""
    steps = 300
    engine = FakeEngine(steps=steps)
    llm = AsyncLLM(engine, max_waiting_requests=None)

    def held_by_the_stream() -> tuple[int, int]:
        gc.collect()
        outputs = [
            o for o in gc.get_objects() if type(o) is RequestOutput and o.request_id == "slow"
        ]
        return len(outputs), sum(len(c.token_ids) for o in outputs for c in o.outputs)

    async def main():
        stream = llm.add_request("slow", "p")
        deadline = time.monotonic() + HANG_GUARD_S
        while llm.num_open_requests:  # until its last output has been delivered
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        num_outputs, num_tokens = held_by_the_stream()
        assert num_outputs <= 2 and num_tokens <= 2 * steps
        outputs = [output async for output in stream]
        assert [o.outputs[0].text for o in outputs] == ["t" * steps]
        assert outputs[0].outputs[0].token_ids == list(range(steps)) and outputs[0].finished

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()


def test_an_unexpected_add_request_error_ends_that_request_only():
    llm = AsyncLLM(FakeEngine(fail_add=("refused",)), max_waiting_requests=None)

    async def main():
        refused = llm.add_request("refused", "p")
        with pytest.raises(RuntimeError, match="cannot build a grammar") as raised:
            await asyncio.wait_for(anext(refused), HANG_GUARD_S)
        assert not isinstance(raised.value, EngineDeadError)
        assert llm.is_running
        outputs = [o async for o in llm.add_request("fine", "p")]
        assert outputs[-1].finished

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()


def test_a_busy_data_parallel_core_holds_up_neither_routing_nor_aborts(model_dir):
    """Two engine-core processes behind one AsyncLLM. Core 0 is frozen (SIGSTOP) mid-request,
    as if in a very long step: a new request still goes to core 1 and finishes there, and
    aborting core 0's request returns at once. Afterwards every block is free on both."""
    config = EngineConfig(model=str(model_dir), data_parallel_size=2, **SETTINGS)
    llm = AsyncLLM.from_config(config)
    frozen = llm.client.cores[0].process.pid

    async def freeze_one_core():
        first = llm.add_request("on-core-0", {"prompt_token_ids": [5, 6, 7]}, LONG)
        await anext(first)
        os.kill(frozen, signal.SIGSTOP)
        second = llm.add_request("elsewhere", {"prompt_token_ids": [9, 10, 11, 12]}, GREEDY)

        async def read_all():
            return [output async for output in second]

        outputs = await asyncio.wait_for(read_all(), HANG_GUARD_S)
        first.close()
        return outputs

    try:
        outputs = asyncio.run(freeze_one_core())
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 10
    finally:
        os.kill(frozen, signal.SIGCONT)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            per_core = [{m.name: m.value for m in ms} for ms in llm.get_replica_metrics()]
            if all(
                v["vllm:num_requests_running"] + v["vllm:num_requests_waiting"] == 0
                for v in per_core
            ):
                break
            assert time.monotonic() < deadline, "the aborted request still runs"
            time.sleep(0.01)
        assert all(values["vllm:prompt_tokens"] > 0 for values in per_core), "a core was unused"
        assert all(values["vllm:kv_cache_usage_perc"] == 0 for values in per_core)
    finally:
        llm.shutdown()


# --- deltas -------------------------------------------------------------------------------------


def test_deltas_join_back_into_the_cumulative_output():
    """The core's cumulative outputs, split into deltas and joined again: tokens and logprobs
    add up, the prompt logprobs come once, no delta carries text (the core has none: the front
    end makes it), and the last state equals the core's, error included."""
    prompt_logprobs = [None, {7: Logprob(-1.0)}]
    finish_reasons = [None, None, None, "error"]  # then the request failed
    cumulative = []
    for step, finish_reason in enumerate(finish_reasons, start=1):
        completion = CompletionOutput(
            0,
            "",
            list(range(step)),
            logprobs=[{token: Logprob(-0.5 * token)} for token in range(step)],
            finish_reason=finish_reason,
            error="nothing could be sampled" if finish_reason else None,
        )
        cumulative.append(
            RequestOutput(
                "r",
                None,
                [1, 7],
                [completion],
                finished=finish_reason is not None,
                prompt_logprobs=prompt_logprobs if step >= 2 else None,
            )
        )
    splitter = OutputDeltas()
    splitter.add("r")
    joined = new_request_output("r", {"prompt": None, "prompt_token_ids": [1, 7]})
    prompt_logprobs_sent = 0
    for output in cumulative:
        (delta,) = splitter.split([output])
        assert len(delta.outputs[0].token_ids) == 1 and delta.outputs[0].text == ""
        prompt_logprobs_sent += delta.prompt_logprobs is not None
        merge_delta(joined, delta)
        assert joined.outputs[0].token_ids == output.outputs[0].token_ids
        assert joined.outputs[0].logprobs == output.outputs[0].logprobs
    assert prompt_logprobs_sent == 1 and joined.prompt_logprobs == prompt_logprobs
    assert joined == cumulative[-1]
    assert splitter.progress == {}  # a finished request is forgotten
