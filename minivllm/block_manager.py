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
for n more tokens?"
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size b hold a tokens."""
    return -(-a // b)


@dataclass
class BlockPool:
    """`num_blocks` blocks, each either free (in the free queue) or used (ref_count > 0).

    The free queue is an OrderedDict used as a queue with O(1) removal from the middle: taking
    and returning blocks is O(1), and chapter 05 needs to pull a specific free block back out
    when a cached prefix is reused.
    """

    num_blocks: int
    ref_counts: list[int] = field(init=False)
    free_queue: OrderedDict[int, None] = field(init=False)

    def __post_init__(self):
        if self.num_blocks < 1:
            raise ValueError(
                f"the KV cache needs at least one block, got num_blocks={self.num_blocks}"
            )
        self.ref_counts = [0] * self.num_blocks
        self.free_queue = OrderedDict.fromkeys(range(self.num_blocks))

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
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

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

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of the pool held by live requests (vLLM's kv_cache_usage)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks a request needs so that `num_tokens` tokens in total fit."""
        have = len(self.block_tables.get(request_id, ()))
        return max(cdiv(num_tokens, self.block_size) - have, 0)

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make room for `num_tokens` tokens in total; False (and nothing changed) if the pool
        cannot, so the scheduler can preempt someone or wait."""
        needed = self.blocks_needed(request_id, num_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        self.block_tables.setdefault(request_id, []).extend(self.pool.allocate(needed))
        return True

    def free(self, request_id: str) -> None:
        """Return a finished, aborted or preempted request's blocks to the pool."""
        blocks = self.block_tables.pop(request_id, [])
        # Tail first: if chapter 05 keeps freed blocks findable, a sequence's last blocks are
        # the least likely to be shared, so they should be the first to be reused.
        self.pool.free(list(reversed(blocks)))

    def slot(self, request_id: str, position: int) -> int:
        """Flat index in the pool of the K/V of the request's token at `position`."""
        block_id = self.block_tables[request_id][position // self.block_size]
        return block_id * self.block_size + position % self.block_size
