"""Chapter 03 — paged KV blocks: memory handed out in small fixed-size blocks, as sequences grow.

Chapter 02 reserved `max_len` slots per sequence up front. Most of them stay empty: a request
does not know how long its answer will be. Here the KV cache is one big pool of blocks of
`block_size` token slots each, and a sequence gets a new block only when its last one is full:

    block pool:   [0][1][2][3][4][5][6][7] ...       (free queue: 4 5 6 7 ...)
    request A:    block table [2, 0, 3]    -> tokens 0-15 in block 2, 16-31 in block 0, ...
    request B:    block table [1]

A token's *slot* is `block_id * block_size + offset`: the flat index of its K/V in the pool.
Blocks of one sequence need not be adjacent; the block table maps logical to physical blocks,
exactly like a page table maps virtual to physical memory pages.

`BlockPool` owns the blocks (free queue, reference counts); `KVCacheManager` owns the block
tables of the requests and answers the scheduler's one question: "can this request get room
for n more tokens?" With prefix caching on (chapter 05, `prefix_cache.py`) it also finds the
blocks a new request can share, and names every block that becomes full.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from minivllm.attention.backend import slot_mapping
from minivllm.core.prefix_cache import PrefixCache
from minivllm.utils import cdiv


@dataclass
class BlockPool:
    """`num_blocks` blocks, each either free (in the free queue) or used (ref_count > 0).

    The free queue is an OrderedDict used as a queue with O(1) removal from the middle: taking
    and returning blocks is O(1), and chapter 05 needs to pull a specific free block back out
    when a cached prefix is reused.
    """

    num_blocks: int
    prefix_cache: PrefixCache | None = None
    ref_counts: list[int] = field(init=False)
    free_queue: OrderedDict[int, None] = field(init=False)
    # Chapter 12: blocks handed out at least once. On a CPU the pool's memory becomes
    # resident as blocks are first written (`zeroed_pool`): this many blocks' worth of it.
    num_blocks_touched: int = field(init=False, default=0)
    touched: bytearray = field(init=False, repr=False)

    def __post_init__(self):
        if self.num_blocks < 1:
            raise ValueError(
                f"the KV cache needs at least one block, got num_blocks={self.num_blocks}"
            )
        self.ref_counts = [0] * self.num_blocks
        self.free_queue = OrderedDict.fromkeys(range(self.num_blocks))
        self.touched = bytearray(self.num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the head of the free queue."""
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks, only {self.num_free_blocks} are free")
        blocks = []
        for _ in range(count):
            block_id, _ = self.free_queue.popitem(last=False)
            if self.prefix_cache is not None:  # chapter 05 hook: its old content is overwritten
                self.prefix_cache.evict(block_id)
            self.ref_counts[block_id] = 1
            if not self.touched[block_id]:
                self.touched[block_id] = 1
                self.num_blocks_touched += 1
            blocks.append(block_id)
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Add a reference to blocks found in the prefix cache. A cached block that nobody was
        using sits in the free queue; taking it out keeps it from being evicted."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block nobody references returns to the queue.

        Blocks are given in the order they should be reused: the queue's head is taken first.
        """
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} is freed more often than it was allocated")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None


class KVCacheManager:
    """The block tables of all live requests, on top of a `BlockPool`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        # Chapter 05 hook: with prefix caching, full blocks get names other requests can find.
        self.prefix_cache = PrefixCache(block_size) if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.prefix_cache)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of the pool held by live requests (vLLM's kv_cache_usage). Free blocks that
        still hold a cached prefix count as free: they can be reclaimed at any time."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def find_cached_blocks(self, request) -> list[int]:
        """Chapter 05 hook: blocks of the request's prefix already in the pool ([] without a
        prefix cache)."""
        return [] if self.prefix_cache is None else self.prefix_cache.find_cached_blocks(request)

    def allocate_slots(
        self, request_id: str, num_tokens: int, cached_blocks: list[int] = ()
    ) -> bool:
        """Make room for `num_tokens` tokens in total, starting a new request's table with the
        `cached_blocks` it shares; False (and nothing changed) if the pool cannot, so the
        scheduler can preempt someone or wait."""
        table = self.block_tables.get(request_id, [])
        needed = max(cdiv(num_tokens, self.block_size) - len(table) - len(cached_blocks), 0)
        # Shared blocks that sit in the free queue leave it too.
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if needed + revived > self.pool.num_free_blocks:
            return False
        self.pool.share(list(cached_blocks))
        self.block_tables[request_id] = table + list(cached_blocks) + self.pool.allocate(needed)
        return True

    def cache_full_blocks(self, request) -> None:
        """Chapter 05 hook: name the request's blocks that have just become full."""
        if self.prefix_cache is not None:
            self.prefix_cache.cache_full_blocks(request, self.block_tables[request.request_id])

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        """Keep only the blocks the request's first `num_tokens` tokens need (chapter 08: the
        blocks that held rejected draft tokens go back)."""
        table = self.block_tables[request_id]
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(table):
            self.pool.free(list(reversed(table[keep:])))
            del table[keep:]

    def free(self, request_id: str) -> None:
        """Return a finished, aborted or preempted request's blocks to the pool."""
        blocks = self.block_tables.pop(request_id, [])
        if self.prefix_cache is not None:  # chapter 05 hook
            self.prefix_cache.forget_request(request_id)
        # Tail first: with prefix caching, freed blocks stay findable until reused, and a
        # sequence's last blocks are the least likely to be shared, so they go first.
        self.pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (vLLM's `reset_prefix_cache`), e.g. between benchmark
        runs. Only possible while no request holds a block: a live request's blocks are named
        and will be looked up again. Returns whether the cache was reset."""
        if self.pool.num_free_blocks < self.pool.num_blocks:
            return False
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return True

    def check_integrity(self) -> None:
        """The pool's conservation laws; raises AssertionError naming the first one broken.

        - every block is either free (ref count 0, in the free queue) or used (ref count > 0);
        - a block's ref count is the number of block tables holding it (no block is owned
          twice by one request, none is lost);
        - the prefix cache's two maps are each other's inverse, so every named block can be
          found by its hash, and a block has at most one name.
        """
        pool = self.pool
        holders = [0] * pool.num_blocks
        for request_id, table in self.block_tables.items():
            assert len(set(table)) == len(table), f"{request_id} holds a block twice: {table}"
            for block_id in table:
                holders[block_id] += 1
        for block_id, (count, held) in enumerate(zip(pool.ref_counts, holders)):
            assert count == held, f"block {block_id}: ref count {count}, in {held} block tables"
            assert (count == 0) == (block_id in pool.free_queue), (
                f"block {block_id}: ref count {count} but "
                f"{'in' if block_id in pool.free_queue else 'not in'} the free queue"
            )
        used = sum(count > 0 for count in pool.ref_counts)
        assert pool.num_free_blocks + used == pool.num_blocks, (
            f"{pool.num_free_blocks} free + {used} used != {pool.num_blocks} blocks"
        )
        if self.prefix_cache is not None:
            cache = self.prefix_cache
            assert len(cache.block_of_hash) == len(cache.hash_of_block), "the maps differ in size"
            for block_hash, block_id in cache.block_of_hash.items():
                assert cache.hash_of_block.get(block_id) == block_hash, (
                    f"block {block_id} is found by a hash it is not named by"
                )

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat pool indices of the K/V of the request's tokens at positions start..end-1:
        slot = block_id * block_size + offset."""
        return slot_mapping(self.block_tables[request_id], self.block_size, start, end)

    def slot(self, request_id: str, position: int) -> int:
        """Flat index in the pool of the K/V of the request's token at `position`."""
        return self.slot_mapping(request_id, position, position + 1)[0]
