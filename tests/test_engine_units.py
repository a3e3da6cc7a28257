"""The engine's bookkeeping on its own: no model, no process, stand-ins for everything else.

The engine tests (test_ch04_engine.py, test_ch09_async_engine.py, ...) run real models and
real processes, and check that the tokens come out right. These check, in steps small enough
to follow by hand, the plain-data work around the model: which metrics an engine reports and
how replicas' metrics are combined, how a cumulative output is cut into deltas, what the
engine core does with each message and what it sends back, and how the front end's clients
route aborts and calls to their cores. Every engine, socket, pipe and process here is a
stand-in that records the calls made on it, so a test can say exactly what was asked.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import pickle
import re
import shutil
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest
import zmq

from minivllm.config import EngineConfig
from minivllm.core.prefix_cache import PrefixCacheStats, hash_blocks
from minivllm.core.scheduler import SpecDecodeStats
from minivllm.engine import core_client, data_parallel, output_processor
from minivllm.engine.async_llm import AsyncLLM, RequestStream
from minivllm.engine.core import (
    AbortRequests,
    AbortSequences,
    CallResult,
    EngineCore,
    EngineCoreOutputs,
    EngineCoreProc,
    FunctionCall,
)
from minivllm.engine.core_client import (
    CoreProcess,
    CoreProcesses,
    EngineCoreClient,
    EngineDeadError,
    InprocClient,
    MPClient,
    wait_until_ready,
)
from minivllm.engine.data_parallel import (
    SHUTDOWN_TIMEOUT_S,
    AddRequest,
    DataParallelEngine,
    EngineCall,
    Failed,
    PrefixAffinity,
    Ready,
    RemoteTraceback,
    Replica,
    Reply,
    Shutdown,
    StepReport,
    aggregate_metrics,
    picklable_error,
    shutdown_replicas,
    stop_processes,
)
from minivllm.engine.data_parallel import wait_until_ready as dp_wait_until_ready
from minivllm.engine.deltas import OutputDeltas, merge_delta, new_request_output
from minivllm.engine.llm_engine import LLMEngine, Metric, eos_token_ids, spec_decode_metric_rows
from minivllm.engine.output_processor import (
    OutputProcessor,
    RequestState,
    SequenceState,
    cumulative_logprob_after,
)
from minivllm.engine.processor import ProcessedPrompt, Processor, broadcast_params
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sample.sampling_params import SamplingParams, StructuredOutputsParams

HANG_GUARD_S = 5  # a wait that ends in milliseconds, unless something hangs
PROMPT = {"prompt": None, "prompt_token_ids": [1, 2, 3, 4, 5]}
ONE = SamplingParams(max_tokens=4)


def wait_for(condition, what: str, failures: list = ()) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert not failures, failures
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.002)


# --- LLMEngine: metrics, aborts of single sequences ---------------------------------------------


def test_spec_decode_metrics_are_vllms_counters_and_two_rates():
    """Four verification steps proposed 10 draft tokens and kept 6 (4 at the first position,
    2 at the second): the three counters under vLLM's names, 6/10 of the drafts accepted, 1 +
    6/4 = 2.5 tokens per verification step, and one counter per draft position."""
    stats = SpecDecodeStats(
        num_drafts=4, num_draft_tokens=10, num_accepted_tokens=6, accepted_per_position=[4, 2]
    )
    assert spec_decode_metric_rows(stats) == [
        ("vllm:spec_decode_num_drafts", "counter", 4, "Verification steps"),
        ("vllm:spec_decode_num_draft_tokens", "counter", 10, "Draft tokens"),
        ("vllm:spec_decode_num_accepted_tokens", "counter", 6, "Draft tokens accepted"),
        ("minivllm:spec_decode_acceptance_rate", "gauge", 0.6, "accepted / draft tokens, so far"),
        (
            "minivllm:spec_decode_mean_accepted_length",
            "gauge",
            2.5,
            "tokens a verification step emits on average (accepted drafts + 1)",
        ),
        (
            'vllm:spec_decode_num_accepted_tokens_per_pos{position="0"}',
            "counter",
            4,
            "Drafts accepted at position 0",
        ),
        (
            'vllm:spec_decode_num_accepted_tokens_per_pos{position="1"}',
            "counter",
            2,
            "Drafts accepted at position 1",
        ),
    ]


def test_spec_decode_rates_are_zero_before_the_first_draft():
    """No draft yet: both rates read 0.0 (no division by zero) and there is no per-position
    counter."""
    rows = spec_decode_metric_rows(SpecDecodeStats())
    assert [(name, value) for name, _, value, _ in rows] == [
        ("vllm:spec_decode_num_drafts", 0),
        ("vllm:spec_decode_num_draft_tokens", 0),
        ("vllm:spec_decode_num_accepted_tokens", 0),
        ("minivllm:spec_decode_acceptance_rate", 0.0),
        ("minivllm:spec_decode_mean_accepted_length", 0.0),
    ]


def metrics_engine(last_step_prefix_cache: tuple[int, int], speculative: bool) -> LLMEngine:
    """An LLMEngine without a model, as get_metrics reads it: two requests running and one
    waiting, 3 preemptions, 40 tokens generated from 70 prompt tokens, 16 of 64 prompt tokens
    found cached, a pool of 10 blocks of 1024 bytes (6 written, a quarter in use), and with
    speculative decoding 1 of 2 draft tokens accepted."""
    engine = LLMEngine.__new__(LLMEngine)
    engine.config = SimpleNamespace(speculative_config={"method": "ngram"} if speculative else None)
    engine.scheduler = SimpleNamespace(
        running=["a", "b"],
        waiting=["c"],
        num_preemptions=3,
        num_generated_tokens=40,
        prefix_cache_stats=PrefixCacheStats(queries=64, hits=16),
        spec_decode_stats=SpecDecodeStats(1, 2, 1, [1, 0]),
    )
    engine.kv_cache_manager = SimpleNamespace(
        usage=0.25, num_blocks=10, pool=SimpleNamespace(num_blocks_touched=6)
    )
    engine.kv_cache_bytes_per_block = 1024
    engine.num_prompt_tokens = 70
    engine.last_step_prefix_cache = last_step_prefix_cache
    return engine


ENGINE_METRICS = [
    Metric("vllm:kv_cache_usage_perc", "gauge", 0.25, "Share of KV blocks held by live requests"),
    Metric("minivllm:kv_cache_bytes", "gauge", 10240, "Bytes of the KV pool"),
    Metric(
        "minivllm:kv_cache_touched_bytes",
        "gauge",
        6144,
        "Bytes of the KV blocks written at least once (on a CPU, the part of the pool that is "
        "resident: its pages are allocated when first written)",
    ),
    Metric("vllm:num_requests_running", "gauge", 2, "Requests running"),
    Metric("vllm:num_requests_waiting", "gauge", 1, "Requests waiting"),
    Metric("vllm:num_preemptions", "counter", 3, "Preemptions so far"),
    Metric("vllm:prompt_tokens", "counter", 70, "Prompt tokens processed"),
    Metric("vllm:generation_tokens", "counter", 40, "Generated tokens"),
    Metric("vllm:prefix_cache_queries", "counter", 64, "Prompt tokens looked up"),
    Metric("vllm:prefix_cache_hits", "counter", 16, "Prompt tokens found cached"),
    Metric("minivllm:prefix_cache_hit_rate", "gauge", 0.25, "hits / queries, so far"),
]
LAST_STEP_HIT_RATE = (
    "minivllm:prefix_cache_hit_rate_last_step",
    "gauge",
    "hits / queries of the requests admitted in the last step",
)


def test_engine_metrics_are_named_and_described_as_vllm_does():
    """Every metric of an engine without speculative decoding, to the last word: the last
    step looked up 8 prompt tokens and found 6 cached, a hit rate of 0.75."""
    name, kind, description = LAST_STEP_HIT_RATE
    assert metrics_engine((8, 6), speculative=False).get_metrics() == [
        *ENGINE_METRICS,
        Metric(name, kind, 0.75, description),
    ]


def test_the_last_steps_hit_rate_is_zero_without_lookups_and_drafts_add_their_metrics():
    """A last step that admitted nobody has a hit rate of 0.0; with speculative decoding the
    spec-decode metrics follow the engine's own."""
    name, kind, description = LAST_STEP_HIT_RATE
    metrics = metrics_engine((0, 0), speculative=True).get_metrics()
    assert metrics[: len(ENGINE_METRICS) + 1] == [
        *ENGINE_METRICS,
        Metric(name, kind, 0.0, description),
    ]
    assert metrics[len(ENGINE_METRICS) + 1 :] == [
        Metric(*row) for row in spec_decode_metric_rows(SpecDecodeStats(1, 2, 1, [1, 0]))
    ]


@dataclass
class StandInSequence:
    name: str
    is_finished: bool = False


@dataclass
class RecordingScheduler:
    """The scheduler calls LLMEngine makes here: an abort finishes the sequence."""

    waiting: list = field(default_factory=list)
    running: list = field(default_factory=list)
    aborted: list = field(default_factory=list)

    def abort_request(self, sequence: StandInSequence) -> None:
        self.aborted.append(sequence.name)
        sequence.is_finished = True


def engine_with(requests: dict, scheduler: RecordingScheduler) -> LLMEngine:
    """An LLMEngine without a model: the methods tested here read only its requests and its
    scheduler."""
    engine = LLMEngine.__new__(LLMEngine)
    engine.requests, engine.scheduler = requests, scheduler
    return engine


def test_aborting_one_sequence_keeps_its_siblings_running():
    """Sequence 1 of a two-sequence request is aborted; the request stays (sequence 0 goes
    on). Aborting a finished sequence again, an index past the last one (2, and 5) or an
    unknown request does nothing."""
    first, second = StandInSequence("r#0"), StandInSequence("r#1")
    scheduler = RecordingScheduler()
    engine = engine_with({"r": [first, second]}, scheduler)
    engine.abort_sequences([("r", 1)])
    assert scheduler.aborted == ["r#1"] and engine.requests == {"r": [first, second]}
    engine.abort_sequences([("r", 1), ("r", 2), ("r", 5), ("unknown", 0)])
    assert scheduler.aborted == ["r#1"] and not first.is_finished
    assert engine.requests == {"r": [first, second]}


def test_aborting_the_last_running_sequence_forgets_the_request():
    """Sequence 0 already finished (its own stop rule); aborting sequence 1 ends the request,
    which is forgotten. Another request's sequences are untouched."""
    done, running = StandInSequence("r#0", is_finished=True), StandInSequence("r#1")
    other = StandInSequence("s#0")
    scheduler = RecordingScheduler()
    engine = engine_with({"r": [done, running], "s": [other]}, scheduler)
    engine.abort_sequences([("r", 1)])
    assert scheduler.aborted == ["r#1"]
    assert engine.requests == {"s": [other]}


def test_aborting_an_unknown_or_finished_request_does_nothing():
    scheduler = RecordingScheduler()
    engine = engine_with({}, scheduler)
    engine.abort_request("never-seen")
    engine.abort_request(["gone", "also-gone"])
    assert scheduler.aborted == [] and engine.requests == {}


@pytest.mark.parametrize(
    ("config_ids", "tokenizer_id", "expected"),
    [
        (2, 2, (2,)),  # an int, the tokenizer's the same: once
        ([5, 2], 2, (5, 2)),  # a list, in order, the tokenizer's already there
        ((7,), 9, (7, 9)),  # any sequence; the tokenizer's added last
        (None, 9, (9,)),  # the config names none
        (None, None, ()),
    ],
)
def test_eos_ids_come_from_the_config_and_the_tokenizer_once_each(
    config_ids, tokenizer_id, expected
):
    config = SimpleNamespace() if config_ids is None else SimpleNamespace(eos_token_id=config_ids)
    tokenizer = SimpleNamespace(eos_token_id=tokenizer_id)
    assert eos_token_ids(config, tokenizer) == expected


@dataclass
class LookingUpScheduler:
    """A step that only looks up prompts in the prefix cache (3 tokens, 2 found) and
    schedules nothing to run."""

    prefix_cache_stats: PrefixCacheStats = field(default_factory=lambda: PrefixCacheStats(10, 4))

    def schedule(self) -> SimpleNamespace:
        self.prefix_cache_stats.queries += 3
        self.prefix_cache_stats.hits += 2
        return SimpleNamespace(is_empty=True)

    def update_from_output(self, scheduler_output, runner_output) -> list:
        return []


def test_a_step_counts_the_prefix_cache_lookups_it_made_itself():
    """The last step's queries and hits (what the hit-rate gauge of one step shows) are the
    counters' growth during the step, not their totals."""
    engine = engine_with({}, LookingUpScheduler())
    assert engine.step() == []
    assert engine.last_step_prefix_cache == (3, 2)


def test_a_request_output_is_its_first_sequences_prompt_and_every_sequences_completion():
    """n=2: the prompt, its ids, the metrics, the cached tokens and the prompt's logprobs are
    the first sequence's (they share the prompt); one completion per sequence; finished once
    both are."""

    def sequence(index: int, finished: bool) -> SimpleNamespace:
        completion = CompletionOutput(index, f"text {index}", [index])
        return SimpleNamespace(
            prompt="Hi" if index == 0 else "not read",
            prompt_token_ids=[1, 2],
            metrics=f"metrics of {index}",
            num_cached_tokens=16 * (index + 1),
            prompt_logprobs=[None, {2: Logprob(-1.0)}],
            has_all_prompt_logprobs=True,
            is_finished=finished,
            completion_output=lambda: completion,
        )

    engine = engine_with({"r": [sequence(0, True), sequence(1, False)]}, RecordingScheduler())
    output = engine._request_output("r")
    assert (output.request_id, output.prompt, output.prompt_token_ids) == ("r", "Hi", [1, 2])
    assert (output.metrics, output.num_cached_tokens) == ("metrics of 0", 16)
    assert output.prompt_logprobs == [None, {2: Logprob(-1.0)}]
    assert [c.text for c in output.outputs] == ["text 0", "text 1"] and not output.finished
    engine.requests["r"][1].is_finished = True
    assert engine._request_output("r").finished
    engine.requests["r"][0].has_all_prompt_logprobs = False  # still scoring the prompt
    assert engine._request_output("r").prompt_logprobs is None


def test_add_request_queues_one_sequence_per_completion_with_the_requests_settings():
    """n=2: sequences "r#0" and "r#1", each with its index, the prompt's text and ids, the
    request's cache salt and priority (0 by default), and the user's id as their parent."""
    queued = []
    engine = engine_with({}, SimpleNamespace(add_request=queued.append))
    engine.processor = Processor(CHARACTERS, vocab_size=200, max_model_len=64)
    engine.tokenizer, engine.eos_token_ids, engine.max_model_len = CHARACTERS, (0,), 64
    params = SamplingParams(n=2, max_tokens=2, detokenize=False)
    engine.add_request("r", {"prompt": "Hi", "cache_salt": "s"}, params)
    engine.add_request("urgent", "Yo", SamplingParams(max_tokens=2, detokenize=False), priority=-3)
    assert [(q.request_id, q.index, q.parent_request_id) for q in queued] == [
        ("r#0", 0, "r"),
        ("r#1", 1, "r"),
        ("urgent#0", 0, "urgent"),
    ]
    assert [(q.prompt, q.prompt_token_ids, q.cache_salt) for q in queued[:2]] == [
        ("Hi", [72, 105], "s")
    ] * 2
    assert [q.priority for q in queued] == [0, 0, -3] and queued[2].cache_salt is None
    assert engine.requests["r"] == queued[:2]


def test_unfinished_requests_are_the_waiting_and_the_running_ones():
    scheduler = RecordingScheduler(waiting=["a", "b"], running=["c", "d", "e"])
    assert engine_with({}, scheduler).get_num_unfinished_requests() == 5


# --- the front end's cumulative logprob after a stop string ----------------------------------


def test_a_stop_string_recomputes_the_cumulative_logprob_of_the_kept_tokens():
    """The core's -7.0 counts three tokens; a stop string kept two: the previous -1.0 plus
    their -2.0 and -0.5, added in order. The third token's logprob is not counted."""
    sequence = SequenceState(detokenizer=None, cumulative_logprob=-1.0)
    new = CompletionOutput(0, "", [4, 5, 6], -7.0, None)
    logprobs = [{4: Logprob(-2.0, 1), 9: Logprob(-0.1, 2)}, {5: Logprob(-0.5, 1)}]
    assert cumulative_logprob_after(sequence, [4, 5], logprobs, new) == -3.5
    assert sequence.cumulative_logprob == -1.0  # read, not changed


def test_the_cores_cumulative_logprob_stands_when_every_token_is_kept_or_none_are_scored():
    """All three tokens kept: the core's value as it is (even with logprobs). Without
    logprobs (None) there is nothing to add up: the core's value, even if tokens were cut."""
    sequence = SequenceState(detokenizer=None, cumulative_logprob=-1.0)
    new = CompletionOutput(0, "", [4, 5, 6], -7.0, None)
    scored = [{4: Logprob(-2.0)}, {5: Logprob(-0.5)}, {6: Logprob(-3.0)}]
    assert cumulative_logprob_after(sequence, [4, 5, 6], scored, new) == -7.0
    assert cumulative_logprob_after(sequence, [4], None, new) == -7.0


# --- deltas: what a step added ------------------------------------------------------------------


def cumulative(tokens: list[list[int]], finished=False, **fields) -> RequestOutput:
    """A cumulative output of request "r" as LLMEngine.step makes it: text and logprobs for
    every token so far (token t scores -t), prompt and prompt token ids repeated."""
    completions = [
        CompletionOutput(
            i,
            "text so far",
            list(ids),
            cumulative_logprob=-float(sum(ids)),
            logprobs=[{t: Logprob(-float(t))} for t in ids],
            finish_reason="length" if finished else None,
        )
        for i, ids in enumerate(tokens)
    ]
    return RequestOutput("r", "the prompt", [1, 2], completions, finished, **fields)


def test_a_delta_holds_only_the_new_tokens_and_their_logprobs():
    """Two steps of a request with two completions: the first delta has every token so far,
    the second only what came after; no text, no prompt (the front end has both), the other
    fields (cumulative logprob, num_cached_tokens) as they are now."""
    deltas = OutputDeltas()
    deltas.add("r")
    (first,) = deltas.split([cumulative([[5, 6], [7]], num_cached_tokens=4)])
    assert [c.token_ids for c in first.outputs] == [[5, 6], [7]]
    (second,) = deltas.split([cumulative([[5, 6, 8], [7, 9, 3]], num_cached_tokens=4)])
    assert [c.token_ids for c in second.outputs] == [[8], [9, 3]]
    assert [c.logprobs for c in second.outputs] == [
        [{8: Logprob(-8.0)}],
        [{9: Logprob(-9.0)}, {3: Logprob(-3.0)}],
    ]
    assert [c.text for c in second.outputs] == ["", ""]
    assert [c.cumulative_logprob for c in second.outputs] == [-19.0, -19.0]
    assert [c.index for c in second.outputs] == [0, 1]
    assert (second.request_id, second.prompt, second.prompt_token_ids) == ("r", None, [])
    assert (second.finished, second.num_cached_tokens, second.prompt_logprobs) == (False, 4, None)
    assert deltas.progress["r"].tokens_sent == [3, 3]


def test_a_completion_without_logprobs_has_a_delta_without_logprobs():
    deltas = OutputDeltas()
    deltas.add("r")
    output = RequestOutput("r", None, [1], [CompletionOutput(0, "", [5, 6])], False)
    (delta,) = deltas.split([output])
    assert (delta.outputs[0].token_ids, delta.outputs[0].logprobs) == ([5, 6], None)


def test_prompt_logprobs_travel_with_the_first_delta_only():
    prompt_logprobs = [None, {2: Logprob(-0.5, 1)}]
    deltas = OutputDeltas()
    deltas.add("r")
    (first,) = deltas.split([cumulative([[5]], prompt_logprobs=prompt_logprobs)])
    (second,) = deltas.split([cumulative([[5, 6]], prompt_logprobs=prompt_logprobs)])
    assert first.prompt_logprobs == prompt_logprobs and second.prompt_logprobs is None
    assert deltas.progress["r"].prompt_logprobs_sent


def test_a_request_with_prompt_logprobs_still_to_come_sends_none_until_then():
    """The prompt's logprobs arrive with a later step (a chunked prefill): nothing is sent
    until they are there, then they are sent once."""
    deltas = OutputDeltas()
    deltas.add("r")
    (early,) = deltas.split([cumulative([[5]])])
    assert early.prompt_logprobs is None and not deltas.progress["r"].prompt_logprobs_sent
    (late,) = deltas.split([cumulative([[5, 6]], prompt_logprobs=[None])])
    assert late.prompt_logprobs == [None]


def test_split_leaves_out_unknown_requests_and_forgets_finished_ones():
    """An output of a request the core forgot (aborted meanwhile) is left out, the ones after
    it are not; a finished request's progress is dropped."""
    deltas = OutputDeltas()
    deltas.add("r")
    deltas.add("s")
    unknown = RequestOutput("gone", None, [], [CompletionOutput(0, "", [1])], False)
    still = RequestOutput("s", None, [], [CompletionOutput(0, "", [3])], False)
    split = deltas.split([unknown, cumulative([[5]], finished=True), still])
    assert [d.request_id for d in split] == ["r", "s"]
    assert [d.finished for d in split] == [True, False]
    assert list(deltas.progress) == ["s"]


def test_the_front_ends_output_of_a_new_request_has_its_prompt_and_nothing_generated():
    prompt_token_ids = (1, 2)
    output = new_request_output("r", {"prompt": "Hi", "prompt_token_ids": prompt_token_ids})
    assert output == RequestOutput("r", "Hi", [1, 2], [], False)
    assert new_request_output("r", {"prompt_token_ids": [1]}).prompt is None


def test_merging_a_delta_takes_its_latest_state_and_starts_logprobs_where_there_were_none():
    """Growing fields are appended (logprobs too, from an empty list if the output had none
    yet); everything else is the delta's: finish reason, metrics, cached tokens."""
    output = new_request_output("r", {"prompt": None, "prompt_token_ids": [1]})
    merge_delta(output, RequestOutput("r", None, [], [CompletionOutput(0, "a", [4])], False))
    metrics = SimpleNamespace(first_token_time=1.5)
    scored = CompletionOutput(0, "b", [5], -1.0, [{5: Logprob(-1.0)}], "length")
    merge_delta(output, RequestOutput("r", None, [], [scored], True, metrics, 3))
    (completion,) = output.outputs
    assert (completion.text, completion.token_ids) == ("ab", [4, 5])
    assert completion.logprobs == [{5: Logprob(-1.0)}]
    assert (completion.finish_reason, completion.cumulative_logprob) == ("length", -1.0)
    assert (output.finished, output.metrics, output.num_cached_tokens) == (True, metrics, 3)


def test_forget_drops_the_given_requests_and_ignores_unknown_ones():
    deltas = OutputDeltas()
    for request_id in ("a", "b", "c"):
        deltas.add(request_id)
    deltas.forget(["a", "never-added", "c"])
    assert list(deltas.progress) == ["b"]


# --- data parallelism: metrics, errors, aborts --------------------------------------------------


def test_replica_metrics_are_summed_or_averaged_by_kind():
    """Counters and the four summed gauges (requests running and waiting, the KV pool's bytes
    and touched bytes) add up over the replicas; other gauges are averaged. Each metric keeps
    the first replica's kind and description, in the first replica's order."""
    summed_gauges = [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "minivllm:kv_cache_bytes",
        "minivllm:kv_cache_touched_bytes",
    ]

    def replica(scale: int, description: str) -> list[Metric]:
        return [
            Metric("vllm:prompt_tokens", "counter", 10 * scale, description),
            *(Metric(name, "gauge", 2 * scale, description) for name in summed_gauges),
            Metric("vllm:kv_cache_usage_perc", "gauge", 0.25 * scale, description),
        ]

    combined = aggregate_metrics([replica(1, "first"), replica(3, "second")])
    assert combined == [
        Metric("vllm:prompt_tokens", "counter", 40, "first"),
        *(Metric(name, "gauge", 8, "first") for name in summed_gauges),
        Metric("vllm:kv_cache_usage_perc", "gauge", 0.5, "first"),
    ]


def test_a_metric_only_one_replica_reports_is_its_own_value():
    """Only the second replica reports a gauge: its value, averaged over the one replica."""
    combined = aggregate_metrics(
        [
            [Metric("vllm:num_preemptions", "counter", 1, "d")],
            [Metric("vllm:num_preemptions", "counter", 2, "d"), Metric("g", "gauge", 0.5, "d")],
        ]
    )
    assert combined == [
        Metric("vllm:num_preemptions", "counter", 3, "d"),
        Metric("g", "gauge", 0.5, "d"),
    ]


def test_a_picklable_error_crosses_as_itself():
    error = ValueError("bad prompt")
    assert picklable_error(error) is error


class UnpicklableError(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.lock = threading.Lock()  # pickle refuses a lock


def test_an_unpicklable_error_crosses_as_a_runtime_error_with_its_text():
    converted = picklable_error(UnpicklableError("holds a lock"))
    assert type(converted) is RuntimeError
    assert str(converted) == "UnpicklableError: holds a lock"


@dataclass
class StandInPipe:
    """A pipe's sending end: records what is sent; a closed one raises BrokenPipeError."""

    closed: bool = False
    sent: list = field(default_factory=list)

    def send(self, message) -> None:
        if self.closed:
            raise BrokenPipeError("the replica is gone")
        self.sent.append(message)


def data_parallel_engine(num_replicas: int) -> DataParallelEngine:
    """A DataParallelEngine without processes: its replicas are pipes that record."""
    engine = DataParallelEngine.__new__(DataParallelEngine)
    engine.replicas = [Replica(index=i, conn=StandInPipe()) for i in range(num_replicas)]
    engine.request_replica = {}
    return engine


@dataclass
class StandInDuplex(StandInPipe):
    """A pipe both ways: records what is sent, hands out what `arrived` holds, in order."""

    arrived: deque = field(default_factory=deque)
    closes: int = 0

    def recv(self):
        return self.arrived.popleft()

    def poll(self) -> bool:
        return bool(self.arrived)

    def close(self) -> None:
        self.closes += 1


def test_data_parallel_call_all_returns_each_replicas_reply_and_keeps_reports_for_the_next_step():
    """call_all sends the call with its arguments to every replica and returns their replies
    in replica order; a step report that arrives before a reply updates its replica's load and
    adds its outputs to the ones already pending, for the next step() to return."""
    engine = data_parallel_engine(2)
    first, second = engine.replicas
    earlier = RequestOutput("e", None, [], [CompletionOutput(0, "", [9])], False)
    reported = RequestOutput("a", None, [], [CompletionOutput(0, "", [4])], False)
    engine.request_replica = {"a": first, "e": second}
    engine.pending = [earlier]
    first.conn = StandInDuplex(arrived=deque([StepReport([reported], 1, 2, 3), Reply("from 0")]))
    second.conn = StandInDuplex(arrived=deque([Reply("from 1")]))
    assert engine.call_all("method", "argument") == ["from 0", "from 1"]
    call = EngineCall("method", ("argument",), reply=True)
    assert first.conn.sent == [call] and second.conn.sent == [call]
    assert engine.pending == [earlier, reported]
    assert (first.waiting, first.running, first.num_received) == (1, 2, 3)


def test_a_replicas_failure_is_raised_with_its_error_and_the_replicas_traceback_as_causes():
    """The front end raises a RuntimeError naming the replica and the error; the replica's
    own error is its cause, and that error's cause shows where the replica raised it."""
    original = ValueError("bad prompt")
    error = Replica(index=3).failed(Failed(original, "Traceback: in replica 3"))
    assert str(error) == "data-parallel replica 3 failed: ValueError: bad prompt"
    assert error.__cause__ is original
    assert type(original.__cause__) is RemoteTraceback
    assert original.__cause__.text == "Traceback: in replica 3"


def test_a_dead_replica_is_reaped_with_a_bounded_wait_and_named_with_its_exit_code():
    """died() joins the process (so its exit code is known) without waiting for ever, and
    names the replica, its pid and its exit code."""
    process = StandInProcess(alive=False, exitcode=-9)  # defined with the MPClient tests
    error = Replica(index=1, process=process).died()
    assert str(error) == "data-parallel replica 1 (pid 4242) died with exit code -9"
    assert len(process.joins) == 1
    assert process.joins[0] is not None and 0 < process.joins[0] <= 5


def routing_engine(num_replicas: int) -> DataParallelEngine:
    """A stand-in data-parallel engine that can take requests: the character tokenizer's
    processor, blocks of 4 tokens, prefix affinity on."""
    engine = data_parallel_engine(num_replicas)
    engine.processor = Processor(CHARACTERS, vocab_size=200, max_model_len=64)
    engine.config = SimpleNamespace(block_size=4)
    engine.prefix_affinity = PrefixAffinity(4)
    engine.pending = []
    return engine


def test_data_parallel_add_request_sends_the_checked_request_and_counts_its_sequences():
    """The replica gets the processed prompt, the params and the priority (0 by default); it
    is charged every sequence sent (n each), and the router knows where each request went. An
    id in use is refused before anything is sent."""
    engine = routing_engine(1)
    (replica,) = engine.replicas
    engine.add_request("a", "Hi", SamplingParams(n=2, max_tokens=1))
    urgent = SamplingParams(n=3, max_tokens=1)
    engine.add_request("b", "Hi", urgent, priority=-1)
    prompt = {"prompt": "Hi", "prompt_token_ids": [72, 105], "cache_salt": None}
    assert replica.conn.sent[1] == AddRequest("b", prompt, urgent, -1)
    assert replica.conn.sent[0].priority == 0
    assert replica.num_sent == 5 and engine.request_replica == {"a": replica, "b": replica}
    with refused(ValueError, "request id 'a' is already in use"):
        engine.add_request("a", "Hi", urgent)
    assert len(replica.conn.sent) == 2


def test_data_parallel_affinity_keeps_salted_prefixes_apart():
    """Replica 1 holds the unsalted prefix of a prompt. The same tokens with a cache salt are
    another prefix (prefix caching never shares across salts), so the tie goes to replica 0,
    which is remembered as the salted prefix's owner."""
    engine = routing_engine(2)
    token_ids = list(range(10, 18))  # two full blocks
    engine.prefix_affinity.remember(hash_blocks(token_ids, 4), 1)
    engine.add_request("salted", {"prompt_token_ids": token_ids, "cache_salt": "user-7"}, ONE)
    assert engine.request_replica["salted"].index == 0
    salted = hash_blocks(token_ids, 4, "user-7")
    assert engine.prefix_affinity.preferred_replica(salted) == 0


def test_a_data_parallel_engine_with_outputs_still_to_hand_out_has_unfinished_work():
    engine = routing_engine(1)
    assert not engine.has_unfinished_requests()
    engine.pending = [RequestOutput("a", None, [], [], True)]  # read while a call waited
    assert engine.has_unfinished_requests()


def test_a_replicas_failed_message_is_raised_as_its_failure():
    """A step report, then Failed: reading stops there with the replica's error."""
    engine = data_parallel_engine(1)
    (replica,) = engine.replicas
    engine.request_replica = {"a": replica}
    output = RequestOutput("a", None, [], [CompletionOutput(0, "", [4])], False)
    replica.conn = StandInDuplex(
        arrived=deque([StepReport([output], 0, 1, 1), Failed(ValueError("no memory"), "tb")])
    )
    with refused(RuntimeError, "data-parallel replica 0 failed: ValueError: no memory"):
        engine.read_available(replica)


def test_shutting_replicas_down_asks_each_to_stop_waits_and_closes_its_pipe():
    """Each replica is told Shutdown (a gone one is skipped), each process is joined within
    the shutdown's time, and every pipe is closed."""
    replicas = [
        Replica(index=i, conn=StandInDuplex(), process=StandInProcess(alive=False))
        for i in range(2)
    ]
    replicas[0].conn.closed = True  # its replica is gone: the send raises
    shutdown_replicas(replicas)
    assert replicas[1].conn.sent == [Shutdown()]
    for replica in replicas:
        assert replica.conn.closes == 1 and len(replica.process.joins) == 1


def test_a_replica_is_ready_with_its_context_or_raises_its_startup_error_with_its_traceback():
    ready = Replica(index=0, conn=StandInDuplex(arrived=deque([Ready(max_model_len=512)])))
    assert dp_wait_until_ready(ready) == 512
    error = ValueError("pool too small")
    failed = Failed(error, "Traceback: in the replica")
    broken = Replica(index=0, conn=StandInDuplex(arrived=deque([failed])))
    with pytest.raises(ValueError, match="pool too small") as raised:
        dp_wait_until_ready(broken)
    assert raised.value is error and type(error.__cause__) is RemoteTraceback
    assert error.__cause__.text == "Traceback: in the replica"


@dataclass
class StubbornProcess:
    """A process that stops only when terminated (or killed, if `ignores_terminate`); its
    joins record their timeouts and, on the shared clock, take all of it while it runs."""

    clock: list[float]
    ignores_terminate: bool = False
    alive: bool = True
    joins: list = field(default_factory=list)
    signals: list[str] = field(default_factory=list)

    def join(self, timeout=None) -> None:
        self.joins.append(timeout)
        if self.alive and timeout is not None:
            self.clock[0] += timeout

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.signals.append("terminate")
        self.alive = self.ignores_terminate

    def kill(self) -> None:
        self.signals.append("kill")
        self.alive = False


def test_stopping_processes_shares_one_deadline_then_terminates_then_kills(monkeypatch):
    """Asked to stop, neither process does: the first is given the whole SHUTDOWN_TIMEOUT_S,
    the second what is left of it (nothing), not a time of its own. Then each is terminated
    and given 2 s; one that ignores that is killed and waited for."""
    clock = [100.0]
    monkeypatch.setattr(data_parallel.time, "monotonic", lambda: clock[0])
    polite, stubborn = StubbornProcess(clock), StubbornProcess(clock, ignores_terminate=True)
    stop_processes([polite, stubborn])
    assert polite.joins == [SHUTDOWN_TIMEOUT_S, 2] and polite.signals == ["terminate"]
    assert stubborn.joins == [0.0, 2, None] and stubborn.signals == ["terminate", "kill"]


def test_a_process_that_stops_when_asked_is_not_terminated(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(data_parallel.time, "monotonic", lambda: clock[0])
    stopped = StubbornProcess(clock, alive=False)
    stop_processes([stopped])
    assert stopped.joins == [SHUTDOWN_TIMEOUT_S] and stopped.signals == []


def test_data_parallel_aborts_of_sequences_go_to_their_replicas_once_each():
    """Sequences of requests on replicas 0 and 1: each replica gets one call with its own
    sequences, in order; a request no replica has is ignored; the router keeps the requests
    (their other sequences go on)."""
    engine = data_parallel_engine(3)
    first, second, third = engine.replicas
    engine.request_replica = {"a": first, "b": second, "c": first}
    engine.abort_sequences([("a", 1), ("b", 0), ("unknown", 0), ("c", 2)])
    assert first.conn.sent == [EngineCall("abort_sequences", ([("a", 1), ("c", 2)],))]
    assert second.conn.sent == [EngineCall("abort_sequences", ([("b", 0)],))]
    assert third.conn.sent == []
    assert engine.request_replica == {"a": first, "b": second, "c": first}


def test_data_parallel_aborts_of_requests_forget_them_and_survive_a_dead_replica():
    """abort_request: each replica gets its requests' ids; the router forgets them. A replica
    whose pipe is closed (it died) is skipped without an error; the others still hear. A
    single id may be given as a string."""
    engine = data_parallel_engine(2)
    first, second = engine.replicas
    first.conn.closed = True
    engine.request_replica = {"a": first, "b": second, "c": second}
    engine.abort_request(["a", "b", "c", "unknown"])
    assert second.conn.sent == [EngineCall("abort_request", (["b", "c"],))]
    assert engine.request_replica == {}
    engine.request_replica = {"late": second}
    engine.abort_request("late")  # one id, not a list: not read as the list of its letters
    assert second.conn.sent[-1] == EngineCall("abort_request", (["late"],))


# --- the engine core: messages in, reports out --------------------------------------------------


class StandInEngine:
    """The calls the engine core makes on an engine, recorded in `calls` (name and arguments).
    Each request runs `steps` steps and has a token from step `first_output` on (before, a
    chunked prefill: no output); its cumulative outputs are tokens 10, 11, ... Requests in
    `refuse` are refused by add_request. Its scheduler holds one waiting and two running
    requests, for the load a report carries."""

    def __init__(self, steps: int = 2, first_output: int = 1, refuse: tuple = ()) -> None:
        self.steps, self.first_output, self.refuse = steps, first_output, refuse
        self.progress: dict[str, int] = {}
        self.calls: list[tuple] = []
        self.fail_step = False
        self.scheduler = SimpleNamespace(waiting=["w"], running=["r1", "r2"])
        self.name = "stand-in"

    def add_request(self, request_id, prompt, params, priority=0) -> None:
        self.calls.append(("add_request", request_id, prompt, params, priority))
        if request_id in self.refuse:
            raise ValueError(f"{request_id} does not fit")
        self.progress[request_id] = 0

    def abort_request(self, request_ids) -> None:
        self.calls.append(("abort_request", request_ids))
        for request_id in request_ids:
            self.progress.pop(request_id, None)

    def abort_sequences(self, sequences) -> None:
        self.calls.append(("abort_sequences", sequences))

    def has_unfinished_requests(self) -> bool:
        return bool(self.progress) or self.fail_step

    def get_num_unfinished_requests(self) -> int:
        return len(self.progress) + 4  # distinct from any count a test makes by mistake

    def step(self) -> list[RequestOutput]:
        self.calls.append(("step",))
        if self.fail_step:
            raise RuntimeError("the step failed")
        outputs = []
        for request_id in list(self.progress):
            count = self.progress[request_id] = self.progress[request_id] + 1
            finished = count == self.steps
            if finished:
                del self.progress[request_id]
            if count >= self.first_output:
                completion = CompletionOutput(
                    0, "", list(range(10, 10 + count)), finish_reason="length" if finished else None
                )
                outputs.append(RequestOutput(request_id, None, [1], [completion], finished))
        return outputs

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))


def test_the_core_hands_each_message_to_the_engine():
    """AddRequest -> engine.add_request with every field (the priority as a keyword);
    AbortRequests -> engine.abort_request with the ids; AbortSequences ->
    engine.abort_sequences with the pairs. The core counts the sequences it received."""
    engine = StandInEngine()
    core = EngineCore(engine)
    assert (core.num_received, core.errors, core.deltas.progress) == (0, {}, {})
    two = SamplingParams(n=2, max_tokens=1)
    core.handle(AddRequest("a", PROMPT, two, priority=3))
    core.handle(AddRequest("b", PROMPT, ONE))
    core.handle(AbortSequences([("a", 1)]))
    core.handle(AbortRequests(["b"]))
    assert engine.calls == [
        ("add_request", "a", PROMPT, two, 3),
        ("add_request", "b", PROMPT, ONE, 0),
        ("abort_sequences", [("a", 1)]),
        ("abort_request", ["b"]),
    ]
    assert core.num_received == 3  # two sequences of a, one of b
    assert list(core.deltas.progress) == ["a"]  # b was aborted


def test_a_refused_request_is_reported_with_its_error_once():
    """add_request refuses "bad": the core keeps the engine's error (the exception itself,
    picklable) for the next report, counts its sequence, and does not follow it; the report
    after that has no errors. The core has work while an error waits to be sent."""
    engine = StandInEngine(refuse=("bad",))
    core = EngineCore(engine)
    core.add_request(AddRequest("bad", PROMPT, ONE))
    assert core.num_received == 1 and core.deltas.progress == {}
    assert core.has_work() and not engine.has_unfinished_requests()
    report = core.step()
    (error,) = report.errors.values()
    assert list(report.errors) == ["bad"] and report.outputs == []
    assert type(error) is ValueError and str(error) == "bad does not fit"
    assert not core.has_work() and core.step().errors == {}


def test_an_abort_drops_the_requests_progress_and_its_waiting_error():
    """Aborting a refused request drops its error (nobody waits for it); aborting a running
    one tells the engine and forgets its progress; ids the core never saw are harmless."""
    engine = StandInEngine(refuse=("bad",))
    core = EngineCore(engine)
    core.add_request(AddRequest("bad", PROMPT, ONE))
    core.add_request(AddRequest("good", PROMPT, ONE))
    core.add_request(AddRequest("other", PROMPT, ONE))
    core.abort_requests(["bad", "good", "never-seen"])
    assert engine.calls[-1] == ("abort_request", ["bad", "good", "never-seen"])
    assert core.errors == {} and list(core.deltas.progress) == ["other"]


def test_the_core_has_work_while_the_engine_has_unfinished_requests():
    engine = StandInEngine()
    core = EngineCore(engine)
    assert not core.has_work()
    core.add_request(AddRequest("a", PROMPT, ONE))
    assert core.has_work()


def test_a_step_reports_the_engines_outputs_as_deltas_with_its_time():
    """Two steps of a request: each report holds the step's delta (the new token only), no
    errors, and the time the step ended (time.monotonic)."""
    engine = StandInEngine(steps=2)
    core = EngineCore(engine)
    core.add_request(AddRequest("a", PROMPT, ONE))
    before = time.monotonic()
    first = core.step()
    second = core.step()
    assert [o.outputs[0].token_ids for o in first.outputs] == [[10]]
    assert [o.outputs[0].token_ids for o in second.outputs] == [[11]]
    assert (first.errors, second.errors) == ({}, {})
    assert before <= first.timestamp <= second.timestamp <= time.monotonic()
    assert [call[0] for call in engine.calls] == ["add_request", "step", "step"]


def test_without_unfinished_requests_the_core_does_not_step_the_engine():
    engine = StandInEngine()
    report = EngineCore(engine).step()
    assert (report.outputs, report.errors) == ([], {}) and engine.calls == []


class StandInSocket:
    """The ZMQ socket calls the engine core and its clients make. Incoming messages come in
    batches: a blocking receive waits for the next batch (here: it arrives at once), a
    NOBLOCK one takes a message that already arrived or raises zmq.Again; a loop that polls
    an empty socket over and over (instead of blocking) is stopped with an AssertionError, and
    so is a blocking receive with nothing left to arrive (it would wait for ever). Sends are
    recorded (message, flags); the first `full` sends raise zmq.Again, as on a full queue.
    `on_send(message)` runs after each send."""

    def __init__(self, *batches, arrived=(), full: int = 0) -> None:
        self.batches = deque(list(batch) for batch in batches)
        self.arrived = deque(arrived)
        self.receives: list[str] = []  # "block" or "noblock", in order
        self.empty_polls = 0
        self.sent: list[tuple] = []
        self.polls: list[tuple] = []
        self.full = full
        self.on_send = None
        self.closes: list = []  # the linger of each close()

    def recv_pyobj(self, flags=0):
        if flags == zmq.NOBLOCK:
            self.receives.append("noblock")
            if self.arrived:
                return self.arrived.popleft()
            self.empty_polls += 1
            assert self.empty_polls < 100, "polls an empty socket instead of waiting"
            raise zmq.Again()
        self.receives.append("block")
        self.empty_polls = 0
        if not self.arrived:
            assert self.batches, "a blocking receive with nothing left to arrive"
            self.arrived.extend(self.batches.popleft())
        return self.arrived.popleft()

    def send_pyobj(self, message, flags=0) -> None:
        if self.full:
            self.full -= 1
            raise zmq.Again()
        self.sent.append((message, flags))
        if self.on_send is not None:
            self.on_send(message)

    def poll(self, timeout=None, flags=zmq.POLLIN) -> int:
        self.polls.append((timeout, flags))
        return 0

    def sent_messages(self) -> list:
        return [message for message, _ in self.sent]

    def close(self, linger=None) -> None:
        self.closes.append(linger)


def test_receive_waits_only_when_told_and_takes_everything_that_arrived():
    """Not blocking with nothing there: an empty list at once. Blocking: the first message
    that arrives, then every message already there, without waiting again."""
    socket = StandInSocket(["a", "b"], ["c"])
    core = EngineCoreProc(StandInEngine(), socket, StandInSocket())
    assert core.receive(block=False) == []
    assert core.receive(block=True) == ["a", "b"]
    assert socket.receives == ["noblock", "block", "noblock", "noblock"]
    assert list(socket.batches) == [["c"]]  # not waited for


def test_receive_without_blocking_takes_what_already_arrived():
    socket = StandInSocket(arrived=["a", "b"])
    core = EngineCoreProc(StandInEngine(), socket, StandInSocket())
    assert core.receive(block=False) == ["a", "b"]
    assert socket.receives == ["noblock", "noblock", "noblock"]


def engine_and_args(engine, *args):
    """A function the tests send to the core (pickled by name): what it was given."""
    return engine.name, args


def returns_a_lock(engine):
    return threading.Lock()


def raises_an_unpicklable_error(engine):
    raise UnpicklableError("cannot travel")


def test_a_function_call_runs_with_the_engine_and_its_arguments():
    core = EngineCoreProc(StandInEngine(), StandInSocket(), StandInSocket())
    result = core.call(FunctionCall(pickle.dumps(engine_and_args), (1, "x")))
    assert result == CallResult(("stand-in", (1, "x")))


def test_an_engine_call_calls_the_named_method_with_its_arguments():
    engine = StandInEngine()
    core = EngineCoreProc(engine, StandInSocket(), StandInSocket())
    assert core.call(EngineCall("get_num_unfinished_requests")) == CallResult(4)
    assert core.call(EngineCall("abort_request", (["a"],))) == CallResult(None)
    assert engine.calls == [("abort_request", ["a"])]


def test_a_failing_call_returns_its_error_and_the_core_lives_on():
    """A method that does not exist, a result that cannot be pickled (it could not travel
    back) and an exception that cannot be pickled: each call's CallResult holds the error
    (the last one as a RuntimeError with its text), no value."""
    core = EngineCoreProc(StandInEngine(), StandInSocket(), StandInSocket())
    missing = core.call(EngineCall("no_such_method"))
    assert missing.value is None and type(missing.error) is AttributeError
    assert "no_such_method" in str(missing.error)
    lock = core.call(FunctionCall(pickle.dumps(returns_a_lock)))
    assert lock.value is None and type(lock.error) is TypeError and "lock" in str(lock.error)
    unpicklable = core.call(FunctionCall(pickle.dumps(raises_an_unpicklable_error)))
    assert type(unpicklable.error) is RuntimeError
    assert str(unpicklable.error) == "UnpicklableError: cannot travel"


def test_apply_answers_function_calls_and_engine_calls_that_ask_for_a_reply():
    """A request goes to the engine and nothing is sent; an EngineCall without reply=True is
    made but not answered; with reply=True, and a FunctionCall always, the CallResult is
    sent back."""
    engine = StandInEngine()
    outputs = StandInSocket()
    core = EngineCoreProc(engine, StandInSocket(), outputs)
    core.apply(AddRequest("a", PROMPT, ONE))
    core.apply(EngineCall("abort_request", (["x"],)))
    assert outputs.sent == []
    core.apply(EngineCall("get_num_unfinished_requests", reply=True))
    core.apply(FunctionCall(pickle.dumps(engine_and_args), (7,)))
    assert outputs.sent_messages() == [CallResult(5), CallResult(("stand-in", (7,)))]
    assert engine.calls == [("add_request", "a", PROMPT, ONE, 0), ("abort_request", ["x"])]


def test_the_busy_loop_steps_while_there_is_work_and_waits_when_idle():
    """Batch 1 (a request, and one the engine refuses) arrives while the core is idle. The
    first step has no output yet (a chunked prefill) but the refusal's error: reported; the
    second and third bring a's tokens 10, 11 and 12 as deltas. Each report carries the
    scheduler's load and the sequences received. Idle again, the core waits for batch 2: a
    call answered, one not answered. Then Shutdown ends the loop; what came after it in the
    same batch is never applied."""
    engine = StandInEngine(steps=3, first_output=2, refuse=("bad",))
    inputs = StandInSocket(
        [AddRequest("a", PROMPT, ONE), AddRequest("bad", PROMPT, ONE)],
        [
            EngineCall("get_num_unfinished_requests", reply=True),
            EngineCall("abort_request", (["gone"],)),
        ],
        [Shutdown(), AddRequest("late", PROMPT, ONE)],
    )
    outputs = StandInSocket()
    EngineCoreProc(engine, inputs, outputs).run_busy_loop()
    sent = outputs.sent_messages()
    reports, answers = sent[:3], sent[3:]
    assert all(isinstance(report, EngineCoreOutputs) for report in reports)
    assert [list(report.errors) for report in reports] == [["bad"], [], []]
    assert [[o.outputs[0].token_ids for o in r.outputs] for r in reports] == [
        [],
        [[10, 11]],
        [[12]],
    ]
    assert [(r.num_waiting, r.num_running, r.num_received) for r in reports] == [(1, 2, 2)] * 3
    assert answers == [CallResult(4)]
    assert engine.calls[-1] == ("abort_request", ["gone"])
    assert "late" not in [call[1] for call in engine.calls if call[0] == "add_request"]
    # Idle: wait for a batch and take all of it (until zmq.Again); busy: only look.
    assert inputs.receives == [
        "block", "noblock", "noblock",  # batch 1
        "noblock", "noblock",  # before steps 2 and 3
        "block", "noblock", "noblock",  # batch 2
        "block", "noblock", "noblock",  # batch 3
    ]  # fmt: skip


def test_a_step_with_nothing_to_tell_sends_nothing():
    """A request whose first step yields no token (a chunked prefill) and no error: only the
    second step, with the token, is reported."""
    engine = StandInEngine(steps=2, first_output=2)
    inputs = StandInSocket([AddRequest("a", PROMPT, ONE)], [Shutdown()])
    outputs = StandInSocket()
    EngineCoreProc(engine, inputs, outputs).run_busy_loop()
    (report,) = outputs.sent_messages()
    assert [o.outputs[0].token_ids for o in report.outputs] == [[10, 11]]
    assert [call[0] for call in engine.calls] == ["add_request", "step", "step"]


# --- the in-process client: the core in a thread ------------------------------------------------


def shut_down(client) -> None:
    """client.shutdown() in a thread of its own, so that a shutdown that hangs fails the test
    instead of hanging it."""
    closer = threading.Thread(target=client.shutdown, daemon=True)
    closer.start()
    closer.join(HANG_GUARD_S)
    assert not closer.is_alive(), "shutdown hangs"


def test_a_client_shut_down_before_it_started_shuts_its_engine_down():
    engine = StandInEngine()
    shut_down(InprocClient(engine))
    assert engine.calls == [("shutdown",)]


def test_the_engine_thread_hands_messages_to_the_core_and_reports_each_step():
    """The thread (a daemon named minivllm-engine) wakes for each message: an abort that
    leaves nothing to do sends nothing; a request's two steps are two reports, its token
    deltas; a refused request is a report with its error; an abort of sequences reaches the
    engine as it was sent."""
    engine = StandInEngine(steps=2, refuse=("bad",))
    client = InprocClient(engine)
    reports, failures = [], []
    client.start(reports.append, failures.append)
    try:
        assert (client._thread.name, client._thread.daemon) == ("minivllm-engine", True)
        client.abort_requests(["nobody"])
        wait_for(lambda: ("abort_request", ["nobody"]) in engine.calls, "the abort", failures)
        client.add_request(AddRequest("a", PROMPT, ONE))
        wait_for(lambda: len(reports) == 2, "a's two reports", failures)
        client.add_request(AddRequest("bad", PROMPT, ONE))
        wait_for(lambda: len(reports) == 3, "the refusal's report", failures)
        client.abort_sequences([("a", 1)])
        wait_for(lambda: ("abort_sequences", [("a", 1)]) in engine.calls, "the abort", failures)
    finally:
        shut_down(client)
    assert failures == []
    assert all(isinstance(report, EngineCoreOutputs) for report in reports)
    assert [[o.outputs[0].token_ids for o in r.outputs] for r in reports] == [[[10]], [[11]], []]
    assert [list(report.errors) for report in reports] == [[], [], ["bad"]]
    assert [call[0] for call in engine.calls] == [
        "abort_request",
        "add_request",
        "step",
        "step",
        "add_request",
        "abort_sequences",
        "shutdown",
    ]


def test_a_failed_step_is_handed_to_on_failure_and_ends_the_thread():
    engine = StandInEngine()
    engine.fail_step = True
    client = InprocClient(engine)
    reports, failures = [], []
    client.start(reports.append, failures.append)
    try:
        client._thread.join(HANG_GUARD_S)
        assert not client._thread.is_alive()
    finally:
        shut_down(client)
    (failure,) = failures
    assert type(failure) is RuntimeError and str(failure) == "the step failed"
    assert reports == []


def test_shutdown_waits_for_the_thread_before_shutting_the_engine_down():
    """Shutdown while the thread is still handing over a report: the engine is shut down
    only once the thread has ended."""
    engine = StandInEngine(steps=1)
    client = InprocClient(engine)
    handing_over, alive_at_shutdown = threading.Event(), []

    def slow_delivery(report) -> None:
        handing_over.set()
        time.sleep(0.2)

    engine.shutdown = lambda: alive_at_shutdown.append(client._thread.is_alive())
    client.start(slow_delivery, lambda error: None)
    client.add_request(AddRequest("a", PROMPT, ONE))
    assert handing_over.wait(HANG_GUARD_S)
    shut_down(client)
    assert alive_at_shutdown == [False]


def test_call_engine_runs_the_function_with_the_engine_and_its_arguments():
    client = InprocClient(StandInEngine())
    assert client.call_engine(engine_and_args, 1, "x") == ("stand-in", (1, "x"))


class MetricsEngine(StandInEngine):
    """An engine that reports metrics (one KV-cache usage gauge)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics = [Metric("vllm:kv_cache_usage_perc", "gauge", 0.5, "usage")]

    def get_metrics(self) -> list[Metric]:
        return self.metrics


class ReplicatedEngine(MetricsEngine):
    """chapter 07's DataParallelEngine, as far as metrics go: two replicas' own."""

    def get_replica_metrics(self) -> list[list[Metric]]:
        return [
            [Metric("vllm:num_requests_running", "gauge", 1, "running")],
            [Metric("vllm:num_requests_running", "gauge", 3, "running")],
        ]


def test_one_engines_metrics_are_the_clients_metrics_as_they_are():
    engine = MetricsEngine()
    client = InprocClient(engine)
    assert client.get_replica_metrics() == [engine.metrics]
    assert client.get_metrics() is engine.metrics


def test_a_data_parallel_engines_replica_metrics_are_combined():
    client = InprocClient(ReplicatedEngine())
    assert client.get_replica_metrics() == ReplicatedEngine().get_replica_metrics()
    assert client.get_metrics() == [Metric("vllm:num_requests_running", "gauge", 4, "running")]


# --- the multiprocess client, without its processes ---------------------------------------------


@dataclass
class StandInProcess:
    alive: bool = True
    pid: int = 4242
    exitcode: int | None = None
    sentinel: int | None = None  # a file descriptor that is readable once the process ended
    joins: list = field(default_factory=list)

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout=None) -> None:
        self.joins.append(timeout)


def mp_client(num_cores: int, affinity: bool = False) -> MPClient:
    """An MPClient whose cores are stand-ins (sockets and processes that record), in blocks
    of 4 tokens, with prefix affinity if asked."""
    client = MPClient.__new__(MPClient)
    client.state = CoreProcesses(context=None, ipc_dir="unused")
    client.state.cores = [
        CoreProcess(
            index=i, process=StandInProcess(), inputs=StandInSocket(), outputs=StandInSocket()
        )
        for i in range(num_cores)
    ]
    client.request_core = {}
    client.block_size = 4
    client.prefix_affinity = PrefixAffinity(4) if affinity else None
    return client


def test_a_single_core_gets_every_request_and_counts_their_sequences():
    client = mp_client(1)
    (core,) = client.cores
    two = SamplingParams(n=2, max_tokens=1)
    client.add_request(AddRequest("a", PROMPT, two))
    client.add_request(AddRequest("b", PROMPT, ONE))
    assert core.inputs.sent == [
        (AddRequest("a", PROMPT, two), zmq.NOBLOCK),
        (AddRequest("b", PROMPT, ONE), zmq.NOBLOCK),
    ]
    assert core.num_sent == 3 and client.request_core == {"a": core, "b": core}


def test_a_request_goes_to_the_core_that_holds_its_prefix_else_the_least_loaded():
    """Core 1 received this salted prompt's blocks before: with equal loads, the request goes
    there. The next prompt is new: it goes to core 0, now the less loaded (core 1 counts a's
    two sequences as waiting), and core 0 is remembered as its blocks' owner."""
    client = mp_client(2, affinity=True)
    first, second = client.cores
    salted = {"prompt": None, "prompt_token_ids": list(range(1, 10)), "cache_salt": "s"}
    client.prefix_affinity.remember(hash_blocks(salted["prompt_token_ids"], 4, "s"), 1)
    two = SamplingParams(n=2, max_tokens=1)
    client.add_request(AddRequest("a", salted, two))
    assert second.inputs.sent_messages() == [AddRequest("a", salted, two)]
    assert first.inputs.sent == [] and (first.num_sent, second.num_sent) == (0, 2)
    new = {"prompt": None, "prompt_token_ids": [7] * 8}
    client.add_request(AddRequest("b", new, ONE))
    assert first.inputs.sent_messages() == [AddRequest("b", new, ONE)]
    assert client.request_core == {"a": second, "b": first}
    assert [client.prefix_affinity.owner[h] for h in hash_blocks([7] * 8, 4)] == [0, 0]


def test_aborts_go_to_the_cores_that_run_the_requests():
    """Three cores: each gets one message with its own requests' ids (or sequences), in
    order; unknown ids are ignored. Aborted requests are forgotten by the router, requests
    with aborted sequences are not (their other sequences go on). A dead core's aborts are
    dropped (its requests died with it), the others' still sent."""
    client = mp_client(3)
    first, second, third = client.cores
    client.request_core = {"a": first, "b": second, "c": first, "d": third}
    client.abort_sequences([("a", 1), ("b", 0), ("unknown", 0), ("c", 2)])
    assert first.inputs.sent_messages() == [AbortSequences([("a", 1), ("c", 2)])]
    assert second.inputs.sent_messages() == [AbortSequences([("b", 0)])]
    assert third.inputs.sent == []
    assert client.request_core == {"a": first, "b": second, "c": first, "d": third}
    third.inputs.full, third.process.alive = 1, False
    client.abort_requests(["c", "unknown", "b", "d", "a"])
    assert first.inputs.sent_messages()[1:] == [AbortRequests(["c", "a"])]
    assert second.inputs.sent_messages()[1:] == [AbortRequests(["b"])]
    assert third.inputs.sent == [] and client.request_core == {}


def test_a_send_to_a_full_queue_polls_until_it_fits():
    client = mp_client(1)
    (core,) = client.cores
    core.inputs.full = 2
    client._send(core, "message")
    assert core.inputs.sent == [("message", zmq.NOBLOCK)]
    assert core.inputs.polls == [(100, zmq.POLLOUT), (100, zmq.POLLOUT)]


def test_a_send_to_a_dead_core_raises_engine_dead_error_with_its_exit_code():
    client = mp_client(1)
    (core,) = client.cores
    core.inputs.full, core.process.alive, core.process.exitcode = 1, False, -9
    expected = "the engine core process 0 (pid 4242) died with exit code -9"
    with pytest.raises(EngineDeadError, match=f"^{re.escape(expected)}$"):
        client._send(core, "message")
    assert core.process.joins == [5] and core.inputs.sent == []


def answer_calls(client: MPClient, values: list) -> None:
    """Each core answers every call it is sent with its value, as the output thread would
    on the core's CallResult."""
    for core, value in zip(client.cores, values, strict=True):
        core.inputs.on_send = lambda message, core=core, value=value: core.calls[-1].set_result(
            value
        )


def test_call_engine_sends_the_function_by_name_and_returns_the_cores_answer():
    client = mp_client(1)
    answer_calls(client, ["answer"])
    assert client.call_engine(engine_and_args, 1, "x") == "answer"
    assert client.cores[0].inputs.sent == [
        (FunctionCall(pickle.dumps(engine_and_args), (1, "x")), zmq.NOBLOCK)
    ]


def test_call_engine_refuses_data_parallel_cores():
    client = mp_client(2)
    expected = (
        "call_engine needs a single engine core; with data parallelism use get_replica_metrics()"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        client.call_engine(engine_and_args)
    assert [core.inputs.sent for core in client.cores] == [[], []]


def test_each_core_is_asked_for_its_metrics_and_they_are_combined():
    client = mp_client(2)
    running = "vllm:num_requests_running"
    answer_calls(
        client, [[Metric(running, "gauge", 1, "running")], [Metric(running, "gauge", 3, "running")]]
    )
    assert client.get_replica_metrics() == [
        [Metric(running, "gauge", 1, "running")],
        [Metric(running, "gauge", 3, "running")],
    ]
    assert client.get_metrics() == [Metric(running, "gauge", 4, "running")]
    for core in client.cores:
        assert core.inputs.sent_messages() == [EngineCall("get_metrics", reply=True)] * 2
        assert core.calls == deque([core.calls[0], core.calls[1]])


def test_a_call_to_cores_that_stopped_fails_at_once():
    """After a failure (the cause of the error raised) or during shutdown, a call raises
    EngineDeadError and sends nothing: no answer would ever come."""
    client = mp_client(1)
    (core,) = client.cores

    def must_not_send(message) -> None:
        raise AssertionError(f"sent {message} to a core that stopped")

    core.inputs.on_send = must_not_send
    failure = RuntimeError("the core died")
    client.state.failure = failure
    with pytest.raises(EngineDeadError, match="^the engine core is not running$") as raised:
        client.get_replica_metrics()
    assert raised.value.__cause__ is failure
    client.state.failure, client.state.closing = None, True
    with pytest.raises(EngineDeadError, match="^the engine core is not running$") as raised:
        client.call_engine(engine_and_args)
    assert raised.value.__cause__ is None and core.calls == deque()


def test_the_output_thread_delivers_reports_and_answers_calls_in_order():
    """A core's report: handed to on_outputs, its load taken (waiting, running, sequences
    received), its finished and refused requests forgotten by the router (but not a request
    of another core). Then two answers: the oldest call gets the first, a value; the next an
    exception. Reading stops when nothing more has arrived."""
    client = mp_client(2)
    other, core = client.cores
    client.request_core = {"a": core, "b": core, "c": other, "bad": core}
    first_call, second_call = Future(), Future()
    core.calls.extend([first_call, second_call])

    def output(request_id: str, finished: bool) -> RequestOutput:
        return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [1])], finished)

    report = EngineCoreOutputs(
        [output("a", True), output("b", False), output("c", True)],
        errors={"bad": ValueError("refused")},
        num_waiting=3,
        num_running=2,
        num_received=7,
    )
    core.outputs = StandInSocket(
        arrived=[report, CallResult(value=42), CallResult(error=KeyError("missing"))]
    )
    reports = []
    client._read_available(core, reports.append)
    assert len(reports) == 1 and reports[0] is report
    assert (core.waiting, core.running, core.num_received) == (3, 2, 7)
    assert client.request_core == {"b": core, "c": other}
    assert first_call.result(0) == 42
    assert type(second_call.exception(0)) is KeyError and core.calls == deque()
    assert core.outputs.receives == ["noblock"] * 4  # three messages, then zmq.Again


def test_a_cores_failure_message_ends_the_engine_with_its_error_and_traceback():
    """The core sent Failed: EngineDeadError names the core and the error, whose cause is the
    core's own exception, whose cause in turn shows the core's traceback."""
    client = mp_client(2)
    core = client.cores[1]
    error = ValueError("bad weights")
    core.outputs = StandInSocket(arrived=[Failed(error, "Traceback: in the core")])
    expected = "the engine core 1 failed: ValueError: bad weights"
    with pytest.raises(EngineDeadError, match=f"^{re.escape(expected)}$") as raised:
        client._read_available(core, lambda report: None)
    assert raised.value.__cause__ is error
    assert type(error.__cause__) is RemoteTraceback
    assert error.__cause__.text == "Traceback: in the core"


class WatchedSocket(StandInSocket):
    """A stand-in socket a zmq.Poller can watch (its file descriptor never becomes readable).
    `late` messages arrive just after its first empty read: a core's last words may come
    between two reads of the output thread."""

    def __init__(self, late=()) -> None:
        super().__init__()
        self.late = list(late)
        self.never_readable, self.writer = os.pipe()

    def fileno(self) -> int:
        return self.never_readable

    def recv_pyobj(self, flags=0):
        try:
            return super().recv_pyobj(flags)
        except zmq.Again:
            self.arrived.extend(self.late)
            self.late = []
            raise


@pytest.fixture
def dying_cores():
    """An MPClient's output thread over two stand-in cores, of which core 1's process has
    just exited (exit code -9); its sentinel is the read end of a closed pipe, as a process
    sentinel is. Core 1 has a call pending."""
    client = mp_client(2)
    sentinel, writer = os.pipe()
    os.close(writer)  # the process ended
    client.cores[1].process = StandInProcess(alive=False, exitcode=-9, sentinel=sentinel)
    alive_sentinel, alive_writer = os.pipe()  # core 0 lives on
    client.cores[0].process = StandInProcess(sentinel=alive_sentinel)
    for core in client.cores:
        core.outputs = WatchedSocket()
    client.cores[1].calls.append(Future())
    yield client
    os.close(alive_writer)
    for core in client.cores:
        os.close(core.process.sentinel)
        os.close(core.outputs.never_readable)
        os.close(core.outputs.writer)


def test_a_core_that_dies_ends_the_engine_with_its_last_words(dying_cores):
    """Core 1's report and its Failed arrive only after the thread's first read: the thread
    reads once more when the process has ended, delivers the report, and ends the engine with
    the core's own error, which the pending call gets too, and which the client remembers."""
    client = dying_cores
    report = EngineCoreOutputs([], num_running=1)
    client.cores[1].outputs.late = [
        report,
        Failed(ValueError("out of memory"), "Traceback: in the core"),
    ]
    pending = client.cores[1].calls[0]
    reports, failures = [], []
    client._receive_outputs(reports.append, failures.append)
    assert reports == [report]
    (failure,) = failures
    assert str(failure) == "the engine core 1 failed: ValueError: out of memory"
    assert client.state.failure is failure and client.cores[1].calls == deque()
    assert type(pending.exception(0)) is EngineDeadError
    assert str(pending.exception(0)) == f"the engine stopped: {failure}"


def test_a_core_that_dies_silently_is_named_with_its_exit_code(dying_cores):
    client = dying_cores
    failures = []
    client._receive_outputs(lambda report: None, failures.append)
    (failure,) = failures
    assert type(failure) is EngineDeadError
    assert str(failure) == "the engine core process 1 (pid 4242) died with exit code -9"
    assert client.cores[1].process.joins == [5]  # reaped, so the exit code is known


def test_a_core_that_exits_during_a_shutdown_ends_the_thread_quietly(dying_cores):
    client = dying_cores
    client.state.closing = True
    pending = client.cores[1].calls[0]
    client._receive_outputs(lambda report: None, lambda error: pytest.fail(f"told: {error}"))
    assert client.state.failure is None and not pending.done()


def test_the_output_thread_sleeps_while_its_cores_are_quiet(dying_cores):
    """Core 1 lives for a while and sends nothing: the thread waits in its poll for a message
    or a process's end, instead of reading the sockets over and over (a stand-in socket
    fails a thread that reads it empty 100 times)."""
    client = dying_cores
    sentinel, writer = os.pipe()  # core 1's process, alive until the writer is closed
    os.close(client.cores[1].process.sentinel)
    client.cores[1].process.sentinel = sentinel
    failures = []
    thread = threading.Thread(
        target=client._receive_outputs, args=(lambda report: None, failures.append)
    )
    thread.start()
    time.sleep(0.3)
    os.close(writer)  # now it exits
    thread.join(HANG_GUARD_S)
    (failure,) = failures
    assert str(failure) == "the engine core process 1 (pid 4242) died with exit code -9"
    # One wake-up (the exit): each core read once, core 1 once more for any last words.
    assert [core.outputs.empty_polls for core in client.cores] == [1, 2]


def test_generate_hands_the_requests_priority_to_add_request():
    """AsyncLLM.generate passes its priority through, 0 when none is given (a lower value runs
    first under the priority policy, so a changed default would reorder every request)."""

    class Queued(Exception):
        pass

    priorities = []

    def add_request(request_id, prompt, params, *, priority):
        priorities.append(priority)
        raise Queued  # stop here: nothing runs the engine

    llm = object.__new__(AsyncLLM)  # no engine core: only generate's own lines run
    llm.add_request = add_request

    async def first_output(**kwargs):
        with pytest.raises(Queued):
            await llm.generate("a prompt", None, "r", **kwargs).__anext__()

    asyncio.run(first_output())
    asyncio.run(first_output(priority=7))
    assert priorities == [0, 7]


# --- shutting the core processes down --------------------------------------------------------------


@dataclass
class StandInThread:
    joins: int = 0

    def join(self, timeout=None) -> None:
        self.joins += 1


@dataclass
class StandInContext:
    terminated: int = 0

    def term(self) -> None:
        self.terminated += 1


def core_processes(tmp_path, output_thread) -> CoreProcesses:
    """Two cores that have exited, their sockets and their socket directory."""
    ipc_dir = tmp_path / "ipc"
    ipc_dir.mkdir()
    (ipc_dir / "core-0-inputs").touch()
    state = CoreProcesses(StandInContext(), str(ipc_dir), output_thread=output_thread)
    state.cores = [
        CoreProcess(
            index=i,
            process=StandInProcess(alive=False, exitcode=0),
            inputs=StandInSocket(),
            outputs=StandInSocket(),
        )
        for i in range(2)
    ]
    return state


def test_a_client_whose_core_cannot_start_raises_instead_of_hanging(monkeypatch, tmp_path):
    """The first core's socket cannot bind (its directory is gone): MPClient shuts down and
    raises the error. The sockets made for that core must be closed by then, or shutdown's
    context.term() waits for them for ever. Nothing of the model is read before the cores
    start, so a directory that only looks like a model will do."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(core_client.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "gone"))
    raised = []

    def start() -> None:
        try:
            MPClient(EngineConfig(model=str(model)))
        except BaseException as error:
            raised.append(error)

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    starting.join(HANG_GUARD_S)
    assert not starting.is_alive(), "MPClient hangs after a core failed to start"
    (error,) = raised
    assert type(error) is zmq.ZMQError and "gone/in-0" in str(error)


def test_a_shutdown_stops_every_core_once_and_leaves_no_socket_thread_or_directory(tmp_path):
    """Each core is told to stop (without waiting on a full queue) and reaped; the output
    thread is joined; every socket closes without lingering (a dead core would never take
    what is left); the context ends and the socket directory is removed. A second shutdown
    does nothing."""
    thread = StandInThread()
    state = core_processes(tmp_path, output_thread=thread)
    state.shutdown()
    state.shutdown()
    for core in state.cores:
        assert core.inputs.sent == [(Shutdown(), zmq.NOBLOCK)]
        assert core.process.joins
        assert core.inputs.closes == [0] and core.outputs.closes == [0]
    assert thread.joins == 1
    assert state.context.terminated == 1
    assert not (tmp_path / "ipc").exists()


def test_a_shutdown_from_the_output_thread_with_its_directory_gone_ends_quietly(tmp_path):
    """The output thread shuts the cores down when one dies: it must not join itself, and a
    socket directory removed already is no error."""
    state = core_processes(tmp_path, output_thread=threading.current_thread())
    shutil.rmtree(tmp_path / "ipc")
    state.shutdown()
    assert state.context.terminated == 1


@pytest.mark.parametrize("make_client", [mp_client, data_parallel_engine])
def test_a_shutdown_runs_its_finalizer_and_leaves_nothing_for_exit(monkeypatch, make_client):
    """The finalizer stops the cores (the replicas); once it has run, interpreter exit has
    nothing left to do for this client (a process that makes many clients does not collect
    their finalizers)."""
    client = make_client(1)
    calls = []
    client._finalizer = lambda: calls.append("finalized")
    monkeypatch.setattr(atexit, "unregister", calls.append)
    client.shutdown()
    assert calls == ["finalized", client._finalizer]


def test_the_output_processor_forgets_aborted_requests_and_ignores_unknown_ids():
    processor = OutputProcessor(tokenizer=None)
    processor.requests = {"a": "the state of a", "b": "the state of b"}
    processor.abort_requests(["a", "nobody"])
    assert processor.requests == {"b": "the state of b"}


@dataclass
class StandInDetokenizer:
    """Records the tokens fed to it; the token `stop_at` completes the stop string "STOP".
    Its text is each token fed, as "<id>"."""

    stop_at: int | None = None
    fed: list[int] = field(default_factory=list)
    taken: int = 0
    finished_flags: list[bool] = field(default_factory=list)  # of each take_new_text

    def append_token(self, token_id: int) -> str | None:
        self.fed.append(token_id)
        return "STOP" if token_id == self.stop_at else None

    def take_new_text(self, finished: bool) -> str:
        self.finished_flags.append(finished)
        text = "".join(f"<{token_id}>" for token_id in self.fed[self.taken :])
        self.taken = len(self.fed)
        return text


def processor_with(*detokenizers: StandInDetokenizer) -> OutputProcessor:
    """An output processor holding request "r", one sequence per detokenizer; its tokenizer
    decodes a token as "<id>" too."""
    processor = OutputProcessor(SimpleNamespace(decode=lambda ids: f"<{ids[0]}>"))
    sequences = [SequenceState(detokenizer, None) for detokenizer in detokenizers]
    processor.requests["r"] = RequestState(SamplingParams(n=len(sequences)), sequences)
    return processor


def delta(*completions: CompletionOutput, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [], list(completions), finished)


@pytest.mark.parametrize(
    ("finish_reason", "fed"), [("stop", [4, 5]), ("length", [4, 5, 6]), (None, [4, 5, 6])]
)
def test_a_token_that_ended_its_sequence_as_stop_is_never_text(finish_reason, fed):
    """EOS or a stop token id (finish reason "stop" from the core) ends the sequence without
    becoming text, as in the engine; a sequence cut by its length keeps its last token's text."""
    detokenizer = StandInDetokenizer()
    new = CompletionOutput(0, "", [4, 5, 6], None, None, finish_reason=finish_reason)
    processed = processor_with(detokenizer).process_outputs([delta(new)])
    assert detokenizer.fed == fed
    (completion,) = processed.outputs[0].outputs
    assert completion.token_ids == [4, 5, 6]
    assert completion.text == "".join(f"<{token_id}>" for token_id in fed)


def test_a_stop_string_keeps_the_tokens_up_to_the_one_that_completed_it():
    """Token 5 completes the stop string within a delta of four (a speculative step): tokens
    and logprobs after it are dropped, the sequence stops with the string as its reason, and
    the core, which knows nothing of it, is told to abort the request. The cumulative logprob
    counts the kept tokens only."""
    detokenizer = StandInDetokenizer(stop_at=5)
    logprobs = [{token_id: Logprob(-1.0)} for token_id in [4, 5, 6, 7]]
    new = CompletionOutput(0, "", [4, 5, 6, 7], -4.0, logprobs)
    processor = processor_with(detokenizer)
    processor.requests["r"].sequences[0].cumulative_logprob = -1.0  # as of the last delta
    processed = processor.process_outputs([delta(new)])
    (completion,) = processed.outputs[0].outputs
    assert detokenizer.fed == [4, 5] and completion.cumulative_logprob == -3.0
    assert completion.token_ids == [4, 5]
    assert completion.logprobs == [{4: Logprob(-1.0, None, "<4>")}, {5: Logprob(-1.0, None, "<5>")}]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "STOP")
    assert processed.requests_to_abort == ["r"] and processor.requests == {}


def test_a_sequence_stopped_by_a_string_ends_alone_and_sends_nothing_more():
    """With two sequences, a stop string ends only its own: the core is told to abort that
    sequence, the request goes on, and what the core still sends of the stopped one is
    replaced by its final state with nothing new (no tokens, no text, no logprobs)."""
    stopped, running = StandInDetokenizer(stop_at=5), StandInDetokenizer()
    processor = processor_with(stopped, running)

    def completion(index: int, token_id: int) -> CompletionOutput:
        return CompletionOutput(index, "", [token_id], -1.0, [{token_id: Logprob(-1.0)}])

    first = processor.process_outputs([delta(completion(0, 5), completion(1, 8))])
    assert first.sequences_to_abort == [("r", 0)] and first.requests_to_abort == []
    assert not first.outputs[0].finished
    second = processor.process_outputs([delta(completion(0, 6), completion(1, 9))])
    late, going_on = second.outputs[0].outputs
    assert (late.index, late.token_ids, late.text, late.logprobs) == (0, [], "", [])
    assert (late.finish_reason, late.stop_reason) == ("stop", "STOP")
    assert (going_on.index, going_on.token_ids, going_on.text) == (1, [9], "<9>")
    assert stopped.fed == [5] and second.sequences_to_abort == []


def test_a_stop_string_in_a_later_delta_adds_to_the_cumulative_logprob_kept_so_far():
    """The core's -1.0 after the first delta is remembered; the second delta's stop string
    at token 5 keeps it (-2.0) and drops token 6: -3.0."""
    processor = processor_with(StandInDetokenizer(stop_at=5))
    processor.requests["r"].sequences[0].cumulative_logprob = 0.0  # logprobs asked for
    first = CompletionOutput(0, "", [4], -1.0, [{4: Logprob(-1.0)}])
    processor.process_outputs([delta(first)])
    second = CompletionOutput(0, "", [5, 6], -7.0, [{5: Logprob(-2.0)}, {6: Logprob(-4.0)}])
    (output,) = processor.process_outputs([delta(second)]).outputs
    assert output.outputs[0].cumulative_logprob == -3.0


def test_sequences_stopped_in_several_requests_of_one_step_are_all_aborted():
    processor = processor_with(StandInDetokenizer(stop_at=5), StandInDetokenizer())
    processor.requests["s"] = RequestState(
        SamplingParams(n=2),
        [SequenceState(StandInDetokenizer(stop_at=5), None), SequenceState(None, None)],
    )
    two = [CompletionOutput(0, "", [5]), CompletionOutput(1, "", [8])]
    step = [delta(*two), replace(delta(*two), request_id="s")]
    assert processor.process_outputs(step).sequences_to_abort == [("r", 0), ("s", 0)]


def test_a_request_gets_a_sequence_per_completion_each_with_its_own_detokenizer(monkeypatch):
    """n=3: three sequences, each with a detokenizer made from the prompt and the user's
    params; a cumulative logprob starts at 0.0 when logprobs are asked for, else None; no
    text asked for, no detokenizer."""
    made = []

    def for_params(tokenizer, prompt_token_ids, params):
        made.append((tokenizer, prompt_token_ids, params))
        return StandInDetokenizer()

    monkeypatch.setattr(
        output_processor, "IncrementalDetokenizer", SimpleNamespace(for_params=for_params)
    )
    processor = OutputProcessor(CHARACTERS)
    params = SamplingParams(n=3, logprobs=2)
    processor.add_request("r", [1, 2], params)
    state = processor.requests["r"]
    assert state.params is params and made == [(CHARACTERS, [1, 2], params)] * 3
    detokenizers = [sequence.detokenizer for sequence in state.sequences]
    assert len({id(d) for d in detokenizers}) == 3 and all(detokenizers)
    assert [sequence.cumulative_logprob for sequence in state.sequences] == [0.0] * 3
    processor.add_request("quiet", [1], SamplingParams(detokenize=False))
    (sequence,) = processor.requests["quiet"].sequences
    assert (sequence.detokenizer, sequence.cumulative_logprob) == (None, None) and len(made) == 3


def test_without_a_stop_string_a_delta_keeps_the_cores_verdict_and_gets_its_text():
    """The core's finish reason, stop reason, error and cumulative logprob pass through; the
    text is what the detokenizer releases, told whether the sequence has finished; logprobs get
    their tokens' text."""
    detokenizer = StandInDetokenizer()
    processor = processor_with(detokenizer)
    going_on = CompletionOutput(0, "", [4], -1.0, [{4: Logprob(-1.0, 1)}])
    (output,) = processor.process_outputs([delta(going_on)]).outputs
    assert output.outputs[0].logprobs == [{4: Logprob(-1.0, 1, "<4>")}]
    assert (output.outputs[0].text, output.finished) == ("<4>", False)
    failed = CompletionOutput(0, "", [5], -3.0, None, "error", 7, "the grammar broke")
    (output,) = processor.process_outputs([delta(failed, finished=True)]).outputs
    completion = output.outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("error", 7)
    assert (completion.error, completion.cumulative_logprob) == ("the grammar broke", -3.0)
    assert (completion.text, completion.token_ids, output.finished) == ("<5>", [5], True)
    assert detokenizer.finished_flags == [False, True] and processor.requests == {}


def test_without_text_a_delta_keeps_its_tokens_and_logprobs_as_the_core_sent_them():
    processor = processor_with(StandInDetokenizer())
    processor.requests["r"].sequences[0].detokenizer = None  # detokenize=False
    logprobs = [{4: Logprob(-1.0, 1)}, {5: Logprob(-2.0, 1)}]
    new = CompletionOutput(0, "", [4, 5], -3.0, logprobs, "length")
    (output,) = processor.process_outputs([delta(new, finished=True)]).outputs
    completion = output.outputs[0]
    assert (completion.text, completion.token_ids, completion.logprobs) == ("", [4, 5], logprobs)
    assert (completion.finish_reason, completion.cumulative_logprob) == ("length", -3.0)


@pytest.mark.parametrize("detokenize", [True, False])
def test_prompt_logprobs_get_their_text_only_when_text_is_asked_for(detokenize):
    processor = processor_with(StandInDetokenizer())
    processor.requests["r"].params = SamplingParams(detokenize=detokenize)
    prompt_logprobs = [None, {5: Logprob(-1.0, 1)}]
    first = replace(delta(CompletionOutput(0, "", [4])), prompt_logprobs=prompt_logprobs)
    (output,) = processor.process_outputs([first]).outputs
    if detokenize:
        assert output.prompt_logprobs == [None, {5: Logprob(-1.0, 1, "<5>")}]
    else:
        assert output.prompt_logprobs is prompt_logprobs


def test_outputs_of_unknown_requests_are_left_out_and_a_core_finish_is_not_aborted():
    """A delta of a request aborted meanwhile is dropped. A request the core finished itself
    is forgotten here without telling the core to abort it."""
    processor = processor_with(StandInDetokenizer())
    unknown = replace(delta(CompletionOutput(0, "", [4])), request_id="gone")
    done = delta(CompletionOutput(0, "", [4], finish_reason="length"), finished=True)
    processed = processor.process_outputs([unknown, done])
    assert [output.request_id for output in processed.outputs] == ["r"]
    assert processed.requests_to_abort == [] and processed.sequences_to_abort == []
    assert processor.requests == {}


def test_a_replicas_traceback_holds_its_text_in_args_and_survives_pickling():
    """The cause that shows where the replica raised its error: its text is its only argument
    (what repr() and loggers show), and a copy through pickle (the front end may pass the error
    on to another process) keeps it."""
    original = RemoteTraceback("Traceback: in replica 0")
    assert repr(original) == "RemoteTraceback('Traceback: in replica 0')"
    copy = pickle.loads(pickle.dumps(original))
    assert copy.args == ("Traceback: in replica 0",) and copy.text == "Traceback: in replica 0"
    assert str(copy) == "\n\nTraceback: in replica 0"


# --- waiting for a core to start ------------------------------------------------------------------


@dataclass
class StartingCoreOutputs:
    """A core's output socket while it starts: `poll` finds a message after `empty_polls`
    empty ones; a receive with nothing there (it would block for ever) fails the test."""

    message: object = None
    empty_polls: int = 0
    poll_timeouts: list = field(default_factory=list)

    def poll(self, timeout=None) -> int:
        self.poll_timeouts.append(timeout)
        assert len(self.poll_timeouts) < 100, "polls on without reading what arrived"
        return int(self.message is not None and len(self.poll_timeouts) > self.empty_polls)

    def recv_pyobj(self, flags=0):
        assert self.message is not None, "a blocking receive with nothing to arrive"
        return self.message


def starting_core(outputs: StartingCoreOutputs, alive: bool = True) -> CoreProcess:
    return CoreProcess(index=0, process=StandInProcess(alive=alive, exitcode=1), outputs=outputs)


def test_waiting_for_a_core_polls_in_short_waits_and_returns_its_max_model_len():
    """Each wait is bounded (so a dead core or the deadline is noticed), and Ready is read as
    soon as it is there."""
    outputs = StartingCoreOutputs(Ready(max_model_len=2048), empty_polls=3)
    assert wait_until_ready(starting_core(outputs)) == 2048
    assert len(outputs.poll_timeouts) == 4
    assert all(timeout is not None and 0 < timeout <= 1000 for timeout in outputs.poll_timeouts)


def test_a_core_that_exits_before_ready_is_reported_dead():
    with pytest.raises(EngineDeadError, match=r"engine core process 0 \(pid 4242\) died"):
        wait_until_ready(starting_core(StartingCoreOutputs(), alive=False))


def test_a_core_that_fails_to_build_its_engine_raises_its_error_with_its_traceback():
    error = ValueError("no config.json")
    outputs = StartingCoreOutputs(Failed(error, "Traceback: in the core"))
    with pytest.raises(ValueError, match="no config.json") as raised:
        wait_until_ready(starting_core(outputs))
    assert raised.value is error
    assert type(error.__cause__) is RemoteTraceback
    assert error.__cause__.text == "Traceback: in the core"


def test_a_core_that_takes_too_long_to_start_times_out_naming_the_limit(monkeypatch):
    monkeypatch.setattr(core_client, "STARTUP_TIMEOUT_S", 0)
    with pytest.raises(TimeoutError, match=r"^the engine core did not start in 0 s$"):
        wait_until_ready(starting_core(StartingCoreOutputs()))


# --- the processor: what a request may be, and what is said when it may not -------------------

# A tokenizer whose tokens are characters: "Hi" is [72, 105].
CHARACTERS = SimpleNamespace(encode=lambda text: [ord(c) for c in text])


def processor(max_model_len: int = 8) -> Processor:
    return Processor(CHARACTERS, vocab_size=200, max_model_len=max_model_len)


def refused(error: type[Exception], message: str):
    """pytest.raises for exactly this message: the user reads all of it."""
    return pytest.raises(error, match=f"^{re.escape(message)}$")


def test_a_processed_prompt_is_given_back_in_add_requests_form():
    prompt = ProcessedPrompt("Hi", [72, 105], "salt")
    assert prompt.as_prompt() == {
        "prompt": "Hi",
        "prompt_token_ids": [72, 105],
        "cache_salt": "salt",
    }


def test_each_prompt_form_gives_its_text_and_token_ids():
    """A string and {"prompt": ...} are encoded; token ids are taken as given (a tuple as a
    list), with the text given beside them, if any; a cache salt travels along."""
    check = processor().process_prompt
    assert check("Hi") == ProcessedPrompt("Hi", [72, 105])
    assert check({"prompt": "Hi", "cache_salt": "s"}) == ProcessedPrompt("Hi", [72, 105], "s")
    assert check({"prompt_token_ids": (1, 2)}) == ProcessedPrompt(None, [1, 2])
    assert check({"prompt_token_ids": [1], "prompt": "x"}) == ProcessedPrompt("x", [1])
    assert type(check({"prompt_token_ids": (1, 2)}).token_ids) is list


def test_a_prompt_of_no_known_form_is_refused_naming_the_forms():
    check = processor().process_prompt
    forms = "a string, {'prompt': str} or {'prompt_token_ids': list[int]}"
    with refused(TypeError, f"a prompt must be {forms}; got int"):
        check(7)
    with refused(TypeError, f"a prompt must be {forms}; got dict"):
        check({"text": "Hi"})
    with refused(TypeError, "prompt['prompt'] must be a string, got list"):
        check({"prompt": ["Hi"]})


def test_empty_prompts_and_bad_token_ids_are_refused():
    check = processor().process_prompt
    with refused(ValueError, "the prompt is empty; give at least one character or token"):
        check("")
    with refused(ValueError, "the prompt is empty; give at least one character or token"):
        check({"prompt": ""})
    with refused(ValueError, "prompt_token_ids is empty; give at least one token"):
        check({"prompt_token_ids": []})
    for not_a_list_of_ints in ["12", [1, True], [1.0], {1: 2}]:
        with refused(TypeError, "prompt_token_ids must be a list of ints"):
            check({"prompt_token_ids": not_a_list_of_ints})
    with refused(
        ValueError,
        "prompt_token_ids contains ids outside the vocabulary [0, 200): [-1, 200, 201, 202, 203]",
    ):
        check({"prompt_token_ids": [0, -1, 199, 200, 201, 202, 203, 204]})


def test_a_cache_salt_is_a_non_empty_string():
    check = processor().process_prompt
    for salt in ["", 3]:
        with refused(ValueError, f"cache_salt must be a non-empty string, got {salt!r}"):
            check({"prompt": "Hi", "cache_salt": salt})


def test_a_prompt_leaves_room_for_one_generated_token():
    """A context of 8 takes a prompt of 7 tokens, not 8."""
    check = processor(max_model_len=8).process_prompt
    assert len(check("abcdefg").token_ids) == 7
    with refused(
        ValueError,
        "the prompt is 8 tokens long, but the model's context is 8 tokens (including at least "
        "one generated token)",
    ):
        check("abcdefgh")


def test_a_request_is_checked_whole_with_default_params_for_none():
    process = processor(max_model_len=32).process_request  # room for the default 16 tokens
    prompt, params = process("Hi", None)
    assert prompt == ProcessedPrompt("Hi", [72, 105]) and params == SamplingParams()
    given = SamplingParams(max_tokens=6)
    assert process("Hi", given) == (ProcessedPrompt("Hi", [72, 105]), given)
    with refused(TypeError, "params must be SamplingParams, got dict"):
        process("Hi", {"max_tokens": 6})


def test_prompt_and_max_tokens_must_fit_the_context():
    """2 prompt tokens and a context of 8: max_tokens 6 fits, 7 does not; without max_tokens
    the context is the limit."""
    process = processor(max_model_len=8).process_request
    process("Hi", SamplingParams(max_tokens=6))
    process("Hi", SamplingParams(max_tokens=None))
    with refused(
        ValueError,
        "max_tokens=7 does not fit: the prompt has 2 tokens and the context 8, so max_tokens "
        "can be at most 6",
    ):
        process("Hi", SamplingParams(max_tokens=7))


@pytest.mark.parametrize("field_name", ["logit_bias", "stop_token_ids"])
def test_token_ids_in_the_params_must_be_in_the_vocabulary(field_name):
    """The vocabulary is 200 tokens: 199 is the last one; the message shows the first five
    outside."""
    process = processor().process_request

    def params(token_ids):
        if field_name == "logit_bias":
            return SamplingParams(max_tokens=1, logit_bias={t: 1.0 for t in token_ids})
        return SamplingParams(max_tokens=1, stop_token_ids=token_ids)

    process("Hi", params([0, 199]))
    with refused(
        ValueError,
        f"{field_name} must name token ids below the vocabulary size 200, got "
        "[200, 201, 202, 203, 204]",
    ):
        process("Hi", params([5, 200, 201, 202, 203, 204, 205]))


def test_a_grammar_that_does_not_parse_is_refused_before_anything_is_queued():
    process = processor().process_request
    grammar = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(regex="a"))
    assert process("Hi", grammar)[1] is grammar
    broken = StructuredOutputsParams(grammar="root ::= (")
    with pytest.raises(ValueError, match="grammar"):
        process("Hi", SamplingParams(max_tokens=1, structured_outputs=broken))


def test_params_are_one_for_all_prompts_or_one_per_prompt():
    one = SamplingParams(max_tokens=3)
    assert broadcast_params(None, 2) == [SamplingParams(), SamplingParams()]
    assert broadcast_params(one, 3) == [one, one, one]
    each = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=2)]
    assert broadcast_params(each, 2) == each and broadcast_params(tuple(each), 2) == each
    assert type(broadcast_params(tuple(each), 2)) is list
    with refused(ValueError, "got 2 SamplingParams for 3 prompts; pass one, or one per prompt"):
        broadcast_params(each, 3)
    with refused(TypeError, "sampling_params must be SamplingParams, got dict"):
        broadcast_params([one, {}], 2)
    with refused(TypeError, "sampling_params must be SamplingParams or a list of them, got str"):
        broadcast_params("greedy", 1)


# --- the async front end's streams, with a stand-in core ---------------------------------------

NO_TEXT = SamplingParams(max_tokens=4, detokenize=False)  # the stand-in tokenizer has no text


class StandInClient(EngineCoreClient):
    """A core that runs nothing: it records what the front end asks of it."""

    def __init__(self) -> None:
        self.tokenizer = CHARACTERS
        self.processor = Processor(CHARACTERS, vocab_size=200, max_model_len=64)
        self.max_model_len, self.model_path = 64, None
        self.added: list[AddRequest] = []
        self.aborted: list[list[str]] = []

    def start(self, on_outputs, on_failure) -> None:
        pass

    def add_request(self, request: AddRequest) -> None:
        self.added.append(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted.append(request_ids)

    def abort_sequences(self, sequences) -> None:
        raise AssertionError("not expected here")

    def call_engine(self, function, *args):
        raise AssertionError("not expected here")

    def get_replica_metrics(self):
        raise AssertionError("not expected here")

    def shutdown(self) -> None:
        pass


def core_delta(core_id: str, token_id: int) -> RequestOutput:
    """A core's delta: one new token of a request still running."""
    return RequestOutput(core_id, None, [], [CompletionOutput(0, "", [token_id])], False)


async def add_to(llm: AsyncLLM, request_id: str = "r") -> RequestStream:
    """A request without text, added from within an event loop (asyncio.run(add_to(...)))."""
    return llm.add_request(request_id, "Hi", NO_TEXT)


def test_a_stream_ends_after_raising_its_requests_error():
    """The core refused a request: its stream raises the error once, then ends like any
    finished stream (an iterator that keeps raising would loop its reader forever)."""
    llm = AsyncLLM(StandInClient())

    async def read():
        stream = llm.add_request("r", "Hi", NO_TEXT)
        llm._deliver(EngineCoreOutputs([], errors={stream.core_id: ValueError("refused")}))
        with pytest.raises(ValueError, match="refused"):
            await anext(stream)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return llm.num_open_requests

    assert asyncio.run(read()) == 0


def test_a_request_waits_until_its_first_output():
    """num_waiting (what max_waiting_requests bounds) counts streams without an output yet."""
    llm = AsyncLLM(StandInClient())

    async def waiting_before_and_after():
        first = llm.add_request("a", "Hi", NO_TEXT)
        llm.add_request("b", "Hi", NO_TEXT)
        before = llm.num_waiting
        llm._deliver(EngineCoreOutputs([core_delta(first.core_id, 7)]))
        return before, llm.num_waiting, (await anext(first)).outputs[0].token_ids

    assert asyncio.run(waiting_before_and_after()) == (2, 1, [7])


def test_listeners_and_streams_see_the_callers_request_id():
    """The core knows a request by its own id; everything the caller sees (a listener's step
    outputs, the stream's outputs) carries the caller's."""
    llm = AsyncLLM(StandInClient())
    steps = []
    llm.add_listener(SimpleNamespace(on_step=lambda outputs, now: steps.append(outputs)))

    async def deliver():
        stream = llm.add_request("mine", "Hi", NO_TEXT)
        assert stream.core_id != "mine"
        llm._deliver(EngineCoreOutputs([core_delta(stream.core_id, 7)]))
        return (await anext(stream)).request_id

    assert asyncio.run(deliver()) == "mine"
    assert [[output.request_id for output in outputs] for outputs in steps] == [["mine"]]


def test_a_request_goes_to_the_core_with_its_priority_zero_by_default():
    client = StandInClient()
    llm = AsyncLLM(client)

    async def add():
        llm.add_request("plain", "Hi", NO_TEXT)
        llm.add_request("urgent", "Hi", NO_TEXT, priority=-5)

    asyncio.run(add())
    assert [request.priority for request in client.added] == [0, -5]


def test_a_request_is_refused_with_a_clear_error_when_its_id_is_taken_or_the_engine_stopped():
    """The caller's id is in use while its stream is open. A failed core: every later request
    is refused as "not running", the core's error as the cause; so after a shutdown."""
    llm = AsyncLLM(StandInClient())

    async def add_twice():
        await add_to(llm, "a")
        await add_to(llm, "a")

    with refused(ValueError, "request id 'a' is already in use"):
        asyncio.run(add_twice())
    crash = RuntimeError("the core crashed")
    llm._on_failure(crash)
    with refused(EngineDeadError, "the engine is not running") as raised:
        asyncio.run(add_to(llm, "b"))
    assert raised.value.__cause__ is crash
    stopped = AsyncLLM(StandInClient())
    stopped.shutdown()
    with refused(EngineDeadError, "the engine is not running"):
        asyncio.run(add_to(stopped))


def test_streams_open_in_a_live_event_loop_keep_another_loop_out():
    """One loop at a time: while a loop that is still open has streams, a request from
    another loop is refused (its streams could not be woken there)."""
    llm = AsyncLLM(StandInClient())
    first_loop = asyncio.new_event_loop()
    try:
        first_loop.run_until_complete(add_to(llm))
        with refused(RuntimeError, "an AsyncLLM serves one event loop at a time"):
            asyncio.run(add_to(llm, "other"))
        assert llm.num_open_requests == 1
    finally:
        first_loop.close()


def test_a_new_event_loop_aborts_the_streams_a_closed_one_left_open():
    """asyncio.run twice: the first loop closed with request "a" open, which nobody can read
    any more; the second loop's first request aborts it in the core and in the output
    processor, and only "b" is left open."""
    client = StandInClient()
    llm = AsyncLLM(client)
    left_open = asyncio.run(add_to(llm, "a")).core_id
    kept = asyncio.run(add_to(llm, "b")).core_id
    assert client.aborted == [[left_open]]
    assert list(llm.output_processor.requests) == [kept]
    assert llm.num_open_requests == 1 and [r.request_id for r in client.added] == [left_open, kept]
