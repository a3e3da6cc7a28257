"""Chapter 06's learning check: a Triton kernel that stores the step's new K/V into the pool."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check, show_values


def _our_store_kv():
    from minivllm.attention.triton_paged import store_kv

    return store_kv


@learning_check(
    "ch06.store_kv",
    signature="store_kv(kv: Tensor[2, num_blocks, block_size, kv_heads, head_dim], "
    "k: Tensor[tokens, kv_heads, head_dim], v: like k, slot_mapping: Tensor[tokens] (long)) -> "
    "None: a Triton kernel writes token t's K into kv[0] and its V into kv[1] at slot "
    "slot_mapping[t] (block slot // block_size, offset slot % block_size); a slot of -1 is "
    "padding and writes nothing. Run with TRITON_INTERPRET=1 on a CPU.",
    reference=_our_store_kv,
)
def check_store_kv(store_kv) -> None:
    """Against the definition, slot by slot: every real token's K and V rows land at their slot,
    every other slot of the pool keeps its old value."""
    device = "cuda" if torch.cuda.is_available() else "cpu"

    @check_settings(max_examples=30)
    @given(
        block_size=st.integers(1, 4),
        num_blocks=st.integers(1, 4),
        kv_heads=st.integers(1, 3),
        head_dim=st.sampled_from([2, 4, 8]),
        data=st.data(),
    )
    def property_(block_size, num_blocks, kv_heads, head_dim, data):
        num_slots = num_blocks * block_size
        slots = data.draw(
            st.lists(st.integers(0, num_slots - 1), unique=True, min_size=1), label="slots"
        )
        padding = data.draw(
            st.lists(st.booleans(), min_size=len(slots), max_size=len(slots)), label="padding"
        )
        slot_mapping = [-1 if pad else slot for slot, pad in zip(slots, padding)]
        generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
        kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator)
        k = torch.randn(len(slots), kv_heads, head_dim, generator=generator)
        v = torch.randn(len(slots), kv_heads, head_dim, generator=generator)
        got = kv.clone().to(device)
        store_kv(got, k.to(device), v.to(device), torch.tensor(slot_mapping, device=device))
        got = got.cpu()

        expected = kv.clone()
        for token, slot in enumerate(slot_mapping):
            if slot >= 0:
                expected[0, slot // block_size, slot % block_size] = k[token]
                expected[1, slot // block_size, slot % block_size] = v[token]
        for half, name in ((0, "K"), (1, "V")):
            for slot in range(num_slots):
                block, offset = slot // block_size, slot % block_size
                want, have = expected[half, block, offset], got[half, block, offset]
                if not torch.equal(want, have):
                    tokens = [t for t, s in enumerate(slot_mapping) if s == slot]
                    whose = f"token {tokens[0]}'s {name}" if tokens else "its old value"
                    raise AssertionError(
                        f"{name} slot {slot} (block {block}, offset {offset}) should hold {whose}"
                        f": expected {show_values(want)}, got {show_values(have)} "
                        f"(slot_mapping={slot_mapping}, block_size={block_size}, "
                        f"kv_heads={kv_heads}, head_dim={head_dim})"
                    )

    property_()
