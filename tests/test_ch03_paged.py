"""Chapter 03 checks: paged KV blocks and paged attention.

The block pool is checked as a state machine: hypothesis runs random sequences of allocations,
shared starts (as chapter 05's prefix cache makes them) and frees and, after every step, checks
the bookkeeping a learner can state in one line each (every block is either free or held, never
both; its reference count is the number of tables holding it; each table has exactly the blocks
its tokens need). Paged attention is checked against the definition of
attention: a plain float64 softmax over each sequence's own keys, whatever block size, block
placement, chunk shape or head grouping.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from attention_cases import (
    attention_config,
    backend_step,
    blocks_for,
    paged_batches,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from minivllm.attention.backend import PagedKVCache
from minivllm.attention.torch_paged import TorchPagedAttention, paged_attention, write_kv
from minivllm.core.kv_cache_manager import BlockPool, KVCacheManager

# --- the block pool as a state machine ------------------------------------------------------

REQUEST_IDS = st.sampled_from(["a", "b", "c", "d", "e"])


class BlockTableMachine(RuleBasedStateMachine):
    """Random allocate/share/free sequences over a `KVCacheManager`, next to a model of what
    each request should hold: its number of tokens and, in order, the blocks it was given.

    Sharing (what chapter 05's prefix cache does) starts a new request's table with blocks
    other requests hold, or with free blocks that are revived, so ref counts go above 1 and
    freeing one holder of a shared block must leave it out of the free queue."""

    @initialize(num_blocks=st.integers(1, 16), block_size=st.integers(1, 6))
    def create_pool(self, num_blocks, block_size):
        self.manager = KVCacheManager(num_blocks, block_size)
        self.block_size = block_size
        self.num_tokens: dict[str, int] = {}  # request id -> tokens it has room for
        self.tables: dict[str, list[int]] = {}  # request id -> its blocks, as the pool gave them

    def snapshot(self):
        """Everything the pool and the tables hold, to check that a refusal changes nothing."""
        pool = self.manager.pool
        return (
            copy.deepcopy(self.manager.block_tables),
            list(pool.free_queue),
            list(pool.ref_counts),
        )

    def table(self, request_id: str) -> list[int]:
        return self.manager.block_tables.get(request_id, [])

    def holders(self, block_id: int, but: str | None = None) -> int:
        """How many requests (other than `but`) hold the block, by the model."""
        return sum(block_id in table for rid, table in self.tables.items() if rid != but)

    def record_grant(self, request_id: str, total: int) -> None:
        """A granted request keeps the blocks it had, in place, and only appends new ones."""
        table = self.table(request_id)
        before = self.tables.get(request_id, [])
        assert table[: len(before)] == before, f"{request_id}'s blocks {before} became {table}"
        self.num_tokens[request_id] = total
        self.tables[request_id] = list(table)

    @rule(request_id=REQUEST_IDS, more_tokens=st.integers(0, 20))
    def allocate(self, request_id, more_tokens):
        """Ask room for `more_tokens` beyond what the request holds (a new one holds 0): granted
        exactly when the extra blocks it needs are free; refused without changing anything."""
        held = self.num_tokens.get(request_id, 0)
        total = held + more_tokens
        extra_blocks = blocks_for(total, self.block_size) - blocks_for(held, self.block_size)
        fits = extra_blocks <= self.manager.num_free_blocks
        before = self.snapshot()
        granted = self.manager.allocate_slots(request_id, total)
        assert granted == fits, f"{extra_blocks} blocks needed, {before[1]} free"
        if granted:
            self.record_grant(request_id, total)
        else:
            assert self.snapshot() == before, "a refused allocation changed the pool"

    @rule(
        request_id=REQUEST_IDS,
        picks=st.lists(st.tuples(st.booleans(), st.integers(0, 1000)), min_size=1, max_size=4),
        extra_tokens=st.integers(0, 12),
    )
    def start_with_shared_blocks(self, request_id, picks, extra_tokens):
        """A new request starts with k shared blocks (each held by someone, or free and revived,
        as a prefix-cache hit) and room for `extra_tokens` more: granted exactly when its new
        blocks plus the revived ones are free. Then its table starts with the shared blocks, each
        of them has one holder more, and a revived block has left the free queue."""
        if request_id in self.tables:
            return  # only a new request starts with shared blocks
        pool = self.manager.pool
        shared: list[int] = []
        for prefer_held, choice in picks:
            held = [b for b in range(pool.num_blocks) if self.holders(b) and b not in shared]
            free = [b for b in range(pool.num_blocks) if not self.holders(b) and b not in shared]
            candidates = held if (prefer_held and held) or not free else free
            if candidates:
                shared.append(candidates[choice % len(candidates)])
        total = len(shared) * self.block_size + extra_tokens
        new_blocks = blocks_for(total, self.block_size) - len(shared)
        revived = [b for b in shared if not self.holders(b)]
        fits = new_blocks + len(revived) <= self.manager.num_free_blocks
        holders_before = [self.holders(b) for b in range(pool.num_blocks)]
        before = self.snapshot()

        granted = self.manager.allocate_slots(request_id, total, cached_blocks=shared)

        assert granted == fits, (
            f"sharing {shared} ({len(revived)} revived) + {new_blocks} new blocks, "
            f"{before[1]} free: granted={granted}"
        )
        if not granted:
            assert self.snapshot() == before, "a refused allocation changed the pool"
            return
        self.record_grant(request_id, total)
        assert self.tables[request_id][: len(shared)] == shared, (
            f"{request_id}'s table {self.tables[request_id]} does not start with {shared}"
        )
        for block_id in shared:
            assert pool.ref_counts[block_id] == holders_before[block_id] + 1, (
                f"shared block {block_id}: ref count {pool.ref_counts[block_id]}, "
                f"expected {holders_before[block_id] + 1}"
            )
            assert block_id not in pool.free_queue, f"shared block {block_id} is still free"

    @rule(request_id=REQUEST_IDS)
    def free(self, request_id):
        """Freeing a request drops one reference to each of its blocks: the blocks nobody else
        holds return to the free queue, the ones another request still holds stay out of it.
        Freeing an unknown (or already freed) request gives nothing back twice."""
        blocks = list(self.table(request_id))
        still_held = [b for b in blocks if self.holders(b, but=request_id)]
        released = [b for b in blocks if b not in still_held]
        free_before = self.manager.num_free_blocks
        self.manager.free(request_id)
        self.num_tokens.pop(request_id, None)
        self.tables.pop(request_id, None)
        free_queue = self.manager.pool.free_queue
        assert request_id not in self.manager.block_tables
        assert set(released) <= set(free_queue), f"blocks {released} were not given back"
        assert not set(still_held) & set(free_queue), (
            f"freeing {request_id} put blocks {sorted(set(still_held) & set(free_queue))} back "
            "in the free queue while another request still holds them"
        )
        assert self.manager.num_free_blocks == free_before + len(released)

    @precondition(lambda self: self.manager.num_free_blocks > 0)
    @rule(choice=st.integers(0, 1000))
    def free_a_free_block(self, choice):
        """Freeing a block nobody holds raises, and changes nothing."""
        free_blocks = list(self.manager.pool.free_queue)
        block = free_blocks[choice % len(free_blocks)]
        before = self.snapshot()
        with pytest.raises(ValueError):
            self.manager.pool.free([block])
        assert self.snapshot() == before

    @invariant()
    def the_tables_are_the_ones_handed_out(self):
        """The manager's tables are exactly the model's: no block moved, appeared or vanished."""
        assert self.manager.block_tables == self.tables

    @invariant()
    def every_block_is_free_or_held_never_both(self):
        """A block is in the free queue exactly when no table holds it; no table holds a block
        twice; free + held == total."""
        pool = self.manager.pool
        free = list(pool.free_queue)
        held = {b for table in self.tables.values() for b in table}
        for request_id, table in self.tables.items():
            assert len(set(table)) == len(table), f"{request_id} holds a block twice: {table}"
        assert not set(free) & held, f"blocks {sorted(set(free) & held)} are free and held"
        assert sorted(free + sorted(held)) == list(range(pool.num_blocks)), "free + held != all"
        assert self.manager.num_free_blocks == len(free)
        assert self.manager.usage == pytest.approx(len(held) / pool.num_blocks)

    @invariant()
    def ref_counts_count_the_tables_holding_a_block(self):
        """A block's ref count is the number of tables holding it: 0 when free, never negative,
        above 1 when shared."""
        ref_counts = self.manager.pool.ref_counts
        expected = [self.holders(b) for b in range(self.manager.num_blocks)]
        assert list(ref_counts) == expected, f"ref counts {ref_counts}, holders {expected}"

    @invariant()
    def each_table_has_exactly_the_blocks_its_tokens_need(self):
        """cdiv(tokens, block_size) blocks per request: never fewer (no room), never more (waste)."""
        assert set(self.manager.block_tables) <= set(self.num_tokens)
        for request_id, num_tokens in self.num_tokens.items():
            assert len(self.table(request_id)) == blocks_for(num_tokens, self.block_size)


TestBlockTables = BlockTableMachine.TestCase
TestBlockTables.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_freeing_blocks_twice_raises():
    """A block given back more often than it was handed out is a bookkeeping bug: it raises."""
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="freed more often"):
        pool.free(blocks[:1])
    assert pool.num_free_blocks == 4 and pool.ref_counts == [0, 0, 0, 0]


def test_a_shared_block_returns_to_the_free_queue_only_with_its_last_holder():
    """Block 0 is held by three tables (ref count 3): the first two frees leave it out of the
    free queue, the third puts it back."""
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.share([block])
    pool.share([block])
    assert pool.ref_counts[block] == 3 and block not in pool.free_queue
    for holders_left in (2, 1):
        pool.free([block])
        assert pool.ref_counts[block] == holders_left
        assert block not in pool.free_queue, f"freed with {holders_left} holder(s) left"
    pool.free([block])
    assert pool.ref_counts[block] == 0 and block in pool.free_queue


def test_free_tail_gives_back_the_blocks_past_the_tokens_kept_tail_first():
    """Chapter 08: after a verification the blocks that only held rejected drafts (or
    lookahead slots) go back, the last first; the blocks the kept tokens need stay."""
    manager = KVCacheManager(num_blocks=6, block_size=4)
    assert manager.allocate_slots("r", 17)  # 5 blocks: 0 1 2 3 4
    manager.free_tail("r", 9)  # 9 tokens need 3 blocks
    assert manager.block_tables["r"] == [0, 1, 2]
    assert list(manager.pool.free_queue) == [5, 4, 3]
    manager.free_tail("r", 12)  # nothing past the tokens kept: nothing changes
    assert manager.block_tables["r"] == [0, 1, 2]
    manager.check_integrity()


def test_check_integrity_names_the_law_that_is_broken():
    """Each conservation law of the pool, broken on purpose, is reported by name: a table that
    holds a block twice, a ref count that is not the number of holders, a used block also in
    the free queue, a free block missing from it, and prefix-cache maps that disagree."""
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    assert manager.allocate_slots("r", 8)  # blocks 0 and 1
    manager.check_integrity()
    pool, cache = manager.pool, manager.prefix_cache

    def broken(message: str) -> None:
        with pytest.raises(AssertionError) as raised:
            manager.check_integrity()
        assert str(raised.value) == message

    manager.block_tables["r"].append(0)
    broken("r holds a block twice: [0, 1, 0]")
    manager.block_tables["r"].pop()
    pool.ref_counts[1] = 2
    broken("block 1: ref count 2, in 1 block tables")
    pool.ref_counts[1] = 1
    pool.free_queue[0] = None
    broken("block 0: ref count 1 but in the free queue")
    del pool.free_queue[0]
    del pool.free_queue[3]
    broken("block 3: ref count 0 but not in the free queue")
    pool.free_queue[3] = None
    cache.block_of_hash[b"h"] = 2
    broken("the maps differ in size")
    cache.hash_of_block[2] = b"other"
    broken("block 2 is found by a hash it is not named by")


def test_allocating_more_blocks_than_free_raises():
    """The pool never hands out a block it does not have."""
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(ValueError, match="asked for 2 blocks, only 1 are free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_a_pool_or_block_of_nothing_is_refused_by_name():
    with pytest.raises(ValueError, match="needs at least one block, got num_blocks=0"):
        BlockPool(0)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        KVCacheManager(num_blocks=4, block_size=0)


def test_chapter_03s_manager_caches_no_prefix_unless_asked():
    assert KVCacheManager(num_blocks=4, block_size=4).prefix_cache is None


def test_blocks_touched_counts_each_block_once_however_often_reused():
    """Chapter 12's measure of resident KV memory: a block counts from its first hand-out
    on; freeing and taking it again adds nothing."""
    pool = BlockPool(4)
    first = pool.allocate(2)
    assert pool.num_blocks_touched == 2
    pool.free(first)
    pool.allocate(2)  # the two untouched blocks come first from the queue's head
    pool.allocate(2)  # then the first two again
    assert pool.num_blocks_touched == 4
    pool.free([0, 1, 2, 3])
    pool.allocate(4)
    assert pool.num_blocks_touched == 4


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.integers(1, 7),
    growth=st.lists(st.sampled_from("abc"), min_size=1, max_size=60),
    spare_blocks=st.integers(0, 3),
)
def test_slot_is_block_id_times_block_size_plus_offset(block_size, growth, spare_blocks):
    """Requests grow one token at a time, interleaved, as when decoding; token p of a request sits
    at slot table[p // block_size] * block_size + p % block_size, and no two tokens share a slot."""
    num_tokens = Counter(growth)
    num_blocks = sum(blocks_for(n, block_size) for n in num_tokens.values()) + spare_blocks
    manager = KVCacheManager(num_blocks, block_size)
    grown: Counter = Counter()
    for request_id in growth:
        grown[request_id] += 1
        assert manager.allocate_slots(request_id, grown[request_id])

    slots = []
    for request_id, n in num_tokens.items():
        table = manager.block_tables[request_id]
        for position in range(n):
            expected = table[position // block_size] * block_size + position % block_size
            assert manager.slot(request_id, position) == expected
            slots.append(expected)
    assert len(set(slots)) == len(slots)
    assert all(0 <= s < num_blocks * block_size for s in slots)


def test_slot_of_the_chapter_picture():
    """The chapter's example: with block table [2, 0, 3] and 16-slot blocks, token 17 is slot
    0*16 + 1 = 1 and token 40 is slot 3*16 + 8 = 56."""
    manager = KVCacheManager(num_blocks=4, block_size=16)
    manager.block_tables["A"] = [2, 0, 3]
    assert manager.slot("A", 0) == 32
    assert manager.slot("A", 17) == 1
    assert manager.slot("A", 40) == 56


# --- paged attention == dense attention -----------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(batch=paged_batches())
def test_paged_attention_equals_dense_attention(batch):
    """Whatever the block size, block placement, mix of decodes and prefill chunks, and GQA
    grouping, attention read through block tables equals plain attention over each sequence."""
    step = backend_step(batch)
    kv = step.cache.layers[0]
    write_kv(kv, step.new_k, step.new_v, step.metadata.slot_mapping)  # the whole context is in
    out = paged_attention(step.q, kv, step.metadata)
    assert out.shape == step.q.shape
    torch.testing.assert_close(out.double(), step.expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(batch=paged_batches())
def test_torch_backend_writes_new_tokens_then_attends(batch):
    """The "torch" backend as the model calls it: only earlier steps' K/V are in the pool; it
    writes this step's K/V at slot_mapping, then attends, matching dense attention."""
    step = backend_step(batch)
    backend = TorchPagedAttention(step.cache, step.metadata)
    out = backend(0, step.q, step.new_k, step.new_v)
    torch.testing.assert_close(out.double(), step.expected, atol=1e-5, rtol=1e-5)


# --- how many blocks a memory budget holds --------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    num_layers=st.integers(1, 4),
    num_kv_heads=st.integers(1, 4),
    head_dim=st.sampled_from([2, 4, 8, 64]),
    block_size=st.integers(1, 32),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    memory_bytes=st.integers(0, 2**20),
)
def test_num_blocks_for_budget_is_the_most_blocks_that_fit(
    num_layers, num_kv_heads, head_dim, block_size, dtype, memory_bytes
):
    """A block holds K and V of block_size tokens for every layer and KV head; the budget gives
    the largest whole number of such blocks that fits, and the pool really occupies that much."""
    config = attention_config(
        num_layers=num_layers, num_heads=num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    element_size = torch.finfo(dtype).bits // 8
    bytes_per_block = block_size * 2 * num_layers * num_kv_heads * head_dim * element_size
    num_blocks = PagedKVCache.num_blocks_for_budget([config], block_size, dtype, memory_bytes)
    assert num_blocks * bytes_per_block <= memory_bytes < (num_blocks + 1) * bytes_per_block
    if num_blocks:
        cache = PagedKVCache(config, num_blocks, block_size, dtype, "cpu")
        allocated = sum(layer.numel() * layer.element_size() for layer in cache.layers)
        assert allocated == num_blocks * bytes_per_block
