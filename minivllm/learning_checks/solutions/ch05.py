"""Solutions to chapter 05's exercises: chained block hashes, and how much of a prompt the
prefix cache serves."""

import hashlib


def block_hashes(token_ids: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """One SHA-256 digest per *full* block; hash i names tokens[0 : (i + 1) * block_size] and
    the salt, because each hash takes in the one before it (its parent)."""
    # The chain starts from the salt: two different salts share no hash at all.
    parent = b"" if salt is None else hashlib.sha256(b"salt:" + salt.encode()).digest()
    hashes = []
    num_full = len(token_ids) // block_size  # a partial last block is not hashed
    for i in range(num_full):
        block = token_ids[i * block_size : (i + 1) * block_size]
        # A separator that no token list can forge: the parent has a fixed length (32 bytes,
        # or 0 for the first block without salt) and the tokens are comma-separated.
        parent = hashlib.sha256(parent + b"|" + ",".join(map(str, block)).encode()).digest()
        hashes.append(parent)
    return hashes


def cached_prefix_length(
    block_hashes: list[bytes], cached: set[bytes], num_tokens: int, block_size: int
) -> int:
    """Prompt tokens served from the cache: the run of cached hashes from block 0 to the first
    miss, in tokens, leaving at least one prompt token to compute (its logits give the first
    output token)."""
    max_blocks = (num_tokens - 1) // block_size  # full blocks that still leave one token
    hits = 0
    for block_hash in block_hashes[:max_blocks]:
        if block_hash not in cached:
            break
        hits += 1
    return hits * block_size
