"""Chapter 04's learning checks: the token-budget rule of one scheduling step, the model
runner's flat batch, and preemption when the KV pool runs out."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check
from minivllm.utils import cdiv


def _counting_request(request_id: str, num_tokens: int):
    """A request of `num_tokens` tokens for the scheduler alone, which only counts tokens."""
    from minivllm.core.request import Request
    from minivllm.sample.sampling_params import SamplingParams

    return Request(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[0] * num_tokens,
        params=SamplingParams(temperature=0.0),
        eos_token_ids=(),
        max_model_len=num_tokens + 1,
        detokenizer=None,  # never used: the scheduler only counts tokens
    )


def _start_running(scheduler, request, num_computed: int) -> None:
    """Put a request straight into `running` with `num_computed` tokens (and their blocks) in
    the cache, as if earlier steps had admitted it."""
    from minivllm.core.request import RequestStatus

    scheduler.add_request(request)
    scheduler.waiting.remove(request)
    request.status, request.num_computed_tokens = RequestStatus.RUNNING, num_computed
    assert scheduler.kv_cache_manager.allocate_slots(request.request_id, num_computed)
    scheduler.running.append(request)


def _our_schedule_step():
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.scheduler import Scheduler, SchedulerConfig

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
            request = _counting_request(f"r{i}", computed + remaining)
            _start_running(scheduler, request, computed)
            running_requests.append(request)
        waiting_requests = [_counting_request(f"w{i}", n) for i, n in enumerate(waiting)]
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
        world = (
            f"(running={running}, waiting={waiting}, budget={budget}, max_num_seqs="
            f"{max_num_seqs}; your grants: running {got_running}, waiting {got_waiting})"
        )
        assert len(got_running) == len(running) and len(got_waiting) == len(waiting), (
            f"one grant per request expected: got {len(got_running)} for {len(running)} running "
            f"and {len(got_waiting)} for {len(waiting)} waiting {world}"
        )
        needs = running + waiting
        grants = got_running + got_waiting
        for need, grant in zip(needs, grants):
            assert 0 <= grant <= need, (
                f"a request needing {need} tokens was granted {grant} {world}"
            )
        assert sum(grants) <= budget, f"granted {sum(grants)} tokens, budget is {budget} {world}"
        admitted = sum(g > 0 for g in got_waiting)
        assert len(running) + admitted <= max_num_seqs, (
            f"{len(running)} running + {admitted} admitted > max_num_seqs={max_num_seqs} {world}"
        )
        for j, grant in enumerate(grants):
            if grant > 0:
                short = [i for i in range(j) if grants[i] < needs[i]]
                assert not short, (
                    f"request {j} (in order: running, then waiting) got {grant} tokens while "
                    f"request {short[0]} before it got {grants[short[0]]} of {needs[short[0]]} "
                    f"{world}"
                )
        seats = max_num_seqs - len(running)
        possible = min(budget, sum(running) + sum(waiting[:seats]))
        assert sum(grants) == possible, (
            f"granted {sum(grants)} tokens in all, but {possible} could be scheduled "
            f"(budget {budget}, {seats} free seats) {world}"
        )

    property_()


def _our_prepare_inputs():
    from minivllm.sample.sampling_params import SamplingParams
    from minivllm.worker.input_batch import CachedRequestState, prepare_inputs

    def prepare_inputs_(token_ids, num_computed, num_scheduled, block_tables, block_size):
        requests, grants = {}, {}
        for i, (tokens, computed, scheduled, table) in enumerate(
            zip(token_ids, num_computed, num_scheduled, block_tables)
        ):
            # The runner keeps prompt and output apart; where the cut falls does not matter to
            # the batch, so cut in the middle, which exercises both halves and their seam.
            cut = max(1, len(tokens) // 2)
            requests[f"s{i}"] = CachedRequestState(
                req_id=f"s{i}",
                prompt_token_ids=list(tokens[:cut]),
                output_token_ids=list(tokens[cut:]),
                params=SamplingParams(temperature=0.0),
                eos_token_ids=(),
                block_ids=list(table),
                num_computed_tokens=computed,
                generator=None,
            )
            grants[f"s{i}"] = scheduled
        batch = prepare_inputs(requests, grants, block_size)
        return batch.input_ids, batch.positions, batch.slot_mapping, batch.sample_rows

    return prepare_inputs_


@learning_check(
    "ch04.prepare_inputs",
    signature="prepare_inputs(token_ids: list[list[int]], num_computed: list[int], "
    "num_scheduled: list[int], block_tables: list[list[int]], block_size: int) -> "
    "tuple[list[int], list[int], list[int], list[int]]; sequence i knows the tokens "
    "token_ids[i] (prompt + output so far), num_computed[i] of them have K/V in the pool, and "
    "this step computes the next num_scheduled[i]; returns (input_ids, positions, "
    "slot_mapping, sample_rows): one row per scheduled token, sequence after sequence, its "
    "position in its sequence and its pool slot; then, for each sequence whose step reaches "
    "its last known token, the row of that token",
    reference=_our_prepare_inputs,
)
def check_prepare_inputs(prepare_inputs) -> None:
    """The model runner's flat batch against its definition, worked out row by row: sequence
    i's scheduled tokens are those at positions num_computed[i] .. num_computed[i] +
    num_scheduled[i] - 1 (a decode is the one token at position num_computed[i]); a token's
    slot is found by walking the block table, block_size slots per block; a sequence samples
    from its last row when that row is its last known token (a prefill chunk that stops
    mid-prompt does not)."""

    @check_settings(max_examples=60)
    @given(
        num_seqs=st.integers(1, 4),
        block_size=st.integers(1, 5),
        spare_blocks=st.integers(0, 2),
        data=st.data(),
    )
    def property_(num_seqs, block_size, spare_blocks, data):
        token_ids, num_computed, num_scheduled, kinds = [], [], [], []
        for i in range(num_seqs):
            num_tokens = data.draw(st.integers(1, 16), label=f"tokens of sequence {i}")
            kind = data.draw(st.sampled_from(["decode", "prefill", "chunk"]), label=f"kind {i}")
            if kind == "decode" and num_tokens > 1:
                computed, scheduled = num_tokens - 1, 1
            elif kind == "prefill":
                computed, scheduled = 0, num_tokens
            else:
                computed = data.draw(st.integers(0, num_tokens - 1), label=f"computed {i}")
                scheduled = data.draw(st.integers(1, num_tokens - computed), label=f"scheduled {i}")
            # Token ids that say where they come from: 100 * (sequence + 1) + position.
            token_ids.append([100 * (i + 1) + p for p in range(num_tokens)])
            num_computed.append(computed)
            num_scheduled.append(scheduled)
            kinds.append("decode" if scheduled == 1 and computed > 0 else "prefill")
        # Each table covers the tokens computed by the end of the step, maybe a block more.
        counts = [
            -(-(c + n) // block_size) + data.draw(st.integers(0, 1), label=f"extra block {i}")
            for i, (c, n) in enumerate(zip(num_computed, num_scheduled))
        ]
        order = data.draw(st.permutations(range(sum(counts) + spare_blocks)), label="pool order")
        block_tables, taken = [], 0
        for count in counts:
            block_tables.append(list(order[taken : taken + count]))
            taken += count

        # The definition, row by row.
        rows = []  # (sequence, position) of each row
        expected_ids, expected_positions, expected_slots, expected_sample_rows = [], [], [], []
        for i in range(num_seqs):
            slot_of_position = [
                block * block_size + offset
                for block in block_tables[i]
                for offset in range(block_size)
            ]
            for position in range(num_computed[i], num_computed[i] + num_scheduled[i]):
                rows.append((i, position))
                expected_ids.append(token_ids[i][position])
                expected_positions.append(position)
                expected_slots.append(slot_of_position[position])
            if num_computed[i] + num_scheduled[i] == len(token_ids[i]):
                expected_sample_rows.append(len(rows) - 1)

        got = prepare_inputs(
            [list(t) for t in token_ids],
            list(num_computed),
            list(num_scheduled),
            [list(t) for t in block_tables],
            block_size,
        )
        world = (
            f"(token_ids={token_ids}, num_computed={num_computed}, num_scheduled="
            f"{num_scheduled}, block_tables={block_tables}, block_size={block_size})"
        )
        assert len(got) == 4, (
            f"expected 4 lists (input_ids, positions, slot_mapping, sample_rows), got {len(got)}"
        )
        for name, got_list, expected in (
            ("input_ids", got[0], expected_ids),
            ("positions", got[1], expected_positions),
            ("slot_mapping", got[2], expected_slots),
        ):
            got_list = [int(x) for x in got_list]
            assert len(got_list) == len(expected), (
                f"{name} has {len(got_list)} rows, expected {len(expected)}: one per scheduled "
                f"token {world}"
            )
            for row, (g, e) in enumerate(zip(got_list, expected)):
                i, position = rows[row]
                assert g == e, (
                    f"{name}[{row}] is {g}, expected {e}: row {row} is sequence {i}'s token at "
                    f"position {position} (a {kinds[i]}: {num_computed[i]} of its "
                    f"{len(token_ids[i])} tokens computed before) {world}"
                )
        got_sample_rows = [int(x) for x in got[3]]
        assert got_sample_rows == expected_sample_rows, (
            f"sample_rows {got_sample_rows}, expected {expected_sample_rows}: the last row of "
            f"each sequence whose step reaches its last known token {world}"
        )

    property_()


def _our_schedule_with_preemption():
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.scheduler import Scheduler, SchedulerConfig

    def schedule_with_preemption(running, waiting, budget, max_num_seqs, num_blocks, block_size):
        manager = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), manager
        )
        running_ids = []
        for i, (computed, remaining) in enumerate(running):
            request = _counting_request(f"r{i}", computed + remaining)
            _start_running(scheduler, request, computed)
            running_ids.append(request.request_id)
        waiting_ids = []
        for i, prompt_len in enumerate(waiting):
            request = _counting_request(f"w{i}", prompt_len)
            scheduler.add_request(request)
            waiting_ids.append(request.request_id)
        output = scheduler.schedule()
        granted = output.num_scheduled_tokens
        return (
            [granted.get(req_id, 0) for req_id in running_ids],
            [granted.get(req_id, 0) for req_id in waiting_ids],
            [running_ids.index(req_id) for req_id in output.preempted_req_ids],
            manager.num_free_blocks,
        )

    return schedule_with_preemption


@learning_check(
    "ch04.schedule_with_preemption",
    signature="schedule_with_preemption(running: list[tuple[int, int]], waiting: list[int], "
    "budget: int, max_num_seqs: int, num_blocks: int, block_size: int) -> tuple[list[int], "
    "list[int], list[int], int]; running: (tokens computed, tokens still to compute) of each "
    "running request, oldest admitted first, each holding cdiv(computed, block_size) of the "
    "pool's num_blocks blocks; waiting: prompt lengths in queue order (no blocks yet); "
    "returns the tokens granted to each running and each waiting request (0: not scheduled), "
    "the indices into running of the requests preempted this step (newest first), and the "
    "number of free blocks after the step. A request granted g tokens holds "
    "cdiv(computed + g, block_size) blocks; FCFS: when the pool runs out, the newest running "
    "request gives all its blocks back",
    reference=_our_schedule_with_preemption,
)
def check_schedule_with_preemption(schedule_with_preemption) -> None:
    """One step of `Scheduler.schedule` with a small KV pool, as properties that pin down one
    answer:

    1. no request gets more than it needs; the grants fit the budget and the seats;
    2. the victims are the newest running requests, newest first, and get no tokens;
    3. no waiting request is admitted in a step that preempted (the pool is short: admitting
       would only preempt again);
    4. the pool holds what remains: the kept running requests' blocks after their grants, plus
       the admitted requests' blocks, fit in num_blocks, and every other block is free (a
       victim gives back all its blocks);
    5. preemption only when the pool runs out: the oldest victim, granted what the order rule
       leaves it, would not have fitted beside the requests kept;
    6. strict order (running, then waiting in queue order; a request gets tokens only when
       every kept request before it got all it needs) and greedy: budget left over means every
       kept running request got all it needs, and a waiting request is turned away only for
       lack of budget, seats or blocks.
    """

    @check_settings(max_examples=150)
    @given(
        block_size=st.integers(1, 4),
        data=st.data(),
    )
    def property_(block_size, data):
        running = data.draw(
            st.lists(
                st.tuples(st.integers(1, 12), st.one_of(st.just(1), st.integers(1, 12))),
                min_size=1,
                max_size=4,
            ),
            label="running (computed, remaining)",
        )
        waiting = data.draw(st.lists(st.integers(1, 12), max_size=3), label="waiting")
        budget = data.draw(st.integers(1, 30), label="budget")
        max_num_seqs = data.draw(st.integers(len(running), len(running) + 3), label="seats")
        held = [cdiv(computed, block_size) for computed, _ in running]
        num_blocks = sum(held) + data.draw(st.integers(0, 3), label="free blocks")
        world = (
            f"(running={running}, waiting={waiting}, budget={budget}, max_num_seqs="
            f"{max_num_seqs}, num_blocks={num_blocks}, block_size={block_size})"
        )

        result = schedule_with_preemption(
            list(running), list(waiting), budget, max_num_seqs, num_blocks, block_size
        )
        assert len(result) == 4, (
            f"expected (running grants, waiting grants, preempted, free blocks), got {result!r}"
        )
        got_running, got_waiting, preempted, num_free = result
        got_running, got_waiting = list(got_running), list(got_waiting)
        preempted, num_free = [int(i) for i in preempted], int(num_free)
        world = (
            f"{world[:-1]}; your answer: running grants {got_running}, waiting grants "
            f"{got_waiting}, preempted {preempted}, {num_free} free blocks)"
        )
        n = len(running)
        assert len(got_running) == n and len(got_waiting) == len(waiting), (
            f"one grant per request expected: got {len(got_running)} for {n} running and "
            f"{len(got_waiting)} for {len(waiting)} waiting {world}"
        )

        # 1. Needs, budget, seats.
        needs = [remaining for _, remaining in running] + list(waiting)
        grants = got_running + got_waiting
        for need, grant in zip(needs, grants):
            assert 0 <= grant <= need, f"a request needing {need} tokens got {grant} {world}"
        assert sum(grants) <= budget, f"granted {sum(grants)} tokens, budget is {budget} {world}"
        kept = [i for i in range(n) if i not in preempted]
        admitted = [j for j, grant in enumerate(got_waiting) if grant > 0]
        assert len(kept) + len(admitted) <= max_num_seqs, (
            f"{len(kept)} running + {len(admitted)} admitted > max_num_seqs={max_num_seqs} {world}"
        )

        # 2. FCFS victims: the newest, newest first, and they get nothing.
        newest_first = list(range(n - 1, n - 1 - len(preempted), -1))
        assert preempted == newest_first, (
            f"preempted {preempted}: FCFS preempts the newest running requests first, i.e. "
            f"{newest_first} {world}"
        )
        for i in preempted:
            assert got_running[i] == 0, (
                f"running request {i} was preempted but granted {got_running[i]} tokens {world}"
            )

        # 3. No admission in a step that preempted.
        if preempted:
            assert not admitted, (
                f"waiting request(s) {admitted} admitted in a step that preempted {preempted}: "
                f"after a preemption the pool is short, nobody is admitted {world}"
            )

        # 4. The pool holds what remains; the rest is free.
        used = sum(cdiv(running[i][0] + got_running[i], block_size) for i in kept)
        used += sum(cdiv(got_waiting[j], block_size) for j in admitted)
        assert used <= num_blocks, (
            f"the grants need {used} blocks, the pool has {num_blocks} {world}"
        )
        assert num_free == num_blocks - used, (
            f"{num_free} blocks free after the step, expected {num_blocks - used}: the kept "
            f"running requests and the admitted ones hold {used}, a preempted request holds "
            f"none {world}"
        )

        # 5. Preemption only when the pool runs out.
        if preempted:
            oldest = preempted[-1]
            left = budget - sum(got_running[i] for i in kept)
            computed, remaining = running[oldest]
            would_need = used + cdiv(computed + min(remaining, left), block_size)
            assert would_need > num_blocks, (
                f"running request {oldest} was preempted, but it fitted: granted "
                f"{min(remaining, left)} tokens beside the requests kept, {would_need} of "
                f"{num_blocks} blocks would be in use {world}"
            )

        # 6. Strict order, and greedy.
        order = kept + [n + j for j in range(len(waiting))]
        for position, k in enumerate(order):
            if grants[k] > 0:
                short = [o for o in order[:position] if grants[o] < needs[o]]
                assert not short, (
                    f"request {k} (in order: running, then waiting) got {grants[k]} tokens "
                    f"while request {short[0]} before it got {grants[short[0]]} of "
                    f"{needs[short[0]]} {world}"
                )
        left = budget - sum(grants)
        if left > 0:
            for i in kept:
                assert got_running[i] == needs[i], (
                    f"running request {i} got {got_running[i]} of {needs[i]} tokens while "
                    f"{left} tokens of budget were left {world}"
                )
        refused = [j for j in range(len(waiting)) if got_waiting[j] == 0]
        seats_left = max_num_seqs - len(kept) - len(admitted)
        if not preempted and left > 0 and seats_left > 0 and refused:
            j = refused[0]
            would_need = used + cdiv(min(waiting[j], left), block_size)
            assert would_need > num_blocks, (
                f"waiting request {j} was not admitted, though {left} tokens of budget, "
                f"{seats_left} seat(s) and the blocks for {min(waiting[j], left)} of its tokens "
                f"({would_need} of {num_blocks} in use) were there {world}"
            )

    property_()
