"""Chapter 05's learning checks: chained block hashes, and how much of a prompt the cache serves."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check


def _our_block_hashes():
    from minivllm.core.prefix_cache import hash_blocks

    def block_hashes(token_ids: list[int], block_size: int, salt: str | None) -> list[bytes]:
        return hash_blocks(token_ids, block_size, salt)

    return block_hashes


# Tokens from a tiny alphabet: blocks repeat often, inside one list and across lists, which is
# exactly when a hash that forgets its prefix gives itself away.
_tokens = st.lists(st.integers(0, 2), max_size=24)
_salts = st.none() | st.text(min_size=1, max_size=4)


@learning_check(
    "ch05.block_hashes",
    signature="block_hashes(token_ids: list[int], block_size: int, salt: str | None) -> "
    "list[bytes]  (one hash per *full* block; hash i names tokens[0 : (i + 1) * block_size] "
    "and the salt)",
    reference=_our_block_hashes,
)
def check_block_hashes(block_hashes) -> None:
    """Properties, not our hash values (any cryptographic hash passes):

    1. one hash per full block: len == len(tokens) // block_size; each a digest of at least
       128 bits (bytes), not Python's 64-bit, per-process `hash`;
    2. a hash names its whole prefix: for two token lists (the second built from the first by
       changing a few tokens, cutting or extending it), hash i of one equals hash j of the other
       exactly when their first i + 1 and j + 1 blocks are the same tokens (so i == j);
    3. the salt: for the same tokens, two different salts share no hash at all;
    4. deterministic: the same input gives the same hashes on every call;
    5. only full blocks count: changing a token of the last, partial block changes nothing.
    """

    @check_settings(max_examples=150)
    @given(
        block_size=st.integers(1, 4),
        first=_tokens,
        salt=_salts,
        other_salt=_salts,
        data=st.data(),
    )
    def property_(block_size, first, salt, other_salt, data):
        # The second list: the first with a few tokens changed (later blocks may match again),
        # then cut or extended.
        second = list(first)
        for position in data.draw(
            st.lists(st.integers(0, max(len(first) - 1, 0)), max_size=2), label="changed at"
        ):
            if second:
                second[position] = data.draw(st.integers(0, 2), label=f"token {position} becomes")
        second = second[: data.draw(st.integers(0, len(second)), label="second cut at")]
        second += data.draw(_tokens, label="second extended by")

        hashes = {}
        for name, tokens in (("first", first), ("second", second)):
            got = list(block_hashes(list(tokens), block_size, salt))
            expected_len = len(tokens) // block_size
            assert len(got) == expected_len, (
                f"{len(got)} hashes for {len(tokens)} tokens in blocks of {block_size}: expected "
                f"{expected_len}, one per full block (tokens={tokens})"
            )
            for h in got:
                assert isinstance(h, bytes) and len(h) >= 16, (
                    f"a block hash should be a cryptographic digest (bytes, at least 128 bits, "
                    f"e.g. hashlib.sha256(...).digest()), got {h!r}"
                )
            hashes[name] = got

        # 2. Equal hashes <=> equal whole prefixes, across every pair of positions.
        for name_a, tokens_a in (("first", first), ("second", second)):
            for name_b, tokens_b in (("first", first), ("second", second)):
                for i, hash_a in enumerate(hashes[name_a]):
                    for j, hash_b in enumerate(hashes[name_b]):
                        prefix_a = tokens_a[: (i + 1) * block_size]
                        prefix_b = tokens_b[: (j + 1) * block_size]
                        same_prefix = prefix_a == prefix_b
                        assert (hash_a == hash_b) == same_prefix, (
                            f"hash {i} of {name_a} {'==' if hash_a == hash_b else '!='} hash {j} "
                            f"of {name_b}, but their prefixes {prefix_a} and {prefix_b} are "
                            f"{'equal' if same_prefix else 'different'} (block_size={block_size}, "
                            f"salt={salt!r}; a hash must name all the tokens up to its block's "
                            "end, not only the block's own tokens)"
                        )

        # 3. Different salts share nothing.
        if other_salt != salt:
            salted = list(block_hashes(list(first), block_size, other_salt))
            shared = set(salted) & set(hashes["first"])
            assert not shared, (
                f"salts {salt!r} and {other_salt!r} give {len(shared)} equal hash(es) for tokens "
                f"{first} (block_size={block_size}): requests with different salts must never "
                "share a block"
            )

        # 4. Deterministic.
        again = list(block_hashes(list(first), block_size, salt))
        assert again == hashes["first"], (
            f"two calls with the same input (tokens={first}, block_size={block_size}, "
            f"salt={salt!r}) gave different hashes"
        )

        # 5. The partial last block does not count.
        if len(first) % block_size:
            changed = list(first)
            changed[-1] += 1
            got = list(block_hashes(changed, block_size, salt))
            assert got == hashes["first"], (
                f"changing the last token of {first} (in the partial last block, "
                f"block_size={block_size}) changed the hashes: only full blocks are hashed"
            )

    property_()


def _our_cached_prefix_length():
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.prefix_cache import hash_blocks
    from minivllm.core.request import Request
    from minivllm.sample.sampling_params import SamplingParams

    def cached_prefix_length(
        block_hashes: list[bytes], cached: set[bytes], num_tokens: int, block_size: int
    ) -> int:
        # The engine's own lookup, KVCacheManager.find_cached_blocks, hashes a request's tokens
        # itself. So: a prompt of num_tokens tokens whose full block i is block_size copies of
        # token i (no two blocks alike), and the engine's hash of block i goes into the prefix
        # cache exactly when the check's stand-in hash block_hashes[i] is in `cached`.
        num_full = len(block_hashes)
        token_ids = [i for i in range(num_full) for _ in range(block_size)]
        token_ids += [num_full] * (num_tokens - len(token_ids))
        manager = KVCacheManager(
            num_blocks=max(num_full, 1), block_size=block_size, enable_prefix_caching=True
        )
        engine_hashes = hash_blocks(token_ids, block_size)
        for block_id, (engine_hash, block_hash) in enumerate(zip(engine_hashes, block_hashes)):
            if block_hash in cached:
                manager.prefix_cache.insert(engine_hash, block_id)
        request = Request(
            request_id="prompt",
            prompt=None,
            prompt_token_ids=token_ids,
            params=SamplingParams(temperature=0.0),
            eos_token_ids=(),
            max_model_len=num_tokens + 1,
            detokenizer=None,  # never used: the lookup only reads token ids
        )
        return len(manager.find_cached_blocks(request)) * block_size

    return cached_prefix_length


@learning_check(
    "ch05.cached_prefix_length",
    signature="cached_prefix_length(block_hashes: list[bytes], cached: set[bytes], "
    "num_tokens: int, block_size: int) -> int  (prompt tokens served from the cache; "
    "block_hashes are the prompt's full blocks, len == num_tokens // block_size)",
    reference=_our_cached_prefix_length,
)
def check_cached_prefix_length(cached_prefix_length) -> None:
    """Equals a brute-force restatement of the rule: the largest k such that the first k block
    hashes are all cached and k full blocks still leave at least one prompt token to compute;
    the answer is k * block_size tokens."""

    @check_settings(max_examples=150)
    @given(
        block_size=st.integers(1, 5),
        data=st.data(),
    )
    def property_(block_size, data):
        # Hashes from a small pool, so that the same hash can appear twice and a cached hash can
        # follow a missing one.
        # (Short stand-ins for real digests: only equality matters here.)
        pool = [f"h{i}".encode() for i in range(6)]
        # A prompt has at least one token: with blocks of 1, at least one full block.
        block_hashes = data.draw(
            st.lists(st.sampled_from(pool), min_size=block_size == 1, max_size=6),
            label="block_hashes",
        )
        cached = data.draw(st.sets(st.sampled_from(pool)), label="cached")
        low = max(len(block_hashes) * block_size, 1)
        num_tokens = data.draw(
            st.integers(low, len(block_hashes) * block_size + block_size - 1), label="num_tokens"
        )
        expected = 0
        for k in range(len(block_hashes) + 1):
            all_cached = all(h in cached for h in block_hashes[:k])
            leaves_one = k * block_size <= num_tokens - 1
            if all_cached and leaves_one:
                expected = k * block_size
        got = cached_prefix_length(list(block_hashes), set(cached), num_tokens, block_size)
        hits = ["cached" if h in cached else "missing" for h in block_hashes]
        assert got == expected, (
            f"got {got}, expected {expected} tokens (num_tokens={num_tokens}, "
            f"block_size={block_size}, the prompt's full blocks: {hits})"
        )

    property_()
