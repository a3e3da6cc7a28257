"""Appendix A's learning check: gathering a sequence's K/V out of the paged pool, block by block."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check, show_values


def _our_gather_kv():
    from minivllm.attention.torch_paged import gather_kv

    return gather_kv


@learning_check(
    "chA.gather_kv",
    signature="gather_kv(kv: Tensor[2, num_blocks, block_size, kv_heads, head_dim], "
    "block_tables: Tensor[seqs, blocks] (long), length: int) -> (keys, values), each "
    "Tensor[seqs, length, kv_heads, head_dim]: the first `length` tokens of each sequence, in "
    "position order (token p of a sequence sits in block block_tables[s, p // block_size] at "
    "offset p % block_size)",
    reference=_our_gather_kv,
)
def check_gather_kv(gather_kv) -> None:
    """Against the definition, token by token: position p of sequence s is read from block
    block_tables[s, p // block_size], slot p % block_size, for K (kv[0]) and V (kv[1])."""

    @check_settings(max_examples=60)
    @given(
        num_seqs=st.integers(1, 3),
        block_size=st.integers(1, 4),
        blocks_per_seq=st.integers(1, 3),
        kv_heads=st.integers(1, 2),
        head_dim=st.integers(1, 3),
        data=st.data(),
    )
    def property_(num_seqs, block_size, blocks_per_seq, kv_heads, head_dim, data):
        num_blocks = num_seqs * blocks_per_seq + 1
        order = data.draw(st.permutations(range(num_blocks)), label="pool order")
        tables = torch.tensor(order[: num_seqs * blocks_per_seq]).view(num_seqs, blocks_per_seq)
        length = data.draw(st.integers(1, blocks_per_seq * block_size), label="length")
        generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
        kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator)

        keys, values = gather_kv(kv.clone(), tables.clone(), length)
        shape = (num_seqs, length, kv_heads, head_dim)
        assert tuple(keys.shape) == shape and tuple(values.shape) == shape, (
            f"expected keys and values of shape {shape}, got {tuple(keys.shape)} and "
            f"{tuple(values.shape)} (block_tables={tables.tolist()}, length={length})"
        )
        for s in range(num_seqs):
            for p in range(length):
                block, offset = int(tables[s, p // block_size]), p % block_size
                for half, got, name in ((0, keys, "keys"), (1, values, "values")):
                    expected = kv[half, block, offset]
                    assert torch.equal(got[s, p], expected), (
                        f"{name}[{s}, {p}]: sequence {s}'s token at position {p} lives in block "
                        f"{block} (block_tables[{s}][{p // block_size}]) at offset {offset}: "
                        f"expected {show_values(expected)}, got {show_values(got[s, p])} "
                        f"(block_tables={tables.tolist()}, block_size={block_size}, "
                        f"length={length})"
                    )

    property_()
