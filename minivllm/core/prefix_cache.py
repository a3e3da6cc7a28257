"""Chapter 05 — prefix caching: find KV blocks that another request already computed, and reuse them.

Chat requests resend the same system prompt and history every turn. Their first blocks hold
exactly the same tokens at exactly the same positions, so their K/V are exactly the same. We
give every *full* block a name that says "these tokens, after that prefix":

    hash(block 0) = H(None,          tokens[0:16],  extra keys)
    hash(block 1) = H(hash(block 0), tokens[16:32], extra keys)
    hash(block 2) = H(hash(block 1), tokens[32:48], extra keys)

Because each hash includes its parent's, equal hashes mean equal *whole prefixes*, not just
equal 16-token windows. A new request hashes its prompt's full blocks and walks the chain:
every hit is a block it can share instead of computing (its ref count goes up by one).

Why a cryptographic hash (SHA-256): a collision would silently hand a request another
request's K/V, a wrong answer nobody could trace. With 256-bit digests the chance that any
two different prefixes among 2^64 blocks collide is about 2^-128, far below the rate of
hardware memory errors, so we trust the hash and do not compare tokens on a hit. (Python's
built-in `hash` is 64 bits and seeded per process: fine for dicts, not for this.)

Extra keys keep apart blocks whose tokens are equal but whose K/V must not be shared: a
per-request `cache_salt` (tenants that must not observe each other's cache timing) goes into
the first block's hash and so, through the chain, into every later one. Other keys that change
K/V for the same tokens (e.g. a LoRA adapter) would go in the same place.

Freed blocks keep their hash and stay findable until the pool needs them back; the block
pool's free queue then evicts the least recently freed first.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field

BlockHash = bytes


def hash_block(
    parent: BlockHash | None, token_ids: tuple[int, ...], extra_keys: tuple = ()
) -> BlockHash:
    """SHA-256 of (parent hash, the block's tokens, extra keys): the block's name."""
    payload = pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=5)
    return hashlib.sha256(payload).digest()


def hash_blocks(
    token_ids: list[int],
    block_size: int,
    cache_salt: str | None = None,
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, from block `start_block` on, chained from
    `parent` (the hash of block start_block - 1, or None at the start)."""
    hashes = []
    for block_index in range(start_block, len(token_ids) // block_size):
        tokens = tuple(token_ids[block_index * block_size : (block_index + 1) * block_size])
        # The salt enters the first block only; the chain carries it into all others.
        extra = (cache_salt,) if block_index == 0 and cache_salt is not None else ()
        parent = hash_block(parent, tokens, extra)
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    """Counted in tokens, like vLLM: how many prompt tokens were looked up, how many found."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """One admitted request: its prompt was looked up, `num_cached_tokens` were found."""
        self.queries += num_prompt_tokens
        self.hits += num_cached_tokens


@dataclass
class PrefixCache:
    """The map from block hash to the physical block that holds it (and back), and the hashes
    of each live request's full blocks. Chapter 03's `KVCacheManager` holds one when prefix
    caching is on and calls it from a few one-line hooks."""

    block_size: int
    block_of_hash: dict[BlockHash, int] = field(default_factory=dict)
    hash_of_block: dict[int, BlockHash] = field(default_factory=dict)
    request_hashes: dict[str, list[BlockHash]] = field(default_factory=dict)

    def find_cached_blocks(self, request) -> list[int]:
        """The longest prefix of the request's full blocks that is already cached.

        At least the last token is left out, so that the forward pass has a token to compute
        and logits to sample from, even when the whole prompt is cached.
        """
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens = request.token_ids_between(0, max_blocks * self.block_size)
        return self.longest_cached_prefix(hash_blocks(tokens, self.block_size, request.cache_salt))

    def cache_full_blocks(self, request, block_table: list[int]) -> None:
        """Name the request's blocks that are full of computed tokens, so others can find them.
        Hashes are computed once per block: each step adds only the blocks that just filled."""
        hashes = self.request_hashes.setdefault(request.request_id, [])
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= len(hashes):
            return
        tokens = request.token_ids_between(0, num_full * self.block_size)
        first_new = len(hashes)
        parent = hashes[-1] if hashes else None
        hashes += hash_blocks(tokens, self.block_size, request.cache_salt, parent, first_new)
        for block_index in range(first_new, num_full):
            self.insert(hashes[block_index], block_table[block_index])

    def forget_request(self, request_id: str) -> None:
        """The request is gone; its blocks keep their names (they stay findable until reused)."""
        self.request_hashes.pop(request_id, None)

    def longest_cached_prefix(self, block_hashes: list[BlockHash]) -> list[int]:
        """Physical blocks of the longest run of leading hashes that are cached."""
        blocks = []
        for block_hash in block_hashes:
            block_id = self.block_of_hash.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def insert(self, block_hash: BlockHash, block_id: int) -> None:
        """Name a block that has just become full. If another block already holds the same
        prefix (two requests computed it at once), keep the first: one hash, one block."""
        if block_hash in self.block_of_hash or block_id in self.hash_of_block:
            return
        self.block_of_hash[block_hash] = block_id
        self.hash_of_block[block_id] = block_hash

    def evict(self, block_id: int) -> None:
        """Forget a block's name: the pool is handing it out for new content."""
        block_hash = self.hash_of_block.pop(block_id, None)
        if block_hash is not None:
            del self.block_of_hash[block_hash]

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.hash_of_block

    def clear(self) -> None:
        """Forget every name: all cached prefixes are computed again from now on."""
        self.block_of_hash.clear()
        self.hash_of_block.clear()
