"""Chapter 04 — what crosses from the scheduler to the model runner each step, as plain data.

The scheduler lives with the requests (their text, detokenizers, stop rules); the model runner
lives with the model and the KV pool, possibly in another process (tensor parallelism) on
another machine. So a step is described by plain, picklable data only — ids, token ids, block ids,
counts, sampling parameters — never by live objects:

    step 1: new    A: prompt [1, 5, 9, ...], params, blocks [0, 1], computed 0   -> 300 tokens
    step 2: cached A: new tokens [42], new blocks [], computed 300               ->   1 token
            new    B: prompt [...], params, blocks [2], computed 0               ->  12 tokens
    step 3: finished: {A}  (the runner forgets it)

A request is sent whole once, when the runner first meets it; afterwards only what changed.
The runner keeps its own copy of each request's tokens, blocks and random generator
(`worker/input_batch.py`). After a preemption the request's blocks are gone: it comes back as
a cached request with `resumed_from_preemption` and a whole new block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.sample.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen: everything it needs to run and sample it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # its seed, if any, seeds the runner's generator
    eos_token_ids: tuple[int, ...]  # banned by the sampler until min_tokens is reached
    block_ids: list[int]
    num_computed_tokens: int  # prompt tokens found in the prefix cache


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed since it last ran."""

    req_id: str
    new_token_ids: list[int]  # tokens appended since (the ones the runner sampled last)
    new_block_ids: list[int]  # blocks appended; after a preemption, the whole new table
    num_computed_tokens: int
    resumed_from_preemption: bool = False
    # How many of its blocks the runner keeps before appending the new ones: all it had,
    # none after a preemption, fewer after rejected draft tokens gave blocks back (chapter 08).
    num_kept_block_ids: int = 0


@dataclass
class SchedulerOutput:
    """One step: which requests run, and how many of their tokens."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # request id -> tokens computed this step, in batch order (the runner lays them out so).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: list[str] = field(default_factory=list)  # lost their blocks this step
    finished_req_ids: set[str] = field(default_factory=set)  # ended since the last step
    # Chapter 08: request id -> the draft tokens this step verifies (its grant covers them,
    # after its last known token).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Chapter 10: request id -> the tokens its grammar allows at each row it samples this step
    # (a torch int32 bitmask [1 + drafts, ceil(vocab / 32)], built by the request's grammar:
    # the scheduler itself never touches torch), for requests with structured outputs.
    grammar_bitmasks: dict[str, Any] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing to tell the runner."""
        return not self.num_scheduled_tokens and not self.finished_req_ids
