"""Chapter 04 — continuous batching: decide, every step, which requests run and how many tokens.

Static batching (chapter 02) fixed the batch at the start and ran it until its longest member
ended. Here the batch is rebuilt at *every* step, so a finished request's place is taken by a
waiting one at once. One rule covers prefill and decode alike (vLLM V1's design): each request
has `num_computed_tokens` (tokens whose K/V are in the cache) and `num_tokens` (prompt + output
so far); a step grants it some of the difference:

    decode:          num_tokens - num_computed = 1      -> grant 1
    prefill:         num_tokens - num_computed = 300    -> grant up to the remaining budget
    chunked prefill: a long prompt gets 2048 this step, the rest in the next ones

All grants share one token budget per step (`max_num_batched_tokens`), and at most
`max_num_seqs` requests run. Running requests go first, then waiting ones in order. When the
KV pool runs out of blocks, the scheduler *preempts*: the newest running request (or the one
with the lowest priority) gives back all its blocks and returns to the front of the waiting
queue, to be recomputed from scratch later. Only time is lost: the recomputed K/V equal the
first ones up to float rounding (one prefill adds in another order than the decode steps did).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.prefix_cache import PrefixCacheStats
from minivllm.core.request import Request, RequestStatus
from minivllm.core.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from minivllm.outputs import ModelRunnerOutput


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"  # "fcfs": first come first served; "priority": lowest priority first
    enable_chunked_prefill: bool = True
    # Chapter 08: slots reserved past a grant that reaches the end of a request's tokens, where
    # a draft model writes the K/V of its guesses (k with a draft model, 0 otherwise).
    num_lookahead_tokens: int = 0
    # Chapter 08: drafts are drawn from a draft model's distribution q (draft_model,
    # layer_skip), which is not one-hot for a sampled request; n-gram drafts are certain.
    drafts_are_sampled: bool = False


@dataclass
class SpecDecodeStats:
    """Chapter 08: how the draft tokens fared, cumulative (vLLM's spec-decode counters)."""

    num_drafts: int = 0  # verification steps of one request
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # drafts kept at position i

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


@dataclass
class RunnerView:
    """What the model runner already knows of a request, so a step sends only what changed."""

    num_block_ids: int  # the first entries of the block table
    num_output_tokens: int
    preempted: bool = False  # its blocks were taken: the next step sends a whole new table


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_generated_tokens = 0  # tokens appended to outputs (several a step, chapter 08)
        self.prefix_cache_stats = PrefixCacheStats()  # chapter 05 hook: cumulative, in tokens
        self.spec_decode_stats = SpecDecodeStats()  # chapter 08 hook
        self._arrival_order: dict[str, int] = {}
        self._arrival_counter = itertools.count()
        self._runner_views: dict[str, RunnerView] = {}  # requests the runner holds
        self._finished_req_ids: set[str] = set()  # to tell the runner at the next step
        self._failed_waiting: list[Request] = []  # ended before they ran, reported next update

    def add_request(self, request: Request) -> None:
        self._arrival_order[request.request_id] = next(self._arrival_counter)
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_finished_requests(self) -> bool:
        """Requests that ended since the last step, which the runner must still forget."""
        return bool(self._finished_req_ids)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating the blocks they need."""
        budget = self.config.max_num_batched_tokens
        granted: dict[str, int] = {}  # request id -> new tokens, in batch order
        preempted: list[Request] = []
        admitted: list[Request] = []  # left the waiting queue this step

        # 1. Running requests first: they hold blocks already, and their users are waiting
        #    for the next token.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            # Chapter 08 hook: a decode's grant also covers its draft tokens (verified at once).
            num_new = min(request.num_tokens_with_spec - request.num_computed_tokens, budget)
            del request.spec_token_ids[
                max(0, request.num_computed_tokens + num_new - request.num_tokens) :
            ]
            total = request.num_computed_tokens + num_new
            reserved = self._with_lookahead(request, total)
            while not self.kv_cache_manager.allocate_slots(request.request_id, reserved):
                victim = self._pick_victim()
                self._preempt(victim)
                preempted.append(victim)
                if victim.request_id in granted:  # already scheduled this step: undo it
                    budget += granted.pop(victim.request_id)
                    index -= 1
                if victim is request:
                    break
            else:
                granted[request.request_id] = num_new
                budget -= num_new
                index += 1

        # 2. Then waiting requests, in policy order, while budget, seats and blocks last. After
        #    a preemption the pool is short of blocks: admitting anyone would only thrash.
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self._next_waiting()
            if request is None:  # chapter 10: the rest wait for their grammar's compile
                break
            if request.grammar is not None and request.grammar.compile_error is not None:
                self.waiting.remove(request)  # chapter 10: this request alone cannot run
                request.finish_with_error(request.grammar.compile_error)
                self._retire(request)
                self._failed_waiting.append(request)
                continue
            cached_blocks = self._cached_blocks(request)  # chapter 05 hook
            num_cached = len(cached_blocks) * self.kv_cache_manager.block_size  # 0 without it
            num_new = request.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            reserved = self._with_lookahead(request, num_cached + num_new)
            if not self.kv_cache_manager.allocate_slots(
                request.request_id, reserved, cached_blocks
            ):
                break
            request.num_computed_tokens = num_cached
            if self.kv_cache_manager.prefix_cache is not None:  # chapter 05 hook: count
                self.prefix_cache_stats.record(request.num_tokens, num_cached)
            self.waiting.remove(request)
            admitted.append(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached  # chapter 05: reported in the output
            granted[request.request_id] = num_new
            budget -= num_new

        output = self._make_output(granted, preempted)
        self.check_invariants(output, num_admitted=len(admitted))
        return output

    def _cached_blocks(self, request: Request) -> list[int]:
        """Chapter 05: the blocks of the request's prefix already in the pool. A request that
        asks for prompt logprobs reads none, as in vLLM: each prompt position must run
        through the model to be scored (its blocks are still cached for the others)."""
        if request.params.prompt_logprobs is not None:
            return []
        return self.kv_cache_manager.find_cached_blocks(request)

    def _with_lookahead(self, request: Request, total: int) -> int:
        """Chapter 08: the slots to hold for a grant up to `total` tokens. A grant that reaches
        the end of the known tokens is followed by a proposal, so it gets the lookahead slots
        too (within the context)."""
        if not self.config.num_lookahead_tokens or total < request.num_tokens:
            return total
        return min(total + self.config.num_lookahead_tokens, request.max_model_len)

    def _make_output(self, granted: dict[str, int], preempted: list[Request]) -> SchedulerOutput:
        """The step as plain data: new requests whole, the others as what changed."""
        output = SchedulerOutput(
            num_scheduled_tokens=granted,
            preempted_req_ids=[r.request_id for r in preempted],
            finished_req_ids=self._finished_req_ids,
        )
        self._finished_req_ids = set()
        by_id = {r.request_id: r for r in self.running}
        for req_id in granted:
            request = by_id[req_id]
            if request.spec_token_ids:  # chapter 08 hook
                output.scheduled_spec_decode_tokens[req_id] = list(request.spec_token_ids)
            samples = request.num_computed_tokens + granted[req_id] >= request.num_tokens
            if request.grammar is not None and samples:  # chapter 10 hook
                output.grammar_bitmasks[req_id] = request.grammar.token_bitmasks(
                    request.spec_token_ids
                )
            table = self.kv_cache_manager.block_tables[req_id]
            view = self._runner_views.get(req_id)
            if view is None:
                output.scheduled_new_reqs.append(
                    NewRequestData(
                        req_id=req_id,
                        prompt_token_ids=list(request.prompt_token_ids),
                        sampling_params=request.params,
                        eos_token_ids=request.eos_token_ids,
                        block_ids=list(table),
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
            else:
                output.scheduled_cached_reqs.append(
                    CachedRequestData(
                        req_id=req_id,
                        new_token_ids=request.output_token_ids[view.num_output_tokens :],
                        new_block_ids=list(
                            table if view.preempted else table[view.num_block_ids :]
                        ),
                        num_computed_tokens=request.num_computed_tokens,
                        resumed_from_preemption=view.preempted,
                        num_kept_block_ids=0 if view.preempted else view.num_block_ids,
                    )
                )
            self._runner_views[req_id] = RunnerView(len(table), len(request.output_token_ids))
        return output

    def check_invariants(self, output: SchedulerOutput, num_admitted: int) -> None:
        """The rules every step keeps; a broken one is a scheduler bug, so it raises at once."""
        config = self.config
        granted = output.num_scheduled_tokens
        assert output.total_num_scheduled_tokens <= config.max_num_batched_tokens, (
            f"granted {output.total_num_scheduled_tokens} tokens, the budget is "
            f"{config.max_num_batched_tokens}"
        )
        assert len(self.running) <= config.max_num_seqs, (
            f"{len(self.running)} requests running, max_num_seqs is {config.max_num_seqs}"
        )
        assert all(n > 0 for n in granted.values()), f"an empty grant: {granted}"
        assert not (output.preempted_req_ids and num_admitted), (
            f"admitted {num_admitted} waiting request(s) in a step that preempted "
            f"{output.preempted_req_ids}: the pool is short of blocks"
        )
        for request in self.running:
            end = request.num_computed_tokens + granted.get(request.request_id, 0)
            assert end <= request.num_tokens_with_spec, (
                f"{request.request_id} granted past its tokens"
            )
            held = len(self.kv_cache_manager.block_tables[request.request_id])
            assert held * self.kv_cache_manager.block_size >= end, (
                f"{request.request_id} runs to token {end} with only {held} blocks"
            )

    def update_from_output(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Advance the scheduled requests, append their new tokens, retire the finished ones.
        Returns the requests that received a token or ended (with an error too: a fault of
        one request, such as nothing left to sample, ends that request alone)."""
        by_id = {r.request_id: r for r in self.running}
        updated, self._failed_waiting = self._failed_waiting, []
        for req_id, num_new in output.num_scheduled_tokens.items():
            request = by_id[req_id]
            if req_id in runner_output.errors:
                request.finish_with_error(runner_output.errors[req_id])
                self._retire(request)
                updated.append(request)
                continue
            token_ids = runner_output.sampled_token_ids.get(req_id)
            if req_id in runner_output.prompt_logprobs:  # this step scored prompt tokens
                request.record_prompt_logprobs(runner_output.prompt_logprobs[req_id])
            request.num_computed_tokens += num_new
            request.spec_token_ids = []
            drafts = output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and token_ids is not None:  # chapter 08 hook: roll back the rejected
                num_accepted = len(token_ids) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_decode_stats.record(len(drafts), num_accepted)
            if token_ids is None:
                self.kv_cache_manager.cache_full_blocks(request)
                continue  # a prefill chunk that did not reach the end of the prompt
            logprobs = runner_output.logprobs.get(req_id) or [None] * len(token_ids)
            for token_id, token_logprobs in zip(token_ids, logprobs):
                request.append_token(token_id, token_logprobs)
                self.num_generated_tokens += 1
                if request.is_finished:
                    break
            # A stop among the accepted drafts ends the sequence there: later K/V do not count.
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            self.kv_cache_manager.cache_full_blocks(request)
            updated.append(request)
            if request.is_finished:
                self._retire(request)
            elif drafts or self.config.num_lookahead_tokens:
                # Chapter 08: rejected drafts' and lookahead slots' blocks go back.
                self.kv_cache_manager.free_tail(req_id, request.num_computed_tokens)
                view = self._runner_views[req_id]  # the runner must drop them too
                view.num_block_ids = min(
                    view.num_block_ids, len(self.kv_cache_manager.block_tables[req_id])
                )
            if not request.is_finished:
                request.spec_token_ids = self._draft_room(
                    request, runner_output.spec_token_ids.get(req_id, [])
                )
        return updated

    def _draft_room(self, request: Request, drafts: list[int]) -> list[int]:
        """Chapter 08: the drafts the request can still use. A step emits the accepted drafts
        plus one token, so at most max_tokens - output - 1 drafts (never more tokens than
        asked), which is also none past the context (`Request.max_tokens` ends there). With a
        grammar (chapter 10), none past the first draft it forbids; a draft drawn from a draft
        model's q is kept there too, to be rejected by the verifier
        (`RequestGrammar.valid_drafts` says why)."""
        room = request.max_tokens - len(request.output_token_ids)
        drafts = drafts[: max(0, room - 1)]
        if request.grammar is not None and drafts:
            sampled = self.config.drafts_are_sampled and not request.params.is_greedy
            drafts = request.grammar.valid_drafts(drafts, keep_forbidden=sampled)
        return drafts

    def abort_request(self, request: Request) -> None:
        """Remove a request wherever it is and give back its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.finish_reason is None:
            request.finish_reason = "abort"
        self._retire(request)

    def _retire(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        request.status = RequestStatus.FINISHED
        self.kv_cache_manager.free(request.request_id)
        self._arrival_order.pop(request.request_id, None)
        if self._runner_views.pop(request.request_id, None) is not None:
            self._finished_req_ids.add(request.request_id)

    def _pick_victim(self) -> Request:
        """FCFS: the most recently admitted running request. Priority: the lowest-priority
        (largest value) one, newest among equals."""
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, self._arrival_order[r.request_id]))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Free all of the request's blocks and queue it first, to be recomputed from scratch."""
        self.running.remove(request)
        self.kv_cache_manager.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # chapter 08: drafts are only worth verifying while running
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request.request_id in self._runner_views:
            self._runner_views[request.request_id].preempted = True
        self.waiting.appendleft(request)

    def _next_waiting(self) -> Request | None:
        """The next waiting request to admit, None if none can start yet (chapter 10: a
        request whose grammar is still compiling waits, without holding up the others)."""
        ready = (r for r in self.waiting if r.grammar is None or r.grammar.is_ready)
        if self.config.policy == "priority":
            key = lambda r: (r.priority, self._arrival_order[r.request_id])  # noqa: E731
            return min(ready, key=key, default=None)
        return next(ready, None)  # FCFS: usually the head of the queue, found at once
