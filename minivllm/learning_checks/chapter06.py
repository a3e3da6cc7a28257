"""Chapter 06's learning checks: a Triton kernel that stores the step's new K/V into the pool,
and the log-sum-exp merge that turns the attention of a sequence's splits into its attention."""

from __future__ import annotations

import torch
from hypothesis import example, given
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
        head_dim=st.integers(1, 9),  # powers of two and not: a row shorter than its tile
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


def _our_merge_splits():
    from minivllm.attention.triton_paged import combine_splits

    def merge_splits(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
        # The combine kernel takes [seqs, heads, splits, ...]: one sequence, splits inside.
        partial_out = outs.permute(1, 0, 2).unsqueeze(0).contiguous()
        return combine_splits(partial_out, lses.t().unsqueeze(0).contiguous())[0]

    return merge_splits


def _split_lengths() -> st.SearchStrategy[list[int]]:
    """2 to 4 splits of 0 to 12 tokens each (an empty split: a short sequence's last), at least
    one token in all."""
    lengths = st.lists(st.integers(0, 12), min_size=2, max_size=4)
    return lengths.map(lambda split: split if sum(split) else [1] + split[1:])


def _attention(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float64 over `scores [heads, tokens]` and `values [tokens, heads,
    head_dim]`: (output [heads, head_dim], log-sum-exp [heads]); zeros and -inf without tokens."""
    heads, tokens = scores.shape
    if tokens == 0:
        empty = torch.full((heads,), float("-inf"), dtype=scores.dtype)
        return torch.zeros(heads, values.shape[-1], dtype=scores.dtype), empty
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("ht,thd->hd", weights, values), torch.logsumexp(scores, dim=-1)


@learning_check(
    "ch06.merge_splits",
    signature="merge_splits(outs: Tensor[splits, heads, head_dim], lses: Tensor[splits, heads]) "
    "-> Tensor[heads, head_dim]: the attention over all the splits' tokens together, from each "
    "split's own; outs[s] is split s's softmax-normalised output over its tokens and lses[s] "
    "the log of its sum of exp(score) (float32; an empty split has lse -inf and output 0). "
    "Do not overflow where exp(lse) would.",
    reference=_our_merge_splits,
)
def check_merge_splits(merge_splits) -> None:
    """Against softmax over the whole sequence, computed in float64: random scores (at scales
    where exp(lse) overflows float32) and values, head sizes of any length, split anywhere,
    empty splits included."""

    @check_settings(max_examples=40)
    @given(
        heads=st.integers(1, 4),
        head_dim=st.integers(1, 80),
        lengths=_split_lengths(),
        scale=st.sampled_from([1.0, 10.0, 100.0]),
        seed=st.integers(0, 2**16),
    )
    @example(heads=2, head_dim=3, lengths=[5, 0, 2], scale=100.0, seed=0)
    @example(heads=3, head_dim=7, lengths=[4, 6], scale=1.0, seed=1)
    def property_(heads, head_dim, lengths, scale, seed):
        generator = torch.Generator().manual_seed(seed)
        tokens = sum(lengths)
        scores = torch.randn(heads, tokens, generator=generator, dtype=torch.float64) * scale
        values = torch.randn(tokens, heads, head_dim, generator=generator, dtype=torch.float64)
        expected, _ = _attention(scores, values)
        splits, start = [], 0
        for length in lengths:
            splits.append(
                _attention(scores[:, start : start + length], values[start : start + length])
            )
            start += length
        outs = torch.stack([out for out, _ in splits]).float()
        lses = torch.stack([lse for _, lse in splits]).float()
        got = merge_splits(outs.clone(), lses.clone())
        if tuple(got.shape) != (heads, head_dim):
            raise AssertionError(f"expected shape {(heads, head_dim)}, got {tuple(got.shape)}")
        close = torch.isclose(got.double().cpu(), expected, rtol=1e-4, atol=1e-4)
        if not close.all():
            head = int((~close).any(dim=-1).nonzero()[0])
            raise AssertionError(
                f"head {head}: expected {show_values(expected[head])}, got "
                f"{show_values(got[head])} (split lengths {lengths}, lses of head {head}: "
                f"{[round(float(x), 3) for x in lses[:, head]]}, head_dim {head_dim})"
            )

    property_()
