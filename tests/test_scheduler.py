"""Chapter 04's scheduler on its own: no model, a runner that samples token 7.

The engine tests (test_ch04_engine.py) check that scheduling never changes the tokens. These
check the scheduler's own promises one by one, in steps small enough to follow by hand: the
token budget and the seat limit to the last token, who is preempted and what is undone when a
victim was already scheduled, the lookahead slots of chapter 08, the drafts a grant covers, a
request whose grammar failed to compile (chapter 10), and the bookkeeping: every request that
the runner saw is reported finished exactly once, and nothing is left behind.

A step here is `schedule()` then `update_from_output()` with the token 7 for every request
whose grant reaches the end of its tokens, as the model runner would return.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request, RequestStatus
from minivllm.core.scheduler import Scheduler, SchedulerConfig, SpecDecodeStats
from minivllm.core.scheduler_output import SchedulerOutput
from minivllm.outputs import Logprob, ModelRunnerOutput, PromptLogprobsChunk
from minivllm.sample.sampler import TokenLogprobs
from minivllm.sample.sampling_params import SamplingParams

SAMPLED = 7  # the fake runner's token
MAX_MODEL_LEN = 64


def make_scheduler(num_blocks: int = 16, block_size: int = 4, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size))


def make_request(
    request_id: str,
    prompt_len: int = 4,
    max_tokens: int = 8,
    priority: int = 0,
    max_model_len: int = MAX_MODEL_LEN,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, detokenize=False)
    prompt = list(range(10, 10 + prompt_len))
    request = Request.create(request_id, None, prompt, params, None, (0,), max_model_len)
    request.priority = priority
    return request


def sampled_for(scheduler: Scheduler, output: SchedulerOutput) -> dict[str, list[int]]:
    """What a runner samples: one token for each grant that reaches the end of its tokens."""
    by_id = {r.request_id: r for r in scheduler.running}
    return {
        rid: [SAMPLED]
        for rid, num_new in output.num_scheduled_tokens.items()
        if by_id[rid].num_computed_tokens + num_new >= by_id[rid].num_tokens
    }


def run_step(scheduler: Scheduler, spec_token_ids: dict | None = None) -> SchedulerOutput:
    output = scheduler.schedule()
    runner_output = ModelRunnerOutput(
        sampled_for(scheduler, output), spec_token_ids=spec_token_ids or {}
    )
    scheduler.update_from_output(output, runner_output)
    return output


def add_all(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)


# --- the budget and the seats ---------------------------------------------------------------


def three_decoding(budget: int) -> tuple[Scheduler, SchedulerOutput]:
    """Three requests past their prefill (one step, a large budget), then a decode step under
    `budget` tokens."""
    scheduler = make_scheduler()
    add_all(scheduler, *(make_request(rid) for rid in "abc"))
    run_step(scheduler)
    scheduler.config.max_num_batched_tokens = budget
    return scheduler, scheduler.schedule()


def test_a_budget_of_three_tokens_runs_three_decodes():
    """Each decode costs one token: a budget of 3 grants all three, in their running order."""
    _, output = three_decoding(budget=3)
    assert output.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}


def test_a_spent_budget_grants_nothing_more():
    """A budget of 2: the third decode waits for the next step (no empty grant for it)."""
    scheduler, output = three_decoding(budget=2)
    assert output.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [r.request_id for r in scheduler.running] == ["a", "b", "c"]  # c keeps its seat


def test_the_seat_limit_leaves_the_rest_waiting():
    """max_num_seqs=1: one request runs; the other waits, in the queue, untouched."""
    scheduler = make_scheduler(max_num_seqs=1)
    first, second = make_request("a"), make_request("b")
    add_all(scheduler, first, second)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 4}
    assert list(scheduler.waiting) == [second] and second.status == RequestStatus.WAITING


def test_without_chunked_prefill_a_prompt_of_exactly_the_budget_runs_whole():
    scheduler = make_scheduler(max_num_batched_tokens=4, enable_chunked_prefill=False)
    add_all(scheduler, make_request("a", prompt_len=4), make_request("b", prompt_len=1))
    output = scheduler.schedule()
    # b would fit in a chunk of nothing: without chunking it waits for a step with room.
    assert output.num_scheduled_tokens == {"a": 4}


def test_an_admitted_request_is_running_from_its_first_step():
    """Admission marks the request running and stamps its first scheduling time once: a
    preemption and a second admission keep the first time."""
    scheduler = make_scheduler(num_blocks=3)
    a, b = make_request("a"), make_request("b", max_tokens=8)
    add_all(scheduler, a, b)
    run_step(scheduler)
    assert a.status == b.status == RequestStatus.RUNNING
    first_time = b.metrics.first_scheduled_time
    assert first_time is not None
    run_step(scheduler)  # both need a second block, one is free: b, the newest, gives way
    assert b.status == RequestStatus.WAITING and b.num_preemptions == 1
    while b.status != RequestStatus.RUNNING:
        output = run_step(scheduler)
    assert b.metrics.first_scheduled_time == first_time
    # The runner saw b before: it comes back as a cached request with a whole new table.
    (resumed,) = [c for c in output.scheduled_cached_reqs if c.req_id == "b"]
    assert resumed.resumed_from_preemption and resumed.num_kept_block_ids == 0
    assert resumed.new_block_ids == scheduler.kv_cache_manager.block_tables["b"]


# --- preemption -----------------------------------------------------------------------------


def test_a_victim_already_scheduled_this_step_gives_its_tokens_back():
    """Priority policy: z (priority 1) is first in the running list, so its decode is granted
    before b finds the pool empty. z is the victim: its grant is undone (the budget gets its
    token back) and the step goes on with b, then c, each taking a block z freed.

    Pool of 4 blocks of 4 tokens; z, b, c hold one block each and z a second one; budget 2."""
    scheduler = make_scheduler(num_blocks=4, policy="priority")
    z = make_request("z", priority=1)
    scheduler.add_request(z)
    run_step(scheduler)  # z: prefill, 5 tokens
    add_all(scheduler, make_request("b"), make_request("c"))
    run_step(scheduler)  # z: its second block; b, c: prefill, one block each
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    scheduler.config.max_num_batched_tokens = 2

    output = scheduler.schedule()

    assert output.preempted_req_ids == ["z"]
    assert output.num_scheduled_tokens == {"b": 1, "c": 1}
    assert [r.request_id for r in scheduler.running] == ["b", "c"]
    assert list(scheduler.waiting) == [z] and z.num_computed_tokens == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_among_equals_the_newest_gives_way(policy):
    """Three requests of one priority in a pool of three blocks, all growing into a second
    block: under either policy the newest (c) goes first, then b; a runs on alone."""
    scheduler = make_scheduler(num_blocks=3, policy=policy)
    add_all(scheduler, *(make_request(rid, priority=1) for rid in "abc"))
    run_step(scheduler)
    output = scheduler.schedule()
    assert output.preempted_req_ids == ["c", "b"]
    assert output.num_scheduled_tokens == {"a": 1}


def test_each_preemption_of_a_request_is_counted():
    """z has the lowest priority (the largest value), so it gives way every time the pool runs
    short: once to a, and again to b after it came back. Its count is the number of steps that
    named it preempted."""
    scheduler = make_scheduler(num_blocks=3, policy="priority")
    z = make_request("z", priority=9, max_tokens=8)
    add_all(scheduler, make_request("a", max_tokens=4), z)
    named, step = 0, 0
    while scheduler.has_unfinished_requests():
        step += 1
        assert step < 100, "the requests do not finish"
        if step == 6:
            scheduler.add_request(make_request("b", max_tokens=4))
        output = run_step(scheduler)
        named += output.preempted_req_ids.count("z")
    assert named >= 2, "the scenario must preempt z twice"
    assert z.num_preemptions == named
    assert scheduler.num_preemptions == named
    assert len(z.output_token_ids) == 8  # recomputed from scratch, never lost a token


# --- chapter 08: lookahead slots and drafts ---------------------------------------------------


def held_blocks(scheduler: Scheduler, request_id: str) -> int:
    return len(scheduler.kv_cache_manager.block_tables[request_id])


@pytest.mark.parametrize("max_model_len, blocks_at_the_end", [(64, 3), (8, 2)])
def test_lookahead_slots_follow_only_a_grant_that_reaches_the_end(max_model_len, blocks_at_the_end):
    """num_lookahead_tokens=3, a 6-token prompt in chunks of 4: the first chunk (4 < 6 tokens)
    holds 4 slots, one block; the second reaches the end and holds 6 + 3 = 9 slots, three
    blocks, where the draft model writes its guesses; within a context of 8, two blocks."""
    scheduler = make_scheduler(max_num_batched_tokens=4, num_lookahead_tokens=3)
    scheduler.add_request(make_request("a", prompt_len=6, max_model_len=max_model_len))
    scheduler.schedule()
    assert held_blocks(scheduler, "a") == 1
    scheduler.running[0].num_computed_tokens = 4  # the runner computed the first chunk
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 2}
    assert held_blocks(scheduler, "a") == blocks_at_the_end


def test_without_lookahead_a_grant_holds_its_own_slots():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=6))
    scheduler.schedule()
    assert held_blocks(scheduler, "a") == 2


@pytest.mark.parametrize("budget, verified", [(1, []), (2, [11]), (3, [11, 12]), (8, [11, 12, 13])])
def test_a_decode_verifies_the_drafts_its_grant_covers(budget, verified):
    """Three drafts proposed after the prefill; the decode's grant is its one real token plus
    as many drafts as the budget leaves room for, and only those are sent to be verified."""
    scheduler = make_scheduler()
    request = make_request("a", max_tokens=16)
    scheduler.add_request(request)
    run_step(scheduler, spec_token_ids={"a": [11, 12, 13]})
    assert request.spec_token_ids == [11, 12, 13]
    scheduler.config.max_num_batched_tokens = budget

    output = scheduler.schedule()

    assert output.num_scheduled_tokens == {"a": 1 + len(verified)}
    assert output.scheduled_spec_decode_tokens.get("a", []) == verified
    assert request.spec_token_ids == verified


def test_a_verification_step_keeps_the_accepted_drafts_and_gives_back_the_rest():
    """A 3-token prompt, then three drafts: the decode computes 1 + 3 tokens (7 in all, two
    blocks of 4). The runner accepts none and samples 99: the request is one token longer,
    its computed count is rolled back to 4 (the rejected drafts' K/V are junk), the block
    only they used goes back to the pool, and the runner is told to keep one block."""
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=3, max_tokens=16)
    scheduler.add_request(request)
    run_step(scheduler, spec_token_ids={"a": [11, 12, 13]})
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 4} and held_blocks(scheduler, "a") == 2

    scheduler.update_from_output(output, ModelRunnerOutput({"a": [99]}))

    assert request.output_token_ids == [SAMPLED, 99]
    assert request.num_computed_tokens == 4 and held_blocks(scheduler, "a") == 1
    assert scheduler.kv_cache_manager.num_free_blocks == 15
    stats = scheduler.spec_decode_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 0)
    assert scheduler.num_generated_tokens == 2
    (cached,) = scheduler.schedule().scheduled_cached_reqs
    assert (cached.new_token_ids, cached.num_kept_block_ids) == ([99], 1)


def test_accepted_drafts_are_emitted_with_the_token_after_them():
    """Two of three drafts accepted: the step emits them and the target's token after them,
    and the third draft's K/V (computed, then rejected) no longer count."""
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=3, max_tokens=16)
    scheduler.add_request(request)
    run_step(scheduler, spec_token_ids={"a": [11, 12, 13]})
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput({"a": [11, 12, 99]}))
    assert request.output_token_ids == [SAMPLED, 11, 12, 99]
    assert request.num_computed_tokens == 6  # prompt, 7, 11, 12: 99 is computed next step
    stats = scheduler.spec_decode_stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 2)
    assert stats.accepted_per_position == [1, 1, 0]
    assert scheduler.num_generated_tokens == 4


@pytest.mark.parametrize(
    "max_tokens, max_model_len, kept",
    [(5, 64, 3), (2, 64, 0), (16, 8, 2)],
    ids=["max_tokens", "one-token-left", "context"],
)
def test_drafts_never_outrun_max_tokens_or_the_context(max_tokens, max_model_len, kept):
    """After a 4-token prompt and one output token, a step emits the accepted drafts plus one
    token: with max_tokens 5 there is room for 4 tokens, so 3 drafts; with max_tokens 2 for
    one token, no draft; in a context of 8, 3 positions are left, so 2 drafts."""
    scheduler = make_scheduler()
    request = make_request("a", max_tokens=max_tokens, max_model_len=max_model_len)
    scheduler.add_request(request)
    run_step(scheduler, spec_token_ids={"a": [11, 12, 13, 14, 15, 16]})
    assert request.spec_token_ids == [11, 12, 13, 14, 15, 16][:kept]


def test_the_spec_decode_counters_add_up_per_step_and_per_position():
    """Chapter 08's counters, which the scheduler keeps: verification steps, draft tokens,
    accepted tokens, and at each draft position how many drafts were kept there (the list
    grows with the longest draft seen)."""
    stats = SpecDecodeStats()
    stats.record(3, 2)
    stats.record(5, 5)
    stats.record(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 10, 7)
    assert stats.accepted_per_position == [2, 2, 1, 1, 1]


class StandInGrammar:
    """A grammar that allows every token and keeps the first two drafts, recording how the
    scheduler asked; its "mask" names the drafts it was made for."""

    compile_error, is_terminated = None, False

    def __init__(self, is_ready: bool = True):
        self.is_ready = is_ready
        self.asked: list[tuple[list[int], bool]] = []

    def accept(self, token_id: int) -> bool:
        return True

    def token_bitmasks(self, draft_token_ids: list[int]) -> tuple:
        return ("mask after", tuple(draft_token_ids))

    def valid_drafts(self, draft_token_ids: list[int], keep_forbidden: bool = False):
        self.asked.append((list(draft_token_ids), keep_forbidden))
        return draft_token_ids[:2]


@pytest.mark.parametrize(
    "drafts_are_sampled, temperature, keep_forbidden",
    [(True, 0.8, True), (True, 0.0, False), (False, 0.8, False), (False, 0.0, False)],
)
def test_a_grammar_cuts_the_drafts_and_keeps_a_forbidden_one_only_when_sampled(
    drafts_are_sampled, temperature, keep_forbidden
):
    """Drafts pass through the request's grammar; the first forbidden one is kept (to be
    rejected by the verifier) only when it was drawn from a draft model's distribution for a
    sampled request (chapter 08's residual rule needs it)."""
    scheduler = make_scheduler(drafts_are_sampled=drafts_are_sampled)
    params = SamplingParams(temperature=temperature, max_tokens=16, detokenize=False)
    request = Request.create("a", None, [1, 2, 3, 4], params, None, (0,), MAX_MODEL_LEN)
    request.grammar = grammar = StandInGrammar()
    scheduler.add_request(request)
    run_step(scheduler, spec_token_ids={"a": [11, 12, 13]})
    assert grammar.asked == [([11, 12, 13], keep_forbidden)]
    assert request.spec_token_ids == [11, 12]


def test_a_grammar_mask_goes_with_every_step_that_samples_and_only_those():
    """A 6-token prompt in chunks of 4: the first chunk samples nothing and gets no mask; the
    step that reaches the end gets the mask for its sampled row; a decode with drafts gets
    the masks made for those drafts."""
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("a", prompt_len=6, max_tokens=16)
    request.grammar = StandInGrammar()
    scheduler.add_request(request)
    assert run_step(scheduler).grammar_bitmasks == {}
    assert run_step(scheduler, spec_token_ids={"a": [11, 12]}).grammar_bitmasks == {
        "a": ("mask after", ())
    }
    assert scheduler.schedule().grammar_bitmasks == {"a": ("mask after", (11, 12))}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_whose_grammar_is_compiling_waits_without_holding_up_the_others(policy):
    scheduler = make_scheduler(policy=policy)
    compiling, free = make_request("compiling"), make_request("free")
    compiling.grammar = StandInGrammar(is_ready=False)
    add_all(scheduler, compiling, free)
    assert scheduler.schedule().num_scheduled_tokens == {"free": 4}
    assert list(scheduler.waiting) == [compiling]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_for_the_next_step():
    scheduler = make_scheduler(max_num_batched_tokens=4, enable_chunked_prefill=False)
    second = make_request("b", prompt_len=3)
    add_all(scheduler, make_request("a", prompt_len=3), second)
    assert scheduler.schedule().num_scheduled_tokens == {"a": 3}
    assert list(scheduler.waiting) == [second]


def test_a_new_request_is_sent_to_the_runner_whole_once_then_as_changes():
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=5)
    scheduler.add_request(request)
    (new,) = run_step(scheduler).scheduled_new_reqs
    assert (new.req_id, new.prompt_token_ids, new.sampling_params) == (
        "a",
        request.prompt_token_ids,
        request.params,
    )
    assert (new.eos_token_ids, new.num_computed_tokens) == ((0,), 0)
    assert new.block_ids == scheduler.kv_cache_manager.block_tables["a"] and len(new.block_ids) == 2
    output = scheduler.schedule()
    (cached,) = output.scheduled_cached_reqs
    assert not output.scheduled_new_reqs
    assert (cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens) == (
        [SAMPLED],
        [],
        5,
    )


# --- what the runner reports ------------------------------------------------------------------


def test_an_error_ends_its_request_alone():
    """The runner could sample nothing for a: a ends with the runner's message and gives its
    blocks back; b, behind it in the batch, gets its token."""
    scheduler = make_scheduler()
    a, b = make_request("a"), make_request("b")
    add_all(scheduler, a, b)
    output = scheduler.schedule()
    runner_output = ModelRunnerOutput({"b": [SAMPLED]}, errors={"a": "no token can be sampled"})

    updated = scheduler.update_from_output(output, runner_output)

    assert updated == [a, b]
    assert (a.finish_reason, a.error, a.status) == (
        "error",
        "no token can be sampled",
        RequestStatus.FINISHED,
    )
    assert "a" not in scheduler.kv_cache_manager.block_tables and scheduler.running == [b]
    assert b.output_token_ids == [SAMPLED]


def test_logprobs_and_prompt_logprobs_reach_the_request():
    scheduler = make_scheduler()
    params = SamplingParams(max_tokens=4, logprobs=1, prompt_logprobs=1, detokenize=False)
    request = Request.create("a", None, [1, 2], params, None, (0,), MAX_MODEL_LEN)
    scheduler.add_request(request)
    output = scheduler.schedule()
    token = TokenLogprobs(SAMPLED, -0.5, 1, [(SAMPLED, -0.5)])
    prompt_token = TokenLogprobs(2, -1.5, 3, [(5, -0.25)])
    runner_output = ModelRunnerOutput(
        {"a": [SAMPLED]},
        logprobs={"a": [token]},
        prompt_logprobs={"a": PromptLogprobsChunk(1, [prompt_token])},
    )

    scheduler.update_from_output(output, runner_output)

    assert request.logprobs == [{SAMPLED: Logprob(-0.5, 1, None)}]
    assert request.prompt_logprobs == [
        None,
        {5: Logprob(-0.25, 1, None), 2: Logprob(-1.5, 3, None)},
    ]


# --- chapter 10: a grammar that failed to compile ---------------------------------------------


def test_a_request_whose_grammar_failed_ends_alone_and_the_next_one_runs():
    """The failed request leaves the queue with its error, holds no block, is reported by the
    next update, and is never announced to the runner as finished (it never ran); the request
    behind it is admitted in the same step."""
    scheduler = make_scheduler()
    failed, healthy = make_request("bad"), make_request("ok")
    failed.grammar = SimpleNamespace(is_ready=True, compile_error="grammar: no rule 'root'")
    add_all(scheduler, failed, healthy)

    output = scheduler.schedule()

    assert output.num_scheduled_tokens == {"ok": 4}
    assert failed.status == RequestStatus.FINISHED
    assert (failed.finish_reason, failed.error) == ("error", "grammar: no rule 'root'")
    assert failed not in scheduler.waiting and "bad" not in scheduler.kv_cache_manager.block_tables
    updated = scheduler.update_from_output(output, ModelRunnerOutput({"ok": [SAMPLED]}))
    assert updated == [failed, healthy]
    assert "bad" not in scheduler.schedule().finished_req_ids


def broken_step(rule: str) -> tuple[Scheduler, SchedulerOutput, int]:
    """A scheduler with a and b running (4-token prompts, one block each, budget 8, two
    seats), and a step that breaks `rule`: (scheduler, output, number admitted)."""
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    add_all(scheduler, make_request("a"), make_request("b"))
    scheduler.schedule()  # a and b are running, nothing computed yet
    grants = {
        "budget": {"a": 4, "b": 5},
        "empty grant": {"a": 4, "b": 0},
        "past its tokens": {"a": 5},
        "past its blocks": {"a": 4},
    }
    output = SchedulerOutput(num_scheduled_tokens=grants.get(rule, {"a": 4}))
    admitted = 0
    if rule == "seats":
        scheduler.running.append(make_request("c"))
    if rule == "admitted after a preemption":
        output.preempted_req_ids, admitted = ["b"], 1
    if rule == "past its blocks":
        scheduler.kv_cache_manager.free_tail("a", 0)  # a's only block taken away
    return scheduler, output, admitted


@pytest.mark.parametrize(
    "rule, message",
    [
        ("budget", "granted 9 tokens, the budget is 8"),
        ("seats", "3 requests running, max_num_seqs is 2"),
        ("empty grant", "an empty grant"),
        ("admitted after a preemption", "admitted 1 waiting request"),
        ("past its tokens", "a granted past its tokens"),
        ("past its blocks", "a runs to token 4 with only 0 blocks"),
    ],
)
def test_each_broken_rule_of_a_step_is_caught(rule, message):
    """The scheduler checks its own output every step; each rule, broken on purpose, raises
    with a message that names it (and a correct step passes)."""
    scheduler, output, admitted = broken_step(rule)
    with pytest.raises(AssertionError, match=message):
        scheduler.check_invariants(output, num_admitted=admitted)
    healthy, output, _ = broken_step("none")
    healthy.check_invariants(output, num_admitted=0)


# --- the bookkeeping --------------------------------------------------------------------------


def test_the_priority_policy_runs_the_lowest_value_first():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    add_all(
        scheduler,
        *(make_request(rid, max_tokens=1, priority=p) for rid, p in zip("xyz", [2, 0, 1])),
    )
    order = [next(iter(run_step(scheduler).num_scheduled_tokens)) for _ in range(3)]
    assert order == ["y", "z", "x"]


def test_priority_ties_run_in_arrival_order():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    add_all(scheduler, *(make_request(rid, max_tokens=1, priority=3) for rid in "xyz"))
    order = [next(iter(run_step(scheduler).num_scheduled_tokens)) for _ in range(3)]
    assert order == ["x", "y", "z"]


def test_a_finished_request_is_reported_to_the_runner_once():
    scheduler = make_scheduler()
    request = make_request("a", max_tokens=1)
    scheduler.add_request(request)
    run_step(scheduler)
    assert request.status == RequestStatus.FINISHED and request.finish_reason == "length"
    assert scheduler.has_finished_requests() and not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_req_ids == {"a"}
    assert not scheduler.has_finished_requests()
    assert scheduler.schedule().finished_req_ids == set()


def test_aborting_a_request_that_already_ended_changes_nothing():
    scheduler = make_scheduler()
    request = make_request("a", max_tokens=1)
    scheduler.add_request(request)
    run_step(scheduler)
    scheduler.abort_request(request)
    assert request.finish_reason == "length"
    assert scheduler.schedule().finished_req_ids == {"a"}
    assert scheduler.kv_cache_manager.num_free_blocks == 16


@st.composite
def request_streams(draw):
    """Requests arriving over the first steps, some aborted at a later step, in a pool that
    holds the longest one (the engine refuses longer ones), under a random budget and seat
    limit. Chunked prefill stays on: a preempted request must be able to come back."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    requests = draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "prompt_len": st.integers(1, 12),
                    "max_tokens": st.integers(1, 6),
                    "priority": st.integers(0, 2),
                    "arrives": st.integers(0, 4),
                    "aborted_at": st.none() | st.integers(0, 12),
                }
            ),
            min_size=1,
            max_size=6,
        )
    )
    longest = max(r["prompt_len"] + r["max_tokens"] for r in requests)
    min_blocks = -(-longest // block_size)
    return dict(
        requests=requests,
        block_size=block_size,
        num_blocks=draw(st.integers(min_blocks, 2 * min_blocks + 2)),
        budget=draw(st.integers(1, 16)),
        max_num_seqs=draw(st.integers(1, 4)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
    )


@given(stream=request_streams())
def test_every_request_ends_and_leaves_nothing_behind(stream):
    """Whatever arrives, aborts and gets preempted: every request ends (its max_tokens of
    output, or aborted), each preemption is counted where it happened, every request the
    runner saw is reported finished exactly once, after it ended, and at the end the pool is
    whole and the scheduler keeps nothing of any request."""
    scheduler = make_scheduler(
        num_blocks=stream["num_blocks"],
        block_size=stream["block_size"],
        max_num_batched_tokens=stream["budget"],
        max_num_seqs=stream["max_num_seqs"],
        policy=stream["policy"],
    )
    requests = {
        f"r{i}": (make_request(f"r{i}", s["prompt_len"], s["max_tokens"], s["priority"]), s)
        for i, s in enumerate(stream["requests"])
    }
    preempted = dict.fromkeys(requests, 0)
    reported = dict.fromkeys(requests, 0)
    ran = set()
    step = 0
    while step <= 4 or scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
        assert step < 1000, "the requests do not finish"
        for request, spec in requests.values():
            if spec["arrives"] == step:
                scheduler.add_request(request)
            if spec["aborted_at"] == step and spec["arrives"] <= step and not request.is_finished:
                scheduler.abort_request(request)
        output = run_step(scheduler)
        for rid in output.finished_req_ids:
            assert requests[rid][0].is_finished
            reported[rid] += 1
        for rid in output.preempted_req_ids:
            preempted[rid] += 1
        ran |= set(output.num_scheduled_tokens)
        step += 1

    for rid, (request, spec) in requests.items():
        assert request.status == RequestStatus.FINISHED
        if request.finish_reason != "abort":
            assert request.finish_reason == "length"
            assert len(request.output_token_ids) == spec["max_tokens"]
        assert request.num_preemptions == preempted[rid]
        assert reported[rid] == (1 if rid in ran else 0), rid
    assert scheduler.num_preemptions == sum(preempted.values())
    assert scheduler.num_generated_tokens == sum(
        len(request.output_token_ids) for request, _ in requests.values()
    )
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks and manager.block_tables == {}
    assert scheduler._arrival_order == {} and scheduler._runner_views == {}
