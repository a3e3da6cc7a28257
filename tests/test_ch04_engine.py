"""Chapter 04 checks: continuous batching changes when each token is computed, never which.

Whatever the engine does to a request (batch it with others of different lengths, split its
prompt over many steps, page its K/V through any block size, throw its blocks away and recompute
it, run it early or late by priority), its greedy float32 tokens are transformers' `generate`
for that prompt alone. The scheduler's promises are checked as properties over random request
streams: the token budget and the seat limit hold at every step, every admitted request
finishes, first come is first served, and every block goes back to the pool.

Most checks run the tiny *mistral* model: its untied output head makes its greedy tokens depend
on the whole context. (The tiny models with tied embeddings, llama and qwen3, echo their last
input token whatever came before, so a broken KV cache could not change their output.)
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import ENGINE_TEST_FAMILY, EOS_TOKEN_ID, assert_pool_is_empty
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request, RequestStatus
from minivllm.core.scheduler import Scheduler, SchedulerConfig, SpecDecodeStats
from minivllm.engine.llm_engine import LLMEngine, spec_decode_metric_rows
from minivllm.outputs import ModelRunnerOutput

ENGINE_FAMILY = ENGINE_TEST_FAMILY
VOCAB_SIZE = 49152  # the embedded tokenizer's, shared by the tiny models

# Per-prompt limits against the chat prompts' natural reply lengths on the embedded model
# (chapter 02's): some requests end at EOS, others by length, at different steps.
MIXED_MAX_TOKENS = [6, 20, 24, 20]


def blocks_for(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def kv_bytes_per_token(model_dir) -> int:
    """From config.json, by definition: K and V, every layer and KV head, float32."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


def pool_bytes(model_dir, num_blocks: int, block_size: int) -> int:
    """The kv_cache_memory_bytes that hold exactly `num_blocks` blocks."""
    return num_blocks * block_size * kv_bytes_per_token(model_dir)


def tiny_engine(
    model_dir, num_blocks=64, block_size=4, enable_prefix_caching=False, **kwargs
) -> LLMEngine:
    """Chapter 04's engine (no prefix cache unless asked: chapter 05 adds it) on a tiny model,
    with a pool of exactly `num_blocks` blocks, float32 on the CPU."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            block_size=block_size,
            kv_cache_memory_bytes=pool_bytes(model_dir, num_blocks, block_size),
            enable_prefix_caching=enable_prefix_caching,
            **kwargs,
        )
    )
    assert engine.kv_cache_manager.num_blocks == num_blocks
    limit_steps(engine)
    return engine


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist()


def metrics(engine: LLMEngine) -> dict[str, float]:
    return {m.name: m.value for m in engine.get_metrics()}


def run_to_completion(engine: LLMEngine) -> dict:
    """Step until no request is left; request id -> its final RequestOutput."""
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def limit_steps(engine: LLMEngine, max_steps: int = 5000) -> None:
    """Make a run fail, instead of looping forever, if the engine stops making progress."""
    step, count = engine.step, [0]

    def counted_step():
        count[0] += 1
        if count[0] > max_steps:
            raise AssertionError(f"requests still unfinished after {max_steps} steps")
        return step()

    engine.step = counted_step


def bounded_llm(**kwargs) -> LLM:
    """`LLM(**kwargs)` whose generate fails after too many steps (a livelock) instead of hanging."""
    llm = LLM(**kwargs)
    limit_steps(llm.llm_engine)
    return llm


class ScheduleLog:
    """Records what the scheduler decides at every step, before the step changes anything."""

    def __init__(self, engine: LLMEngine):
        self.steps: list[list[dict]] = []  # per step: one entry per scheduled request
        self.running_sizes: list[int] = []  # per step: running requests after scheduling
        self.preempted: list[list[str]] = []  # per step: requests that lost their blocks
        self.admitted: list[list[str]] = []  # per step: requests that left the waiting queue
        scheduler = engine.scheduler
        schedule = scheduler.schedule

        def recording_schedule():
            waiting_before = {r.request_id for r in scheduler.waiting}
            output = schedule()
            by_id = {r.request_id: r for r in scheduler.running}
            self.preempted.append(list(output.preempted_req_ids))
            self.admitted.append([rid for rid in by_id if rid in waiting_before])
            self.steps.append(
                [
                    {
                        "id": by_id[req_id].parent_request_id,
                        "computed": by_id[req_id].num_computed_tokens,
                        "new": num_new,
                        "prompt_len": len(by_id[req_id].prompt_token_ids),
                        "num_tokens": by_id[req_id].num_tokens,
                    }
                    for req_id, num_new in output.num_scheduled_tokens.items()
                ]
            )
            self.running_sizes.append(len(scheduler.running))
            return output

        scheduler.schedule = recording_schedule

    def first_scheduled_order(self) -> list[str]:
        order = []
        for step in self.steps:
            for entry in step:
                if entry["id"] not in order:
                    order.append(entry["id"])
        return order


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dirs):
    return tiny_model_dirs[ENGINE_FAMILY]


@pytest.fixture(scope="module")
def tiny_prompts(chat_prompts) -> list[list[int]]:
    """Chat prompts (32 to 122 tokens) and short random ones (1 to 5 tokens)."""
    return list(chat_prompts) + [random_prompt(1, 1), random_prompt(5, 2), random_prompt(3, 3)]


TINY_MAX_TOKENS = [12, 3, 9, 16, 1, 7, 10]


def assert_equals_transformers(outputs, prompts, max_tokens, tiny_greedy, family=ENGINE_FAMILY):
    for i, (output, prompt, limit) in enumerate(zip(outputs, prompts, max_tokens, strict=True)):
        expected = tiny_greedy(prompt, limit, family)
        assert output.outputs[0].token_ids == expected, f"prompt {i}"


# --- greedy tokens == transformers -----------------------------------------------------------


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_seqs": 2, "max_num_batched_tokens": 48}],
    ids=["one-batch", "continuous"],
)
def test_mixed_prompt_lengths_equal_transformers(
    engine_args, embedded_dir, chat_prompts, transformers_greedy
):
    """Chat prompts of 32 to 122 tokens with different limits, run together (and, with two seats
    and a 48-token budget, joining as others finish while the long prompt is chunked), give each
    prompt exactly transformers' greedy tokens for it alone, EOS stops included."""
    llm = bounded_llm(kv_cache_memory_bytes=64 * 2**20, **engine_args)  # ~1400 KV tokens
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in chat_prompts],
        [greedy(limit) for limit in MIXED_MAX_TOKENS],
        use_tqdm=False,
    )
    reasons = set()
    for i, (output, prompt, limit) in enumerate(zip(outputs, chat_prompts, MIXED_MAX_TOKENS)):
        expected = transformers_greedy(prompt, limit, EOS_TOKEN_ID)
        assert output.outputs[0].token_ids == expected, f"prompt {i}"
        reasons.add(output.outputs[0].finish_reason)
    assert reasons == {"stop", "length"}
    assert_pool_is_empty(llm.llm_engine)


@pytest.mark.parametrize(
    "family, block_size",
    [("mistral", 1), ("mistral", 5), ("mistral", 16), ("qwen2", 3)],
)
def test_block_sizes_equal_transformers(
    family, block_size, tiny_model_dirs, tiny_prompts, tiny_greedy
):
    """The block size only changes where K/V live: one-token blocks, a non-power of two and the
    default 16 all give transformers' tokens."""
    model_dir = tiny_model_dirs[family]
    llm = bounded_llm(
        model=str(model_dir),
        block_size=block_size,
        kv_cache_memory_bytes=pool_bytes(model_dir, blocks_for(1024, block_size), block_size),
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in tiny_prompts],
        [greedy(limit) for limit in TINY_MAX_TOKENS],
        use_tqdm=False,
    )
    assert_equals_transformers(outputs, tiny_prompts, TINY_MAX_TOKENS, tiny_greedy, family)


def test_chunked_prefill_equals_transformers(tiny_dir, tiny_prompts, tiny_greedy):
    """With a 7-token budget, prompts are split over many steps, each chunk continuing where the
    last stopped, next to other requests' decodes; the tokens do not change."""
    llm = bounded_llm(model=str(tiny_dir), max_num_batched_tokens=7, kv_cache_memory_bytes=2**20)
    log = ScheduleLog(llm.llm_engine)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in tiny_prompts],
        [greedy(limit) for limit in TINY_MAX_TOKENS],
        use_tqdm=False,
    )
    assert_equals_transformers(outputs, tiny_prompts, TINY_MAX_TOKENS, tiny_greedy)

    # The run really mixed a decode with a prefill chunk that starts mid-prompt in one step.
    def is_decode(e):
        return e["computed"] >= e["prompt_len"]

    def is_mid_prompt_chunk(e):
        return 0 < e["computed"] < e["prompt_len"]

    assert any(
        any(map(is_decode, step)) and any(map(is_mid_prompt_chunk, step)) for step in log.steps
    )
    assert all(sum(e["new"] for e in step) <= 7 for step in log.steps)


@pytest.mark.parametrize("enable_prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_preemption_recomputes_the_same_tokens(
    enable_prefix_caching, tiny_dir, tiny_prompts, tiny_greedy
):
    """A pool of 36 four-token blocks cannot hold all requests at once: the newest running ones
    are preempted (their blocks freed) and later recomputed (from scratch, or from what the
    prefix cache still holds), with the same tokens."""
    llm = bounded_llm(
        model=str(tiny_dir),
        block_size=4,
        kv_cache_memory_bytes=pool_bytes(tiny_dir, 36, 4),
        enable_prefix_caching=enable_prefix_caching,
    )
    max_tokens = [16] * len(tiny_prompts)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in tiny_prompts],
        [greedy(limit) for limit in max_tokens],
        use_tqdm=False,
    )
    assert metrics(llm.llm_engine)["vllm:num_preemptions"] > 0
    assert_equals_transformers(outputs, tiny_prompts, max_tokens, tiny_greedy)
    assert_pool_is_empty(llm.llm_engine)


def test_priority_policy_gives_the_same_tokens(tiny_dir, tiny_prompts, tiny_greedy):
    """With scheduling_policy="priority" (and a pool small enough to preempt by priority), the
    order of work changes and the tokens do not."""
    llm = bounded_llm(
        model=str(tiny_dir),
        block_size=4,
        scheduling_policy="priority",
        kv_cache_memory_bytes=pool_bytes(tiny_dir, 36, 4),
    )
    max_tokens = [16] * len(tiny_prompts)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in tiny_prompts],
        [greedy(limit) for limit in max_tokens],
        priority=[3, 0, 2, 1, 0, 5, 1],
        use_tqdm=False,
    )
    assert metrics(llm.llm_engine)["vllm:num_preemptions"] > 0
    assert_equals_transformers(outputs, tiny_prompts, max_tokens, tiny_greedy)
    assert_pool_is_empty(llm.llm_engine)


def test_priority_policy_runs_lowest_value_first(tiny_dir):
    """With one seat, requests queued together start in order of priority (lower first), equal
    priorities in arrival order."""
    llm = bounded_llm(
        model=str(tiny_dir),
        max_num_seqs=1,
        scheduling_policy="priority",
        kv_cache_memory_bytes=2**20,
    )
    log = ScheduleLog(llm.llm_engine)
    priorities = [2, 0, 1, 0, 2]
    outputs = llm.generate(
        [{"prompt_token_ids": random_prompt(4, i)} for i in range(5)],
        greedy(3),
        priority=priorities,
        use_tqdm=False,
    )
    by_priority = sorted(range(5), key=lambda i: (priorities[i], i))
    assert log.first_scheduled_order() == [outputs[i].request_id for i in by_priority]


def test_fcfs_preempts_the_newest_running_request(tiny_dir, tiny_greedy):
    """Out of blocks, FCFS preempts the most recently admitted running request: the oldest one
    keeps its blocks and is never recomputed, so it finishes as early as possible."""
    engine = tiny_engine(tiny_dir, num_blocks=10, block_size=4)  # 40 tokens; each needs 31
    prompts = {"old": random_prompt(12, 80), "new": random_prompt(12, 81)}
    engine.add_request("old", {"prompt_token_ids": prompts["old"]}, greedy(20))
    engine.step()
    engine.add_request("new", {"prompt_token_ids": prompts["new"]}, greedy(20))
    sequences = {rid: engine.requests[rid][0] for rid in prompts}
    finished = run_to_completion(engine)
    assert metrics(engine)["vllm:num_preemptions"] > 0
    assert sequences["old"].num_preemptions == 0 and sequences["new"].num_preemptions > 0
    for rid, prompt in prompts.items():
        assert finished[rid].outputs[0].token_ids == tiny_greedy(prompt, 20)


def test_fcfs_preempts_from_the_newest_back_and_requeues_them_in_order():
    """Three running requests of one block each in a pool of three, all growing into a second
    block: the newest (c) goes first, then b, which is then the newest left, so a alone
    runs on; both wait at the front of the queue, in their first order, marked waiting, each
    preempted once. (The scheduler alone, with a runner that samples token 7.)"""
    scheduler = Scheduler(SchedulerConfig(), KVCacheManager(num_blocks=3, block_size=4))
    params = SamplingParams(max_tokens=8, detokenize=False)
    requests = {
        rid: Request.create(rid, None, [1, 2, 3, 4], params, None, (0,), max_model_len=64)
        for rid in "abc"
    }
    for request in requests.values():
        scheduler.add_request(request)
    prefill = scheduler.schedule()
    assert list(prefill.num_scheduled_tokens) == ["a", "b", "c"]
    scheduler.update_from_output(prefill, ModelRunnerOutput({rid: [7] for rid in "abc"}))

    decode = scheduler.schedule()

    assert decode.preempted_req_ids == ["c", "b"]
    assert list(decode.num_scheduled_tokens) == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    for rid in "bc":
        assert requests[rid].status == RequestStatus.WAITING
        assert requests[rid].num_preemptions == 1
        assert requests[rid].num_computed_tokens == 0  # its K/V are gone with its blocks
    assert requests["a"].num_preemptions == 0 and scheduler.num_preemptions == 2


def test_priority_policy_preempts_the_lowest_priority(tiny_dir, tiny_greedy):
    """With the priority policy, the running request with the largest priority value gives its
    blocks up, even though it arrived first."""
    engine = tiny_engine(tiny_dir, num_blocks=10, block_size=4, scheduling_policy="priority")
    prompts = {"background": random_prompt(12, 82), "urgent": random_prompt(12, 83)}
    engine.add_request(
        "background", {"prompt_token_ids": prompts["background"]}, greedy(20), priority=1
    )
    engine.step()
    engine.add_request("urgent", {"prompt_token_ids": prompts["urgent"]}, greedy(20), priority=0)
    sequences = {rid: engine.requests[rid][0] for rid in prompts}
    finished = run_to_completion(engine)
    assert sequences["urgent"].num_preemptions == 0
    assert sequences["background"].num_preemptions > 0
    for rid, prompt in prompts.items():
        assert finished[rid].outputs[0].token_ids == tiny_greedy(prompt, 20)


def test_without_chunked_prefill_each_prompt_runs_in_one_step(tiny_dir, tiny_prompts, tiny_greedy):
    """With enable_chunked_prefill=False a prompt is never split: each request's first step
    computes its whole prompt, and the tokens are transformers'."""
    prompts, limits = tiny_prompts[:3], TINY_MAX_TOKENS[:3]  # 32 to 38 tokens
    # Without chunking a whole sequence (prompt + output, if it is ever recomputed) must fit in
    # one step, so the budget covers the longest prompt plus its output.
    engine = tiny_engine(tiny_dir, max_num_batched_tokens=64, enable_chunked_prefill=False)
    log = ScheduleLog(engine)
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(limit))
    finished = run_to_completion(engine)
    first_steps = {}
    for step in log.steps:
        for entry in step:
            first_steps.setdefault(entry["id"], entry)
    assert all(e["computed"] == 0 and e["new"] == e["prompt_len"] for e in first_steps.values())
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        assert finished[str(i)].outputs[0].token_ids == tiny_greedy(prompt, limit)


def test_without_chunked_prefill_a_prompt_over_the_budget_is_refused(tiny_dir):
    """With chunked prefill off, a prompt must fit in one step's token budget: a longer one is
    refused (naming the 8-token limit), or the engine refuses the configuration, instead of
    waiting forever."""
    try:
        engine = tiny_engine(tiny_dir, max_num_batched_tokens=8, enable_chunked_prefill=False)
    except ValueError as error:  # refused up front: the budget is below the context length
        assert "max_num_batched_tokens" in str(error)
        return
    with pytest.raises(ValueError, match=r"\b8\b"):
        engine.add_request("long", {"prompt_token_ids": random_prompt(20, 90)}, greedy(2))


def test_priority_policy_keeps_arrival_order_for_equal_priorities(tiny_dir):
    """With the priority policy and equal priorities, requests that arrive while others finish
    still start in arrival order (priority ties are first come, first served)."""
    engine = tiny_engine(tiny_dir, max_num_seqs=1, scheduling_policy="priority")
    log = ScheduleLog(engine)
    for rid in "ABCD":
        engine.add_request(rid, {"prompt_token_ids": random_prompt(3, 0)}, greedy(2))
    while "B" in engine.requests:  # A and B finish, C and D wait
        engine.step()
    engine.add_request("E", {"prompt_token_ids": random_prompt(3, 0)}, greedy(2))
    run_to_completion(engine)
    assert log.first_scheduled_order() == list("ABCDE")


# --- scheduler properties over random request streams -----------------------------------------


class TinyDir:
    """The tiny model's directory, with a short repr for hypothesis' counterexamples."""

    def __init__(self, path):
        self.path = path

    def __repr__(self) -> str:
        return "TinyDir()"


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> TinyDir:
    return TinyDir(tiny_dir)


@st.composite
def request_streams(draw):
    """Requests arriving at random steps, with random prompt lengths and limits (and random
    shares of a common prefix), on an engine with a random block size, pool, token budget, seat
    count, and prefix caching on or off."""
    block_size = draw(st.sampled_from([1, 2, 3, 5, 16]))
    requests = draw(
        st.lists(
            st.tuples(
                st.integers(0, 5),
                st.integers(1, 24),
                st.integers(1, 12),
                st.sampled_from([0.0, 0.5, 1.0]),
            ),
            min_size=1,
            max_size=6,
        )
    )  # (arrival step, prompt length, max_tokens, share of the prompt from a common prefix)
    requests.sort(key=lambda r: r[0])
    longest = max(length + limit for _, length, limit, _ in requests)
    fewest_blocks = blocks_for(longest, block_size)  # every request must fit alone
    num_blocks = draw(st.integers(fewest_blocks, fewest_blocks + 3))  # tight: preemptions
    budget = draw(st.integers(1, 40))
    max_num_seqs = draw(st.integers(1, 5))
    prefix_caching = draw(st.booleans())
    return block_size, num_blocks, budget, max_num_seqs, prefix_caching, requests


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(stream=request_streams(), seed=st.integers(0, 2**16))
def test_scheduler_invariants_on_random_request_streams(stream, seed, tiny, tiny_greedy):
    """At every step: scheduled tokens <= max_num_batched_tokens, scheduled requests <=
    max_num_seqs, no request computes past its known tokens. Every admitted request finishes
    with transformers' tokens, requests are first scheduled in arrival order (FCFS), and at the
    end every block is back in the pool."""
    block_size, num_blocks, budget, max_num_seqs, prefix_caching, requests = stream
    engine = tiny_engine(
        tiny.path,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=prefix_caching,
    )
    log = ScheduleLog(engine)
    common = random_prompt(24, seed + 100)
    prompts = []
    for i, (_, length, _, share) in enumerate(requests):
        shared = int(share * length)
        prompts.append(common[:shared] + random_prompt(length - shared, seed + i))
    finished = {}
    pending = list(range(len(requests)))
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and requests[pending[0]][0] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, greedy(requests[i][2]))
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.kv_cache_manager.check_integrity()
        step += 1

    assert sum(map(len, log.preempted)) == engine.scheduler.num_preemptions
    for scheduled, running, preempted, admitted in zip(
        log.steps, log.running_sizes, log.preempted, log.admitted, strict=True
    ):
        assert sum(e["new"] for e in scheduled) <= budget
        # A step that preempted is short of blocks: admitting anyone would only thrash.
        assert not (preempted and admitted), f"preempted {preempted} and admitted {admitted}"
        assert len(scheduled) <= max_num_seqs and running <= max_num_seqs
        assert len({e["id"] for e in scheduled}) == len(scheduled)
        assert all(1 <= e["new"] <= e["num_tokens"] - e["computed"] for e in scheduled)

    assert sorted(finished, key=int) == [str(i) for i in range(len(requests))]
    for i, (_, _, limit, _) in enumerate(requests):
        assert finished[str(i)].outputs[0].token_ids == tiny_greedy(prompts[i], limit)
    order = log.first_scheduled_order()
    assert order == sorted(order, key=int), "FCFS: first scheduled in arrival order"
    assert_pool_is_empty(engine)
    assert engine.requests == {}


# --- aborts ------------------------------------------------------------------------------------


def test_aborting_one_sequence_of_n_leaves_its_siblings_running(tiny_dir, tiny_greedy):
    """n=3: sequence 1 is stopped (as chapter 09's front end does when it finds a stop string
    in it): its blocks go back at once, the request lives on until its other sequences end,
    with their usual tokens, and is then forgotten. Unknown ids and indices change nothing."""
    engine = tiny_engine(tiny_dir)
    prompt = random_prompt(6, 20)
    engine.add_request("r", {"prompt_token_ids": prompt}, greedy(8, n=3))
    engine.step()
    engine.step()
    engine.abort_sequences([("r", 1), ("r", 7), ("nobody", 0)])
    assert engine.get_num_unfinished_requests() == 2  # sequences waiting or running
    sequences = engine.requests["r"]
    assert [s.finish_reason for s in sequences] == [None, "abort", None]
    assert "r#1" not in engine.kv_cache_manager.block_tables
    finished = run_to_completion(engine)
    expected = tiny_greedy(prompt, 8)
    assert [c.token_ids for c in finished["r"].outputs][::2] == [expected, expected]
    assert "r" not in engine.requests
    assert_pool_is_empty(engine)
    engine.add_request("s", {"prompt_token_ids": prompt}, greedy(8, n=2))
    engine.step()
    engine.abort_sequences([("s", 0), ("s", 1)])  # its last sequences: the request goes too
    assert "s" not in engine.requests
    run_to_completion(engine)
    assert_pool_is_empty(engine)


def test_abort_while_waiting_mid_prefill_and_mid_decode(tiny_dir, tiny_greedy):
    """Aborting a waiting request, one halfway through its chunked prefill and one decoding
    frees each one's blocks at once; the other requests finish with their normal tokens."""
    engine = tiny_engine(tiny_dir, num_blocks=64, max_num_batched_tokens=8, max_num_seqs=3)
    manager = engine.kv_cache_manager
    prompts = {
        "decoding": random_prompt(5, 10),
        "prefilling": random_prompt(30, 11),
        "keep-1": random_prompt(6, 12),
        "waiting": random_prompt(4, 13),
        "keep-2": random_prompt(9, 14),
    }
    limits = {"decoding": 30, "prefilling": 5, "keep-1": 10, "waiting": 5, "keep-2": 7}

    def add(rid):
        engine.add_request(rid, {"prompt_token_ids": prompts[rid]}, greedy(limits[rid]))

    def abort(rid):
        blocks = len(manager.block_tables.get(f"{rid}#0", []))  # its one sequence's table
        free_before = manager.num_free_blocks
        engine.abort_request(rid)
        assert f"{rid}#0" not in manager.block_tables
        assert manager.num_free_blocks == free_before + blocks

    add("decoding")
    engine.step()
    for rid in ("prefilling", "keep-1", "waiting", "keep-2"):
        add(rid)
    engine.step()
    sequence = {rid: engine.requests[rid][0] for rid in prompts}

    assert sequence["waiting"] in engine.scheduler.waiting
    abort("waiting")
    assert 0 < sequence["prefilling"].num_computed_tokens < len(prompts["prefilling"])
    assert sequence["prefilling"] in engine.scheduler.running
    abort("prefilling")
    engine.step()
    assert len(sequence["decoding"].output_token_ids) >= 2
    assert not sequence["decoding"].is_finished
    abort("decoding")

    seen = set()
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.add(output.request_id)
            if output.finished:
                finished[output.request_id] = output
    assert seen == {"keep-1", "keep-2"} == set(finished)
    for rid in finished:
        assert finished[rid].outputs[0].token_ids == tiny_greedy(prompts[rid], limits[rid])
    assert all(
        sequence[rid].finish_reason == "abort" for rid in ("waiting", "prefilling", "decoding")
    )
    assert_pool_is_empty(engine)
    assert engine.requests == {}


# --- step() outputs and metrics ----------------------------------------------------------------


@pytest.mark.parametrize("budget", [2048, 7])
def test_step_outputs_stream_one_token_at_a_time(budget, tiny_dir, tiny_greedy):
    """Each step returns the requests that got a token: a request appears once its prompt is
    done, then at every step with exactly one more token (earlier tokens and text unchanged),
    and is marked finished only in its last output."""
    engine = tiny_engine(tiny_dir, max_num_batched_tokens=budget)
    prompts = {"a": random_prompt(12, 20), "b": random_prompt(3, 21), "c": random_prompt(20, 22)}
    limits = {"a": 5, "b": 1, "c": 8}
    for rid, prompt in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, greedy(limits[rid]))

    last: dict = {}  # request id -> its previous output
    done = set()
    while engine.has_unfinished_requests():
        outputs = {o.request_id: o for o in engine.step()}
        for rid, output in outputs.items():
            assert rid not in done, "an output after the finished one"
            tokens, text = output.outputs[0].token_ids, output.outputs[0].text
            previous = last.get(rid)
            previous_tokens = [] if previous is None else previous.outputs[0].token_ids
            assert tokens[:-1] == previous_tokens
            if previous is not None:
                assert text.startswith(previous.outputs[0].text)
            assert output.finished == (len(tokens) == limits[rid])
            if output.finished:
                done.add(rid)
            last[rid] = output
        decoding = set(last) - done - set(outputs)
        assert not decoding, f"{decoding} decoding but got no token this step"
    assert done == set(prompts)
    for rid in prompts:
        assert last[rid].outputs[0].token_ids == tiny_greedy(prompts[rid], limits[rid])


def test_metrics_follow_the_engine(tiny_dir):
    """kv_cache_usage is 0 when idle and the share of blocks held while running; running and
    waiting count the queues; the token counters are the sums of prompt and generated tokens."""
    block_size = 4
    engine = tiny_engine(tiny_dir, num_blocks=64, block_size=block_size, max_num_seqs=2)
    idle = metrics(engine)
    assert idle["vllm:kv_cache_usage_perc"] == 0
    assert idle["vllm:num_requests_running"] == idle["vllm:num_requests_waiting"] == 0
    assert idle["vllm:prompt_tokens"] == idle["vllm:generation_tokens"] == 0

    prompts = [random_prompt(n, 30 + n) for n in (6, 13, 2, 9)]
    limits = [4, 2, 6, 3]
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(limit))
    queued = metrics(engine)
    assert (queued["vllm:num_requests_running"], queued["vllm:num_requests_waiting"]) == (0, 4)
    assert queued["vllm:kv_cache_usage_perc"] == 0

    engine.step()  # two seats: requests 0 and 1 prefill and get their first token
    running = metrics(engine)
    assert (running["vllm:num_requests_running"], running["vllm:num_requests_waiting"]) == (2, 2)
    held = blocks_for(len(prompts[0]), block_size) + blocks_for(len(prompts[1]), block_size)
    assert running["vllm:kv_cache_usage_perc"] == pytest.approx(held / 64)
    assert running["vllm:prompt_tokens"] == len(prompts[0]) + len(prompts[1])
    assert running["vllm:generation_tokens"] == 2

    outputs = run_to_completion(engine)
    final = metrics(engine)
    assert final["vllm:kv_cache_usage_perc"] == 0
    assert final["vllm:num_requests_running"] == final["vllm:num_requests_waiting"] == 0
    assert final["vllm:prompt_tokens"] == sum(map(len, prompts))
    assert final["vllm:generation_tokens"] == sum(
        len(o.outputs[0].token_ids) for o in outputs.values()
    )
    assert final["vllm:num_preemptions"] == 0


def test_the_spec_decode_metrics_are_the_counters_and_the_two_rates():
    """Chapter 08's counters under vLLM's names, with the acceptance rate (accepted / draft
    tokens) and the mean accepted length (tokens a verification emits: accepted drafts + 1),
    and one counter per draft position; before any draft, both rates are 0."""
    before = {name: value for name, _, value, _ in spec_decode_metric_rows(SpecDecodeStats())}
    assert before["minivllm:spec_decode_acceptance_rate"] == 0.0
    assert before["minivllm:spec_decode_mean_accepted_length"] == 0.0
    stats = SpecDecodeStats()
    stats.record(3, 2)
    stats.record(2, 0)
    rows = spec_decode_metric_rows(stats)
    assert [(name, kind, value) for name, kind, value, _ in rows] == [
        ("vllm:spec_decode_num_drafts", "counter", 2),
        ("vllm:spec_decode_num_draft_tokens", "counter", 5),
        ("vllm:spec_decode_num_accepted_tokens", "counter", 2),
        ("minivllm:spec_decode_acceptance_rate", "gauge", 0.4),
        ("minivllm:spec_decode_mean_accepted_length", "gauge", 2.0),
        ('vllm:spec_decode_num_accepted_tokens_per_pos{position="0"}', "counter", 1),
        ('vllm:spec_decode_num_accepted_tokens_per_pos{position="1"}', "counter", 1),
        ('vllm:spec_decode_num_accepted_tokens_per_pos{position="2"}', "counter", 0),
    ]
    assert all(description for *_, description in rows)


# --- bad input at the engine level -------------------------------------------------------------


def test_prompt_longer_than_the_pool_is_refused_and_others_continue(tiny_dir, tiny_greedy):
    """A pool of 6 four-token blocks holds 24 tokens: a longer prompt (or prompt + max_tokens)
    could never run, so it is refused naming the limit, while running requests carry on."""
    engine = tiny_engine(tiny_dir, num_blocks=6, block_size=4)
    assert engine.max_model_len == 24
    running_prompt = random_prompt(10, 40)
    engine.add_request("running", {"prompt_token_ids": running_prompt}, greedy(6))
    engine.step()

    with pytest.raises(ValueError, match=r"\b24\b"):
        engine.add_request("too-long", {"prompt_token_ids": random_prompt(30, 41)}, greedy(2))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("too-long", {"prompt_token_ids": random_prompt(20, 42)}, greedy(5))
    assert "too-long" not in engine.requests

    later_prompt = random_prompt(8, 43)
    engine.add_request("later", {"prompt_token_ids": later_prompt}, greedy(4))
    finished = run_to_completion(engine)
    assert set(finished) == {"running", "later"}
    assert finished["running"].outputs[0].token_ids == tiny_greedy(running_prompt, 6)
    assert finished["later"].outputs[0].token_ids == tiny_greedy(later_prompt, 4)
    assert_pool_is_empty(engine)


def test_duplicate_request_id_is_refused(tiny_dir, tiny_greedy):
    """A request id in use is refused (the first request is untouched and finishes normally);
    once that request has finished, its id may be used again."""
    engine = tiny_engine(tiny_dir)
    first, second = random_prompt(7, 50), random_prompt(5, 51)
    engine.add_request("same", {"prompt_token_ids": first}, greedy(4))
    engine.step()
    with pytest.raises(ValueError, match="same"):
        engine.add_request("same", {"prompt_token_ids": second}, greedy(4))
    engine.add_request("other", {"prompt_token_ids": second}, greedy(3))
    finished = run_to_completion(engine)
    assert finished["same"].outputs[0].token_ids == tiny_greedy(first, 4)
    assert finished["other"].outputs[0].token_ids == tiny_greedy(second, 3)

    engine.add_request("same", {"prompt_token_ids": second}, greedy(4))
    assert run_to_completion(engine)["same"].outputs[0].token_ids == tiny_greedy(second, 4)
    assert_pool_is_empty(engine)


def test_any_string_is_a_request_id_with_n_completions(tiny_dir):
    """Request ids are the caller's strings: one containing '#' works with n > 1 too."""
    engine = tiny_engine(tiny_dir)
    engine.add_request("chat#7", {"prompt_token_ids": random_prompt(6, 60)}, greedy(3, n=2))
    finished = run_to_completion(engine)
    assert [len(c.token_ids) for c in finished["chat#7"].outputs] == [3, 3]
    assert_pool_is_empty(engine)


def test_request_ids_never_collide_with_sequence_ids(tiny_dir, tiny_greedy):
    """A request 'x' with n=2 and a request named 'x#0' are separate requests: the second is
    refused or both get their own tokens."""
    engine = tiny_engine(tiny_dir)
    x_prompt, other_prompt = random_prompt(20, 70), random_prompt(10, 71)
    engine.add_request("x", {"prompt_token_ids": x_prompt}, greedy(5, n=2))
    engine.step()
    try:
        engine.add_request("x#0", {"prompt_token_ids": other_prompt}, greedy(5))
    except ValueError:
        return
    finished = run_to_completion(engine)
    assert [c.token_ids for c in finished["x"].outputs] == [tiny_greedy(x_prompt, 5)] * 2
    assert finished["x#0"].outputs[0].token_ids == tiny_greedy(other_prompt, 5)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_the_engine_config_reaches_the_block_manager_and_the_scheduler(
    tiny_dir, enable_prefix_caching
):
    """Prefix caching is on exactly when the config says so; without speculative decoding
    the scheduler reserves no lookahead slot and expects no sampled drafts."""
    engine = tiny_engine(tiny_dir, enable_prefix_caching=enable_prefix_caching)
    assert (engine.kv_cache_manager.prefix_cache is not None) is enable_prefix_caching
    assert engine.scheduler.config.num_lookahead_tokens == 0
    assert engine.scheduler.config.drafts_are_sampled is False


@pytest.mark.parametrize(
    "speculative_config, lookahead, drafts_are_sampled",
    [
        ({"method": "ngram", "num_speculative_tokens": 2}, 0, False),
        ({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}, 2, True),
        ({"method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": 3}, 3, True),
    ],
    ids=["ngram", "draft_model", "layer_skip"],
)
def test_the_speculative_config_reaches_the_scheduler(
    tiny_dir, speculative_config, lookahead, drafts_are_sampled
):
    """Chapter 08: a draft model (a model of its own, or the target's first layers) writes the
    K/V of its guesses past the grant and draws them from its own q, which the scheduler must
    know (it keeps a sampled draft the grammar forbids, for the verifier to reject); an n-gram
    lookup does neither."""
    if speculative_config.get("model") == "tiny":
        speculative_config = speculative_config | {"model": str(tiny_dir)}
    config = EngineConfig(
        model=str(tiny_dir),
        dtype="float32",
        device="cpu",
        kv_cache_memory_bytes=pool_bytes(tiny_dir, 64, 4),
        speculative_config=speculative_config,
    )
    engine = LLMEngine(config)  # its pool is shared with the draft's K/V
    assert engine.scheduler.config.num_lookahead_tokens == lookahead
    assert engine.scheduler.config.drafts_are_sampled is drafts_are_sampled


def test_the_models_own_eos_ids_stop_a_request_as_the_tokenizers_does(
    tiny_dir, tmp_path, tiny_greedy
):
    """A model's config may name EOS ids its tokenizer does not (Llama 3's lists three): each
    ends a request with "stop". The tiny model's config is given a second EOS, the token its
    greedy continuation reaches fourth; the engine stops there, transformers' tokens up to it."""
    prompt = random_prompt(5, 7)
    plain = tiny_greedy(prompt, 12)
    position = next(i for i, token in enumerate(plain) if i >= 3 and token not in plain[:i])
    model_dir = tmp_path / "two_eos"
    model_dir.mkdir()
    for path in tiny_dir.iterdir():
        (model_dir / path.name).symlink_to(path)
    config = json.loads((tiny_dir / "config.json").read_text())
    (model_dir / "config.json").unlink()
    extra_eos = plain[position]
    config["eos_token_id"] = [extra_eos, EOS_TOKEN_ID]
    (model_dir / "config.json").write_text(json.dumps(config))

    engine = tiny_engine(model_dir)
    engine.add_request("r", {"prompt_token_ids": prompt}, greedy(12))
    output = run_to_completion(engine)["r"].outputs[0]

    assert extra_eos != EOS_TOKEN_ID and EOS_TOKEN_ID not in plain[: position + 1]
    assert output.token_ids == plain[: position + 1]
    assert output.finish_reason == "stop"
