"""Chapter 03's learning checks: slot mapping and paged attention."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm.learning_checks import (
    check_settings,
    first_mismatch,
    learning_check,
    num_mismatches,
    show_values,
)


def _our_slot_mapping():
    from minivllm.core.kv_cache_manager import KVCacheManager

    def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
        manager = KVCacheManager(num_blocks=max(block_table, default=0) + 1, block_size=block_size)
        manager.block_tables["r"] = list(block_table)
        return [manager.slot("r", position) for position in range(start, end)]

    return slot_mapping


@learning_check(
    "ch03.slot_mapping",
    signature="slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> "
    "list[int]  (the pool slot of each of the sequence's positions start..end-1)",
    reference=_our_slot_mapping,
)
def check_slot_mapping(slot_mapping) -> None:
    """Equals the definition: fill the blocks of the table in order, `block_size` tokens each;
    the token at position p sits at offset o of block b, i.e. flat slot b * block_size + o."""

    @check_settings(max_examples=60)
    @given(
        block_size=st.integers(1, 8),
        num_blocks=st.integers(1, 12),
        data=st.data(),
    )
    def property_(block_size, num_blocks, data):
        order = data.draw(st.permutations(range(num_blocks)), label="pool order")
        table_len = data.draw(st.integers(1, num_blocks), label="blocks in the table")
        block_table = list(order[:table_len])
        capacity = table_len * block_size
        start = data.draw(st.integers(0, capacity), label="start")
        end = data.draw(st.integers(start, capacity), label="end")
        # The definition, spelled out: walk the table's blocks in order and hand out their
        # slots one by one to positions 0, 1, 2, ...
        slot_of_position = []
        for block_id in block_table:
            for offset in range(block_size):
                slot_of_position.append(block_id * block_size + offset)
        expected = slot_of_position[start:end]
        got = list(slot_mapping(block_table, block_size, start, end))
        assert got == expected, (
            f"got {got}, expected {expected} (block_table={block_table}, "
            f"block_size={block_size}, positions {start}..{end - 1})"
        )

    property_()


def _our_paged_attention():
    from types import SimpleNamespace

    from minivllm.attention.backend import AttentionMetadata, slot_mapping
    from minivllm.attention.torch_paged import TorchPagedAttention

    def attend(q, kv, block_tables, seq_lens, query_lens):
        # The backend as the model calls it: this step's new K/V (here read back from the pool,
        # where they already are) are written at their slots, then attended over.
        block_size = kv.shape[2]
        slots = [
            slot
            for table, n, m in zip(block_tables, seq_lens, query_lens)
            for slot in slot_mapping(table, block_size, n - m, n)
        ]
        flat = kv.flatten(1, 2)  # [2, slots, kv_heads, head_dim]
        k, v = flat[0, slots], flat[1, slots]
        metadata = AttentionMetadata.build(query_lens, seq_lens, block_tables, slots, q.device)
        cache = SimpleNamespace(layers=[kv.clone()])
        return TorchPagedAttention(cache, metadata)(0, q, k, v)

    return attend


@learning_check(
    "ch03.paged_attention",
    signature="paged_attention(q: Tensor[tokens, heads, head_dim], kv: Tensor[2, num_blocks, "
    "block_size, kv_heads, head_dim], block_tables: list[list[int]], seq_lens: list[int], "
    "query_lens: list[int]) -> Tensor[tokens, heads, head_dim]; sequence i's queries are the "
    "next query_lens[i] rows of q, at positions seq_lens[i]-query_lens[i] .. seq_lens[i]-1; "
    "the K/V of all its seq_lens[i] tokens are already in the pool",
    reference=_our_paged_attention,
)
def check_paged_attention(paged_attention) -> None:
    """Equals dense causal softmax attention in float64, one sequence and one head at a time,
    after scattering each sequence's K/V into a pool along a random block table."""

    @check_settings(max_examples=40)
    @given(
        num_seqs=st.integers(1, 3),
        block_size=st.sampled_from([1, 2, 3, 4, 8]),
        kv_heads=st.integers(1, 2),
        group=st.integers(1, 3),
        head_dim=st.sampled_from([2, 4, 8]),
        spare_blocks=st.integers(0, 3),
        data=st.data(),
    )
    def property_(num_seqs, block_size, kv_heads, group, head_dim, spare_blocks, data):
        seq_lens = data.draw(
            st.lists(st.integers(1, 20), min_size=num_seqs, max_size=num_seqs), label="seq_lens"
        )
        query_lens = [
            data.draw(st.integers(1, n), label=f"query_len of sequence {i}")
            for i, n in enumerate(seq_lens)
        ]
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + spare_blocks
        order = data.draw(st.permutations(range(num_blocks)), label="pool order")
        block_tables, taken = [], 0
        for count in blocks_per_seq:
            block_tables.append(list(order[taken : taken + count]))
            taken += count
        seed = data.draw(st.integers(0, 2**16), label="seed")

        generator = torch.Generator().manual_seed(seed)
        heads = kv_heads * group
        # Unused slots hold large garbage: reading past a sequence's end must show.
        kv = 30 * torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator)
        dense_k, dense_v, queries = [], [], []
        for i, n in enumerate(seq_lens):
            k = torch.randn(n, kv_heads, head_dim, generator=generator)
            v = torch.randn(n, kv_heads, head_dim, generator=generator)
            for position in range(n):  # scatter along the block table, by the definition
                block = block_tables[i][position // block_size]
                kv[0, block, position % block_size] = k[position]
                kv[1, block, position % block_size] = v[position]
            dense_k.append(k)
            dense_v.append(v)
            queries.append(torch.randn(query_lens[i], heads, head_dim, generator=generator))
        q = torch.cat(queries)

        expected = torch.empty(q.shape, dtype=torch.float64)
        row = 0
        for i, (n, m) in enumerate(zip(seq_lens, query_lens)):
            for j in range(m):
                position = n - m + j  # query j of the chunk; it sees keys 0..position
                for h in range(heads):
                    k = dense_k[i][: position + 1, h // group].double()
                    v = dense_v[i][: position + 1, h // group].double()
                    weights = torch.softmax(k @ queries[i][j, h].double() / head_dim**0.5, dim=0)
                    expected[row + j, h] = weights @ v
            row += m

        got = paged_attention(q, kv, block_tables, seq_lens, query_lens)
        assert got.shape == q.shape, (
            f"shape {tuple(got.shape)}, expected {tuple(q.shape)}, the shape of q (seq_lens="
            f"{seq_lens}, query_lens={query_lens}, kv {tuple(kv.shape)})"
        )
        where = first_mismatch(got, expected, atol=1e-4)
        if where is not None:
            row, h = where[:2]
            # Which sequence and query the row belongs to.
            i, first_row = 0, 0
            while row >= first_row + query_lens[i]:
                first_row += query_lens[i]
                i += 1
            j = row - first_row
            position = seq_lens[i] - query_lens[i] + j
            kv_head = h // group
            raise AssertionError(
                f"row {row} = sequence {i}'s query {j} of {query_lens[i]} (position {position}, "
                f"sees its keys 0..{position}), head {h} (reads kv head {kv_head}): expected "
                f"{show_values(expected[row, h])}, got {show_values(got[row, h])} for "
                f"q[{row}, {h}] = {show_values(q[row, h])}, the sequence's keys 0..{position} "
                f"(kv head {kv_head}) = {show_values(dense_k[i][: position + 1, kv_head])} and "
                f"values = {show_values(dense_v[i][: position + 1, kv_head])}; "
                f"{num_mismatches(got, expected, 1e-4, dims=2)} of {q.shape[0] * heads} "
                f"(row, head) pairs wrong, max difference "
                f"{(got.double() - expected).abs().max().item():.3g} (seq_lens={seq_lens}, "
                f"query_lens={query_lens}, block_tables={block_tables}, "
                f"block_size={block_size}, heads={heads}, kv_heads={kv_heads})"
            )

    property_()
