"""Chapter 04's learning check: the token-budget rule of one scheduling step."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check


def _our_schedule_step():
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.request import Request, RequestStatus
    from minivllm.core.scheduler import Scheduler, SchedulerConfig
    from minivllm.sample.sampling_params import SamplingParams

    def make_request(request_id: str, num_tokens: int, num_computed: int) -> Request:
        return Request(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=[0] * num_tokens,
            params=SamplingParams(temperature=0.0),
            eos_token_ids=(),
            max_model_len=num_tokens + 1,
            detokenizer=None,  # never used: the scheduler only counts tokens
        )

    def schedule_step(running, waiting, budget, max_num_seqs):
        # A pool with room for everything: the rule alone decides, never a lack of blocks.
        total = sum(running) + sum(waiting) + 8 * (len(running) + len(waiting)) + 1
        manager = KVCacheManager(num_blocks=total, block_size=1)
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), manager
        )
        running_requests = []
        for i, remaining in enumerate(running):
            computed = 8  # tokens already in the cache; any number would do
            request = make_request(f"r{i}", computed + remaining, computed)
            scheduler.add_request(request)
            scheduler.waiting.remove(request)
            request.status, request.num_computed_tokens = RequestStatus.RUNNING, computed
            manager.allocate_slots(request.request_id, computed)
            scheduler.running.append(request)
            running_requests.append(request)
        waiting_requests = [make_request(f"w{i}", n, 0) for i, n in enumerate(waiting)]
        for request in waiting_requests:
            scheduler.add_request(request)
        granted = scheduler.schedule().num_scheduled_tokens
        return (
            [granted.get(r.request_id, 0) for r in running_requests],
            [granted.get(r.request_id, 0) for r in waiting_requests],
        )

    return schedule_step


@learning_check(
    "ch04.schedule_step",
    signature="schedule_step(running: list[int], waiting: list[int], budget: int, "
    "max_num_seqs: int) -> tuple[list[int], list[int]]; running: tokens each running request "
    "still has to compute, in running order; waiting: prompt length of each waiting request, "
    "in queue order; returns the tokens granted to each (0: not scheduled)",
    reference=_our_schedule_step,
)
def check_schedule_step(schedule_step) -> None:
    """The rule of `Scheduler.schedule` with plenty of KV blocks and chunked prefill on, as
    properties that pin down one answer:

    1. no request gets more than it needs, nor a negative grant;
    2. the grants fit the budget;
    3. at most max_num_seqs requests run: the running ones plus the admitted waiting ones;
    4. strict order, running first, then waiting in queue order: a request gets tokens only
       when every request before it got all it needs (so at most one request is chunked: the
       last one served, and no waiting request jumps the queue);
    5. greedy: the step uses as much of the budget as rules 1-4 allow.
    """

    @check_settings(max_examples=80)
    @given(
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 100),
        data=st.data(),
    )
    def property_(max_num_seqs, budget, data):
        running = data.draw(
            st.lists(st.integers(1, 40), max_size=max_num_seqs), label="running (remaining)"
        )
        waiting = data.draw(
            st.lists(st.integers(1, 60), max_size=6), label="waiting (prompt lengths)"
        )
        got_running, got_waiting = schedule_step(list(running), list(waiting), budget, max_num_seqs)
        got_running, got_waiting = list(got_running), list(got_waiting)
        assert len(got_running) == len(running) and len(got_waiting) == len(waiting), (
            f"one grant per request expected: got {len(got_running)} for {len(running)} running "
            f"and {len(got_waiting)} for {len(waiting)} waiting"
        )
        needs = running + waiting
        grants = got_running + got_waiting
        for need, grant in zip(needs, grants):
            assert 0 <= grant <= need, f"a request needing {need} tokens was granted {grant}"
        assert sum(grants) <= budget, f"granted {sum(grants)} tokens, budget is {budget}"
        admitted = sum(g > 0 for g in got_waiting)
        assert len(running) + admitted <= max_num_seqs, (
            f"{len(running)} running + {admitted} admitted > max_num_seqs={max_num_seqs}"
        )
        for j, grant in enumerate(grants):
            if grant > 0:
                short = [i for i in range(j) if grants[i] < needs[i]]
                assert not short, (
                    f"request {j} (in order: running, then waiting) got {grant} tokens while "
                    f"request {short[0]} before it got {grants[short[0]]} of {needs[short[0]]}"
                )
        seats = max_num_seqs - len(running)
        possible = min(budget, sum(running) + sum(waiting[:seats]))
        assert sum(grants) == possible, (
            f"granted {sum(grants)} tokens in all, but {possible} could be scheduled "
            f"(budget {budget}, {seats} free seats)"
        )

    property_()
