"""Chapter 05 checks: prefix caching changes how much is computed, never what comes out.

A cache hit hands a request K/V that another request computed. That is only right if the hit
block holds exactly the request's own tokens, at the same positions, after the same prefix, with
the same salt. So the checks are of two kinds:

- end to end, the feature switched off is the oracle for the feature switched on (and
  transformers' greedy `generate` for each prompt alone is the oracle for both): shared
  prefixes, whole-prompt hits, prompts that differ in one token, preemption, chunked prefill
  and cache salts give the same tokens, and `num_cached_tokens` is exactly what the rule says;
- on the block manager itself, over random request streams: ref counts, the free queue and the
  hash maps stay consistent, a hit always lands on a block that holds the request's own
  prefix, and eviction takes the least recently freed block first, a sequence's tail first.

End-to-end checks run the tiny *mistral* model: its untied output head makes its greedy tokens
depend on the whole context, so K/V from the wrong block would change the output. (The tiny
models with tied embeddings echo their last input token whatever the cache holds.)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch
from conftest import ENGINE_TEST_FAMILY, EOS_TOKEN_ID, assert_pool_is_empty
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.prefix_cache import hash_block, hash_blocks
from minivllm.engine.llm_engine import LLMEngine
from minivllm.tokenizer import apply_chat_template

FAMILY = ENGINE_TEST_FAMILY
VOCAB_SIZE = 49152  # the embedded tokenizer's, shared by the tiny models
BLOCK_SIZE = 4


# --- helpers -----------------------------------------------------------------------------------


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist()


def pool_bytes(model_dir, num_blocks: int, block_size: int) -> int:
    """The kv_cache_memory_bytes that hold exactly `num_blocks` blocks (float32 K and V)."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    return num_blocks * block_size * per_token


def tiny_llm(model_dir, *, num_blocks=256, block_size=BLOCK_SIZE, **kwargs) -> LLM:
    """The offline API on the tiny model, float32 on the CPU, with exactly `num_blocks` blocks."""
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=block_size,
        kv_cache_memory_bytes=pool_bytes(model_dir, num_blocks, block_size),
        **kwargs,
    )
    assert llm.llm_engine.kv_cache_manager.num_blocks == num_blocks
    return llm


def tiny_engine(model_dir, *, num_blocks=256, block_size=BLOCK_SIZE, **kwargs) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            block_size=block_size,
            kv_cache_memory_bytes=pool_bytes(model_dir, num_blocks, block_size),
            **kwargs,
        )
    )
    assert engine.kv_cache_manager.num_blocks == num_blocks
    return engine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def token_prompts(prompts, salt: str | None = None) -> list[dict]:
    if salt is None:
        return [{"prompt_token_ids": p} for p in prompts]
    return [{"prompt_token_ids": p, "cache_salt": salt} for p in prompts]


def generate(llm: LLM, prompts, max_tokens: int, salt: str | None = None):
    return llm.generate(token_prompts(prompts, salt), greedy(max_tokens), use_tqdm=False)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def metrics(llm_or_engine) -> dict[str, float]:
    return {m.name: m.value for m in llm_or_engine.get_metrics()}


def computed_tokens(output) -> list[int]:
    """Tokens whose K/V a finished request wrote: its prompt and all but its last output token
    (the last sampled token is never fed back)."""
    return list(output.prompt_token_ids) + output.outputs[0].token_ids[:-1]


def expected_cached_tokens(prompt: list[int], earlier: list[list[int]], block_size: int) -> int:
    """The rule, from first principles: the longest run of whole blocks that some earlier
    request computed with exactly these tokens, leaving at least the last prompt token to
    compute (its logits give the first new token)."""
    limit = (len(prompt) - 1) // block_size
    best = 0
    for sequence in earlier:
        n = 0
        while (
            n < limit
            and (n + 1) * block_size <= len(sequence)
            and sequence[: (n + 1) * block_size] == prompt[: (n + 1) * block_size]
        ):
            n += 1
        best = max(best, n)
    return best * block_size


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dirs):
    return tiny_model_dirs[FAMILY]


def assert_equals_transformers(outputs, prompts, max_tokens: int, tiny_greedy) -> None:
    for i, (output, prompt) in enumerate(zip(outputs, prompts, strict=True)):
        assert output.outputs[0].token_ids == tiny_greedy(prompt, max_tokens), f"prompt {i}"


SHARED_PREFIX = random_prompt(22, seed=500)  # five full 4-token blocks and two tokens more


def shared_prefix_prompts(suffix_lengths, seed: int) -> list[list[int]]:
    return [SHARED_PREFIX + random_prompt(n, seed + i) for i, n in enumerate(suffix_lengths)]


# --- the hash chain ----------------------------------------------------------------------------

tokens_strategy = st.lists(st.integers(0, 3), max_size=40)  # a tiny alphabet: equal blocks abound
salts = st.one_of(st.none(), st.text(min_size=1, max_size=3))


@given(tokens=tokens_strategy, block_size=st.integers(1, 6), salt=salts)
def test_hash_blocks_is_the_chain_of_hash_block(tokens, block_size, salt):
    """hash_blocks names each full block by hash_block(parent's hash, its tokens), the salt
    entering the first block; a partial last block has no name; hashing can resume mid-chain."""
    hashes = hash_blocks(tokens, block_size, salt)
    by_hand, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = (salt,) if start == 0 and salt is not None else ()
        parent = hash_block(parent, tuple(tokens[start : start + block_size]), extra)
        by_hand.append(parent)
    assert hashes == by_hand
    assert len(hashes) == len(tokens) // block_size
    for k in range(1, len(hashes)):
        resumed = hash_blocks(tokens, block_size, salt, parent=hashes[k - 1], start_block=k)
        assert resumed == hashes[k:]


@given(a=tokens_strategy, b=tokens_strategy, block_size=st.integers(1, 4), salt=salts)
def test_equal_hashes_iff_equal_prefixes(a, b, block_size, salt):
    """Block i of two token lists has the same hash iff the lists agree on *all* tokens up to
    the end of block i: a different earlier block changes every later hash, even when the later
    blocks themselves are equal."""
    hashes_a = hash_blocks(a, block_size, salt)
    hashes_b = hash_blocks(b, block_size, salt)
    for i in range(min(len(hashes_a), len(hashes_b))):
        end = (i + 1) * block_size
        assert (hashes_a[i] == hashes_b[i]) == (a[:end] == b[:end]), f"block {i}"


def test_equal_later_block_after_a_different_prefix_hashes_differently():
    """[1 2][7 7] and [1 3][7 7]: the second blocks are equal, their hashes are not."""
    first, second = hash_blocks([1, 2, 7, 7], 2), hash_blocks([1, 3, 7, 7], 2)
    assert first[0] != second[0] and first[1] != second[1]


@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30),
    block_size=st.integers(1, 5),
    salts_pair=st.lists(salts, min_size=2, max_size=2, unique=True),
)
def test_the_salt_changes_every_hash(tokens, block_size, salts_pair):
    """Two different salts (or a salt and none) give the same tokens different hashes in every
    block, not just the first."""
    first = hash_blocks(tokens, block_size, salts_pair[0])
    second = hash_blocks(tokens, block_size, salts_pair[1])
    assert all(x != y for x, y in zip(first, second, strict=True))
    assert not set(first) & set(second)


# --- the block manager, step by step -----------------------------------------------------------


@dataclass
class FakeRequest:
    """What KVCacheManager reads of a request."""

    request_id: str
    tokens: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def computed(manager: KVCacheManager, request: FakeRequest, num_tokens: int) -> None:
    """Pretend the model wrote K/V up to `num_tokens`, and name the blocks that became full."""
    request.num_computed_tokens = num_tokens
    manager.cache_full_blocks(request)


def admit(manager: KVCacheManager, request: FakeRequest, num_tokens: int | None = None) -> bool:
    """What the scheduler does for a waiting request: share its cached blocks, allocate the rest."""
    cached = manager.find_cached_blocks(request)
    total = request.num_tokens if num_tokens is None else num_tokens
    if not manager.allocate_slots(request.request_id, total, cached):
        return False
    request.num_computed_tokens = len(cached) * manager.block_size
    return True


def run_request(manager: KVCacheManager, request: FakeRequest) -> list[int]:
    """Admit a request and compute all its tokens; its block table."""
    assert admit(manager, request)
    computed(manager, request, request.num_tokens)
    return list(manager.block_tables[request.request_id])


def free_queue(manager: KVCacheManager) -> list[int]:
    return list(manager.pool.free_queue)


def test_eviction_takes_the_least_recently_freed_first_tail_first():
    """Free A (blocks a0 a1 a2), then B: new blocks come from A before B, and within A from its
    tail: a2, then a1, then a0. An evicted block's hash no longer finds it; its parents still do."""
    manager = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a = FakeRequest("a", [1, 2, 3, 4, 5, 6])
    b = FakeRequest("b", [7, 8, 9, 10, 11, 12])
    a_blocks, b_blocks = run_request(manager, a), run_request(manager, b)
    assert manager.num_free_blocks == 0
    manager.free("a")
    manager.free("b")
    assert free_queue(manager) == a_blocks[::-1] + b_blocks[::-1]

    a_again = FakeRequest("a-again", a.tokens + [0])  # may reuse all three of A's blocks
    assert manager.find_cached_blocks(a_again) == a_blocks

    taken = []
    for n in range(1, 7):
        assert manager.allocate_slots("c", 2 * n)
        taken.append(manager.block_tables["c"][-1])
        if n <= 3:  # A's blocks are evicted from the tail: its head stays findable
            assert manager.find_cached_blocks(a_again) == a_blocks[: 3 - n]
    assert taken == a_blocks[::-1] + b_blocks[::-1]
    assert manager.find_cached_blocks(FakeRequest("b-again", b.tokens + [0])) == []
    assert not manager.prefix_cache.block_of_hash and not manager.prefix_cache.hash_of_block


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    """Reusing a cached block that nobody holds takes it out of the free queue: the blocks it
    would have been evicted with are handed out instead, never it, while it is in use."""
    manager = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a = FakeRequest("a", [1, 2, 3, 4, 5, 6])
    a_blocks = run_request(manager, a)
    manager.free("a")
    assert manager.num_free_blocks == 6

    again = FakeRequest("again", [1, 2, 3, 4, 9])  # shares a0 and a1, not a2
    assert admit(manager, again)
    assert manager.block_tables["again"][:2] == a_blocks[:2]
    assert again.num_computed_tokens == 4
    assert [manager.pool.ref_counts[block] for block in a_blocks[:2]] == [1, 1]
    assert not set(a_blocks[:2]) & set(free_queue(manager))
    assert manager.num_free_blocks == 3  # 6 - a0 - a1 - one new block for token 9

    assert manager.allocate_slots("other", 6)  # everything left: a2 is evicted, a0 a1 are not
    assert not set(manager.block_tables["other"]) & set(a_blocks[:2])
    assert manager.find_cached_blocks(FakeRequest("probe", a.tokens + [0])) == a_blocks[:2]
    assert not manager.allocate_slots("other", 8)


def test_a_block_shared_by_two_requests_is_free_only_when_both_are_done():
    """Two live requests on one cached prefix: its blocks have ref count 2, stay out of the free
    queue when one finishes, and return to it (still cached) when the other does."""
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    first = FakeRequest("first", [1, 2, 3, 4, 5])
    run_request(manager, first)
    second = FakeRequest("second", [1, 2, 3, 4, 6])
    assert admit(manager, second)
    shared = manager.block_tables["second"][:2]
    assert shared == manager.block_tables["first"][:2]
    assert [manager.pool.ref_counts[b] for b in shared] == [2, 2]
    manager.free("first")
    assert [manager.pool.ref_counts[b] for b in shared] == [1, 1]
    assert not set(shared) & set(free_queue(manager))
    manager.free("second")
    assert set(shared) <= set(free_queue(manager))
    assert manager.find_cached_blocks(FakeRequest("third", [1, 2, 3, 4, 7])) == shared
    assert manager.num_free_blocks == manager.num_blocks


def test_each_full_block_is_hashed_once_while_a_request_runs(monkeypatch):
    """A request computing one token a step for 10 steps fills 5 blocks of 2: each is hashed
    once, when it fills (a step hashes only the blocks that just filled), and each is named."""
    import minivllm.core.prefix_cache as prefix_cache

    hashed = []
    original = prefix_cache.hash_block

    def counting_hash_block(parent, token_ids, extra_keys=()):
        hashed.append(tuple(token_ids))
        return original(parent, token_ids, extra_keys)

    monkeypatch.setattr(prefix_cache, "hash_block", counting_hash_block)
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    request = FakeRequest("a", list(range(1, 11)))
    assert manager.allocate_slots("a", 10)
    for num_tokens in range(1, 11):
        computed(manager, request, num_tokens)
    assert hashed == [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10)]
    assert sorted(manager.prefix_cache.hash_of_block) == sorted(manager.block_tables["a"])


def test_with_caching_off_nothing_is_found_or_named():
    """enable_prefix_caching=False: no lookups hit, no block gets a name."""
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    run_request(manager, FakeRequest("a", [1, 2, 3, 4, 5]))
    manager.free("a")
    assert manager.prefix_cache is None
    assert manager.find_cached_blocks(FakeRequest("b", [1, 2, 3, 4, 5])) == []


PREFIXES = ([5, 5, 5, 5, 5, 5, 5, 5], [5, 6, 7, 8, 9, 10, 11, 12], [6, 5, 6, 5, 6, 5, 6, 5])


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random streams of requests with shared prefixes, admitted with their cache hits,
    computed chunk by chunk, grown, preempted and finished, on a small pool that keeps evicting.

    Alongside the manager the machine keeps what each block really holds: once a block is full
    of computed tokens, the salt and the whole token prefix up to its end. A hit is right only
    if the block holds exactly the request's own prefix.
    """

    @initialize(num_blocks=st.integers(2, 12), block_size=st.integers(1, 4))
    def setup(self, num_blocks, block_size):
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
        self.block_size = block_size
        self.live: dict[str, FakeRequest] = {}
        self.content: dict[int, tuple | None] = {}  # block -> (salt, prefix tokens) once full
        self.counter = 0

    # -- what a block holds --

    def identity(self, request: FakeRequest, block_index: int) -> tuple:
        end = (block_index + 1) * self.block_size
        return (request.cache_salt, tuple(request.tokens[:end]))

    def cached_identities(self) -> dict[tuple, int]:
        return {self.content.get(b): b for b in self.manager.prefix_cache.hash_of_block}

    def snapshot(self):
        manager = self.manager
        return (
            list(manager.pool.ref_counts),
            list(manager.pool.free_queue),
            {rid: list(table) for rid, table in manager.block_tables.items()},
            dict(manager.prefix_cache.block_of_hash),
            dict(manager.prefix_cache.hash_of_block),
        )

    def allocate(self, request: FakeRequest, total: int, cached: list[int]) -> bool:
        """allocate_slots, checked: on failure nothing changed; on success the new blocks are
        the head of the free queue (least recently freed first) and carry no stale name."""
        before = self.snapshot()
        queue = [b for b in before[1] if b not in cached]
        had = len(self.manager.block_tables.get(request.request_id, []))
        if not self.manager.allocate_slots(request.request_id, total, cached):
            assert self.snapshot() == before, "a failed allocate_slots changed the state"
            needed = math.ceil(total / self.block_size) - had - len(cached)
            revived = sum(1 for b in cached if before[0][b] == 0)
            assert needed + revived > len(before[1]), "refused although the blocks were free"
            return False
        table = self.manager.block_tables[request.request_id]
        assert len(table) == max(math.ceil(total / self.block_size), had + len(cached))
        fresh = table[had + len(cached) :]
        assert fresh == queue[: len(fresh)], "new blocks must come from the free queue's head"
        for block in fresh:
            assert not self.manager.prefix_cache.is_cached(block), "evicted block kept its hash"
            self.content[block] = None  # about to be overwritten
        return True

    def compute(self, request: FakeRequest, total: int) -> None:
        """The model writes K/V of tokens num_computed..total-1, then full blocks are named."""
        table = self.manager.block_tables[request.request_id]
        start = request.num_computed_tokens
        for block_index in range(start // self.block_size, math.ceil(total / self.block_size)):
            block = table[block_index]
            assert self.manager.pool.ref_counts[block] == 1, "writing into a shared block"
            full = (block_index + 1) * self.block_size <= total
            self.content[block] = self.identity(request, block_index) if full else None
        computed(self.manager, request, total)
        known = self.cached_identities()
        for block_index in range(start // self.block_size, total // self.block_size):
            assert self.identity(request, block_index) in known, "a new full block was not named"

    # -- rules --

    @rule(
        prefix=st.sampled_from(PREFIXES),
        prefix_len=st.integers(0, 8),
        suffix=st.lists(st.integers(0, 2), max_size=8),
        salt=st.sampled_from([None, None, "a"]),
        chunk=st.integers(1, 12),
    )
    def admit(self, prefix, prefix_len, suffix, salt, chunk):
        tokens = prefix[:prefix_len] + suffix or [0]
        request = FakeRequest(f"r{self.counter}", tokens, salt)
        self.counter += 1
        cached = self.manager.find_cached_blocks(request)

        # The hit is the longest run of blocks that hold exactly this prefix, and never the
        # block of the last token.
        known = self.cached_identities()
        expected = 0
        while expected < (len(tokens) - 1) // self.block_size:
            if self.identity(request, expected) not in known:
                break
            expected += 1
        assert len(cached) == expected
        for block_index, block in enumerate(cached):
            assert self.content[block] == self.identity(request, block_index)

        num_cached = len(cached) * self.block_size
        total = min(num_cached + chunk, len(tokens))
        if self.allocate(request, total, cached):
            assert self.manager.block_tables[request.request_id][: len(cached)] == cached
            request.num_computed_tokens = num_cached
            self.live[request.request_id] = request
            self.compute(request, total)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def step(self, data, chunk):
        """A running request gets its next chunk (or, after a decode, its new token) computed;
        if the pool has no room, it is preempted."""
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if request.num_computed_tokens == request.num_tokens:
            request.tokens.append(data.draw(st.integers(0, 2)))  # sampled: one more token
        total = min(request.num_computed_tokens + chunk, request.num_tokens)
        if self.allocate(request, total, []):
            self.compute(request, total)
        else:
            self.finish_request(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        """A request finishes or is aborted."""
        self.finish_request(self.live[data.draw(st.sampled_from(sorted(self.live)))])

    def finish_request(self, request: FakeRequest) -> None:
        before = self.snapshot()
        table = self.manager.block_tables[request.request_id]
        self.manager.free(request.request_id)
        del self.live[request.request_id]
        released = [b for b in reversed(table) if self.manager.pool.ref_counts[b] == 0]
        assert free_queue(self.manager) == before[1] + released, "freed blocks go last, tail first"
        assert self.manager.prefix_cache.block_of_hash == before[3], "freeing forgets no name"

    # -- invariants --

    @invariant()
    def ref_counts_are_the_number_of_tables_holding_a_block(self):
        manager = self.manager
        assert set(manager.block_tables) == set(self.live)
        holders = [0] * manager.num_blocks
        for table in manager.block_tables.values():
            assert len(set(table)) == len(table), "a block twice in one table"
            for block in table:
                holders[block] += 1
        assert manager.pool.ref_counts == holders

    @invariant()
    def a_block_is_free_iff_nobody_holds_it(self):
        pool = self.manager.pool
        free = set(pool.free_queue)
        assert free == {b for b in range(pool.num_blocks) if pool.ref_counts[b] == 0}
        used = sum(1 for count in pool.ref_counts if count > 0)
        assert pool.num_free_blocks + used == pool.num_blocks

    @invariant()
    def one_hash_one_block(self):
        cache = self.manager.prefix_cache
        assert len(cache.block_of_hash) == len(cache.hash_of_block)
        assert all(cache.hash_of_block[b] == h for h, b in cache.block_of_hash.items())
        assert all(cache.block_of_hash[h] == b for b, h in cache.hash_of_block.items())

    @invariant()
    def the_managers_own_integrity_check_agrees(self):
        self.manager.check_integrity()  # raises if the package's conservation laws disagree

    @invariant()
    def a_named_block_holds_what_its_name_says(self):
        cache = self.manager.prefix_cache
        identities = []
        for block, block_hash in cache.hash_of_block.items():
            identity = self.content.get(block)
            assert identity is not None, "a block is named before it is full of computed tokens"
            salt, tokens = identity
            assert hash_blocks(list(tokens), self.block_size, salt)[-1] == block_hash
            identities.append(identity)
        assert len(set(identities)) == len(identities), "one prefix cached in two blocks"

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        for request in list(self.live.values()):
            self.finish_request(request)
        assert self.manager.num_free_blocks == self.manager.num_blocks
        assert all(count == 0 for count in self.manager.pool.ref_counts)


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase


# --- end to end: caching on == caching off == transformers -------------------------------------


def test_shared_prefix_round_twice_hits_and_keeps_tokens(tiny_dir, tiny_greedy):
    """A 22-token shared prefix with short distinct suffixes, run twice: the first round equals
    caching off; in the second every prompt finds what the rule says (its own and its siblings'
    computed blocks, including generated tokens), and the tokens do not change."""
    first_round = shared_prefix_prompts([1, 2, 3, 5, 6], seed=510)
    second_round = first_round[::-1] + shared_prefix_prompts([2, 4, 7], seed=520)
    llm, off = tiny_llm(tiny_dir), tiny_llm(tiny_dir, enable_prefix_caching=False)

    first = generate(llm, first_round, 8)
    assert token_ids(first) == token_ids(generate(off, first_round, 8))
    assert_equals_transformers(first, first_round, 8, tiny_greedy)

    second = generate(llm, second_round, 8)
    assert_equals_transformers(second, second_round, 8, tiny_greedy)
    assert token_ids(second) == token_ids(generate(off, second_round, 8))
    earlier = [computed_tokens(o) for o in first]
    for prompt, output in zip(second_round, second):
        assert output.num_cached_tokens == expected_cached_tokens(prompt, earlier, BLOCK_SIZE)
        assert output.num_cached_tokens >= 20  # at least the prefix's five full blocks
    assert all(o.num_cached_tokens == 0 for o in generate(off, second_round, 1))
    assert_pool_is_empty(llm.llm_engine)


def test_a_follow_up_turn_finds_the_blocks_of_the_reply(tiny_dir, tiny_greedy):
    """A follow-up prompt that resends the first prompt and its reply finds the reply's blocks
    too (generated tokens are cached as they are computed), and gets transformers' tokens."""
    first_prompt = random_prompt(10, seed=550)
    llm = tiny_llm(tiny_dir)
    first = generate(llm, [first_prompt], 12)[0]
    assert len(first.outputs[0].token_ids) == 12
    follow_up = first_prompt + first.outputs[0].token_ids + random_prompt(3, seed=551)
    second = generate(llm, [follow_up], 8)[0]
    assert second.num_cached_tokens == expected_cached_tokens(
        follow_up, [computed_tokens(first)], BLOCK_SIZE
    )
    assert second.num_cached_tokens == 20  # 10 prompt tokens and 10 of the reply
    assert second.outputs[0].token_ids == tiny_greedy(follow_up, 8)


def test_reset_prefix_cache_forgets_every_prefix_but_not_while_blocks_are_held(tiny_dir):
    """After `reset_prefix_cache()` the same prompt finds nothing; while a request holds blocks
    the reset is refused and nothing is forgotten."""
    prompt = random_prompt(3 * BLOCK_SIZE + 2, seed=560)
    llm = tiny_llm(tiny_dir)
    generate(llm, [prompt], 2)
    assert generate(llm, [prompt], 1)[0].num_cached_tokens == 3 * BLOCK_SIZE
    engine = llm.llm_engine
    engine.add_request("holder", {"prompt_token_ids": prompt}, greedy(4))
    engine.step()  # "holder" holds blocks now
    named = dict(engine.kv_cache_manager.prefix_cache.block_of_hash)
    assert llm.reset_prefix_cache() is False
    assert engine.kv_cache_manager.prefix_cache.block_of_hash == named
    engine.abort_request("holder")

    assert llm.reset_prefix_cache() is True
    assert generate(llm, [prompt], 1)[0].num_cached_tokens == 0
    assert_pool_is_empty(engine)


@pytest.mark.parametrize("length", [1, 4, 7, 16, 17])
def test_whole_prompt_hit_recomputes_the_last_token(length, tiny_dir, tiny_greedy):
    """The same prompt twice: the second time every full block is cached except that at least
    the last prompt token is computed again (its logits give the first token), so a 16-token
    prompt finds 12 tokens with 4-token blocks, a 17-token prompt 16."""
    prompt = random_prompt(length, seed=600 + length)
    llm = tiny_llm(tiny_dir)
    first = generate(llm, [prompt], 6)[0]
    again = generate(llm, [prompt], 6)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (length - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == tiny_greedy(prompt, 6)


def test_prompts_that_differ_in_the_last_token_of_a_block(tiny_dir, tiny_greedy):
    """Prompts equal to a cached 20-token prompt except for the last token of block i reuse
    exactly the blocks before i, and get transformers' tokens for their own prompt."""
    base = random_prompt(20, seed=700)
    variants = []
    for index in (3, 7, 11, 15, 19):  # the last token of blocks 0..4
        variant = list(base)
        variant[index] = 3 + (variant[index] + 1) % (VOCAB_SIZE - 3)
        variants.append(variant)
    llm = tiny_llm(tiny_dir)
    first = generate(llm, [base], 8)[0]
    outputs = generate(llm, variants, 8)
    assert [o.num_cached_tokens for o in outputs] == [0, 4, 8, 12, 16]
    for variant, output in zip(variants, outputs):
        assert output.num_cached_tokens == expected_cached_tokens(
            variant, [computed_tokens(first)], BLOCK_SIZE
        )
    assert_equals_transformers(outputs, variants, 8, tiny_greedy)
    off = tiny_llm(tiny_dir, enable_prefix_caching=False)
    assert token_ids(outputs) == token_ids(generate(off, variants, 8))


def test_preemption_with_caching_gives_the_same_tokens(tiny_dir, tiny_greedy):
    """A pool of 16 four-token blocks cannot hold six shared-prefix requests: requests are
    preempted, their blocks freed (cached) and evicted or found again on recompute, and the
    tokens equal caching off's and transformers'."""
    prompts = shared_prefix_prompts([3, 6, 1, 8, 2, 5], seed=800)
    llm = tiny_llm(tiny_dir, num_blocks=16)
    outputs = generate(llm, prompts, 16)
    assert metrics(llm)["vllm:num_preemptions"] > 0
    assert metrics(llm)["vllm:prefix_cache_hits"] > 0
    off = tiny_llm(tiny_dir, num_blocks=16, enable_prefix_caching=False)
    assert token_ids(outputs) == token_ids(generate(off, prompts, 16))
    assert_equals_transformers(outputs, prompts, 16, tiny_greedy)
    assert_pool_is_empty(llm.llm_engine)


def test_chunked_prefill_with_caching_gives_the_same_tokens(tiny_dir, tiny_greedy):
    """With a 5-token budget the first prompt's prefix is computed chunk by chunk; requests
    admitted later find its blocks, and the tokens equal caching off's and transformers'."""
    prompts = shared_prefix_prompts([2, 5, 3, 1], seed=900)
    llm = tiny_llm(tiny_dir, max_num_batched_tokens=5)
    outputs = generate(llm, prompts, 8)
    assert metrics(llm)["vllm:prefix_cache_hits"] > 0
    assert max(o.num_cached_tokens for o in outputs) >= 20
    off = tiny_llm(tiny_dir, max_num_batched_tokens=5, enable_prefix_caching=False)
    assert token_ids(outputs) == token_ids(generate(off, prompts, 8))
    assert_equals_transformers(outputs, prompts, 8, tiny_greedy)
    assert_pool_is_empty(llm.llm_engine)


def test_different_cache_salts_never_share_blocks(tiny_dir, tiny_greedy):
    """A prompt cached under salt "a" is found again under "a" only: salt "b" and no salt find
    nothing, and the tokens are the same under every salt."""
    prompt = random_prompt(18, seed=1000)
    expected = tiny_greedy(prompt, 6)
    llm = tiny_llm(tiny_dir)
    runs = [("a", 0), ("b", 0), (None, 0), ("a", 16), ("b", 16), (None, 16)]
    for salt, cached in runs:
        output = generate(llm, [prompt], 6, salt=salt)[0]
        assert output.num_cached_tokens == cached, f"salt {salt!r}"
        assert output.outputs[0].token_ids == expected, f"salt {salt!r}"

    # In one batch, a later request with another salt cannot reuse the first one's blocks.
    llm = tiny_llm(tiny_dir, max_num_batched_tokens=18)  # one prompt per step
    salted = llm.generate(
        [{"prompt_token_ids": prompt, "cache_salt": s} for s in ("x", "y", "x")],
        greedy(6),
        use_tqdm=False,
    )
    assert [o.num_cached_tokens for o in salted] == [0, 0, 16]
    assert token_ids(salted) == [expected] * 3


def test_prefix_cache_metrics_agree_with_the_requests(tiny_dir):
    """prefix_cache_queries is the prompt tokens looked up, prefix_cache_hits the sum of the
    requests' num_cached_tokens, hit_rate their ratio; with caching off nothing is looked up."""
    rounds = [shared_prefix_prompts([1, 4], seed=1100), shared_prefix_prompts([3, 2, 6], 1110)]
    for enabled in (True, False):
        llm = tiny_llm(tiny_dir, enable_prefix_caching=enabled)
        outputs = [o for prompts in rounds for o in generate(llm, prompts, 4)]
        found = metrics(llm)
        cached = sum(o.num_cached_tokens for o in outputs)
        assert found["vllm:prefix_cache_hits"] == cached
        if enabled:
            assert cached > 0
            assert found["vllm:prefix_cache_queries"] == sum(len(p) for r in rounds for p in r)
            assert found["minivllm:prefix_cache_hit_rate"] == pytest.approx(
                cached / found["vllm:prefix_cache_queries"]
            )
        else:
            assert cached == 0 and found["minivllm:prefix_cache_hit_rate"] == 0
            assert found["vllm:prefix_cache_queries"] == 0


def test_last_step_hit_rate_counts_the_requests_admitted_in_that_step(tiny_dir):
    """minivllm:prefix_cache_hit_rate_last_step is hits / queries of the step's admissions."""
    engine = tiny_engine(tiny_dir)
    prompts = shared_prefix_prompts([1, 3], seed=1200)
    engine.add_request("warm", {"prompt_token_ids": prompts[0]}, greedy(2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("hit", {"prompt_token_ids": prompts[1]}, greedy(2))
    engine.step()
    cached = engine.scheduler.running[0].num_cached_tokens
    assert cached == expected_cached_tokens(prompts[1], [prompts[0]], BLOCK_SIZE) > 0
    assert metrics(engine)["minivllm:prefix_cache_hit_rate_last_step"] == pytest.approx(
        cached / len(prompts[1])
    )


def test_every_block_goes_back_after_finish_and_abort(tiny_dir, tiny_greedy):
    """Requests that finish, and requests aborted while waiting, mid-prefill or mid-decode,
    leave every block free (cached blocks are free and still named); a later request with the
    same prefix still finds them and gets transformers' tokens."""
    engine = tiny_engine(tiny_dir, num_blocks=64, max_num_batched_tokens=10, max_num_seqs=3)
    prompts = shared_prefix_prompts([3, 2, 5, 4, 1], seed=1300)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(12))
    for _ in range(6):
        engine.step()
    assert engine.scheduler.running and engine.scheduler.waiting
    engine.abort_request(["1", "4"])  # one running, one still waiting
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_is_empty(engine)
    assert engine.kv_cache_manager.prefix_cache.hash_of_block  # free, and still cached

    engine.add_request("again", {"prompt_token_ids": prompts[1]}, greedy(6))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finished[output.request_id] = output
    assert finished["again"].num_cached_tokens >= 20
    assert finished["again"].outputs[0].token_ids == tiny_greedy(prompts[1], 6)
    assert_pool_is_empty(engine)


@st.composite
def shared_prefix_streams(draw):
    """Requests built from two fixed prefixes and short random suffixes, arriving at random
    steps, on an engine with a random block size, pool, token budget and seat count."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    requests = draw(
        st.lists(
            st.tuples(
                st.integers(0, 6),  # arrival step
                st.integers(0, 1),  # which prefix
                st.integers(0, 20),  # how much of it
                st.integers(1, 5),  # suffix length
                st.integers(1, 6),  # max_tokens
            ),
            min_size=1,
            max_size=6,
        )
    )
    requests.sort(key=lambda r: r[0])
    longest = max(length + suffix + limit for _, _, length, suffix, limit in requests)
    fewest_blocks = math.ceil(longest / block_size)
    num_blocks = draw(st.integers(fewest_blocks, fewest_blocks + 10))
    budget = draw(st.integers(1, 32))
    max_num_seqs = draw(st.integers(1, 4))
    return block_size, num_blocks, budget, max_num_seqs, requests


STREAM_PREFIXES = (random_prompt(20, seed=1400), random_prompt(20, seed=1401))


def run_stream(model_dir, stream, seed: int, enabled: bool):
    block_size, num_blocks, budget, max_num_seqs, requests = stream
    engine = tiny_engine(
        model_dir,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=enabled,
    )
    finished, pending = {}, list(range(len(requests)))
    for step in range(3000):
        while pending and requests[pending[0]][0] <= step:
            i = pending.pop(0)
            _, which, length, suffix, limit = requests[i]
            prompt = STREAM_PREFIXES[which][:length] + random_prompt(suffix, seed + i)
            engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(limit))
        if not pending and not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        engine.kv_cache_manager.check_integrity()
    else:
        raise AssertionError("the requests did not finish in 3000 steps")
    assert_pool_is_empty(engine)
    return finished, metrics(engine)["vllm:prefix_cache_hits"]


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(stream=shared_prefix_streams(), seed=st.integers(0, 2**16))
def test_random_shared_prefix_streams_equal_caching_off(stream, seed, tiny_dir):
    """Whatever arrives when, and whatever the block size, pool, budget and seats (preemption
    and chunking included), caching on gives caching off's tokens, and every block goes back."""
    with_cache, _ = run_stream(tiny_dir, stream, seed, enabled=True)
    without_cache, hits = run_stream(tiny_dir, stream, seed, enabled=False)
    assert with_cache == without_cache
    assert hits == 0


# --- a realistic case: one system prompt, many questions (the embedded model) ------------------

SYSTEM_PROMPT = (
    "You are a concise assistant for a geography quiz. Answer every question in one short "
    "sentence, name the place exactly, and do not add any explanation or greeting."
)
QUESTIONS = (
    "What is the capital of France?",
    "What is the capital of Italy?",
    "Which ocean lies west of Portugal?",
)


def test_shared_system_prompt_on_the_embedded_model(embedded_dir, tokenizer, transformers_greedy):
    """Chat requests that share a system prompt reuse its blocks (16-token blocks, the
    default) after the first one has run, and answer exactly as transformers does."""
    prompts = [
        apply_chat_template(
            tokenizer,
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}],
        )
        for q in QUESTIONS
    ]
    llm = LLM(kv_cache_memory_bytes=64 * 2**20)
    first = generate(llm, prompts[:1], 10)
    rest = generate(llm, prompts[1:], 10)
    for prompt, output in zip(prompts[1:], rest):
        assert output.num_cached_tokens == expected_cached_tokens(
            prompt, [computed_tokens(first[0])], 16
        )
        assert output.num_cached_tokens >= 32
    for prompt, output in zip(prompts, first + rest):
        assert output.outputs[0].token_ids == transformers_greedy(prompt, 10, EOS_TOKEN_ID)
