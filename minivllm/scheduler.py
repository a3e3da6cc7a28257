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
queue, to be recomputed from scratch later. Greedy outputs are identical; only time is lost.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from minivllm.block_manager import KVCacheManager
from minivllm.prefix_cache import PrefixCacheStats
from minivllm.request import Request, RequestStatus
from minivllm.sampling import TokenLogprobs


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"  # "fcfs": first come first served; "priority": lowest priority first
    enable_chunked_prefill: bool = True


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens of the request computed in this step

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token, so its logits give a new token.
        A prefill chunk that stops mid-prompt produces no token."""
        request = self.request
        return request.num_computed_tokens + self.num_new_tokens == request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_stats = PrefixCacheStats()  # cumulative, in prompt tokens
        self._arrival_order: dict[str, int] = {}
        self._arrival_counter = itertools.count()

    def add_request(self, request: Request) -> None:
        self._arrival_order[request.request_id] = next(self._arrival_counter)
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating the blocks they need."""
        budget = self.config.max_num_batched_tokens
        granted: dict[str, int] = {}  # request id -> new tokens, in batch order
        output = SchedulerOutput()

        # 1. Running requests first: they hold blocks already, and their users are waiting
        #    for the next token.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            total = request.num_computed_tokens + num_new
            while not self.kv_cache_manager.allocate_slots(request.request_id, total):
                victim = self._pick_victim()
                self._preempt(victim)
                output.preempted.append(victim)
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
        while self.waiting and budget > 0 and not output.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self._next_waiting()
            # Chapter 05: blocks another request already computed are shared, not recomputed.
            cached_blocks = self.kv_cache_manager.find_cached_blocks(request)
            num_cached = len(cached_blocks) * self.kv_cache_manager.block_size
            num_new = request.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            total = num_cached + num_new
            if not self.kv_cache_manager.allocate_slots(request.request_id, total, cached_blocks):
                break
            request.num_computed_tokens = num_cached
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_cached
            if request.metrics.first_scheduled_time is None:
                request.num_cached_tokens = num_cached
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()
            granted[request.request_id] = num_new
            budget -= num_new

        by_id = {r.request_id: r for r in self.running}
        output.scheduled = [ScheduledRequest(by_id[rid], n) for rid, n in granted.items()]
        return output

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, tuple[int, TokenLogprobs | None]],
    ) -> list[Request]:
        """Advance the scheduled requests, append their new tokens, retire the finished ones.
        Returns the requests that received a token."""
        updated = []
        for scheduled in output.scheduled:
            request = scheduled.request
            request.num_computed_tokens += scheduled.num_new_tokens
            self.kv_cache_manager.cache_full_blocks(request)
            if request.request_id not in sampled:
                continue  # a prefill chunk that did not reach the end of the prompt
            token_id, token_logprobs = sampled[request.request_id]
            request.append_token(token_id, token_logprobs)
            updated.append(request)
            if request.is_finished:
                self._retire(request)
        return updated

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
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _next_waiting(self) -> Request:
        if self.config.policy == "priority":
            return min(self.waiting, key=lambda r: (r.priority, self._arrival_order[r.request_id]))
        return self.waiting[0]
