"""Chapter 11's learning check: padding a decode step to its CUDA-graph bucket.

A recorded graph replays one batch size, so a step of n decodes is padded to the smallest
recorded size that holds it, and a step larger than every recorded size runs without a graph.
The padding rows go through every kernel like real ones, so each must be harmless: its K/V are
written into the padding block (a block no request owns, never slot 0, which a request may
hold), and it attends over at least one token (a length of 0 divides by an empty softmax) and
no more than the padding block holds.
"""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check


def _our_pad_decode_step():
    import torch

    from minivllm.compilation.cuda_graphs import GraphInputs, bucket_for

    def pad_decode_step(slot_mapping, seq_lens, sizes, padding_block, block_size):
        bucket = bucket_for(len(seq_lens), sizes)
        if bucket is None:
            return None, list(slot_mapping), list(seq_lens)
        inputs = GraphInputs.allocate(bucket, 1, padding_block, torch.device("cpu"))
        real = len(seq_lens)
        tables = [[padding_block]] * real
        inputs.fill([0] * real, [0] * real, slot_mapping, seq_lens, tables, bucket, block_size)
        return bucket, inputs.slot_mapping.tolist(), inputs.seq_lens.tolist()

    return pad_decode_step


@st.composite
def decode_steps(draw):
    """(slot_mapping, seq_lens, sizes, padding_block, block_size): a decode step of sequences
    whose slots lie outside the padding block, and recorded sizes as vLLM chooses them."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    max_num_seqs = draw(st.integers(1, 40))
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 8)
    sizes = sizes[: next(i for i, s in enumerate(sizes) if s >= max_num_seqs) + 1]
    num_seqs = draw(st.integers(1, sizes[-1] + 3))
    padding_block = draw(st.integers(0, 50))
    padding_slots = range(padding_block * block_size, (padding_block + 1) * block_size)
    slot = st.integers(0, 60 * block_size).filter(lambda s: s not in padding_slots)
    slot_mapping = draw(st.lists(slot, min_size=num_seqs, max_size=num_seqs))
    seq_lens = draw(st.lists(st.integers(1, 300), min_size=num_seqs, max_size=num_seqs))
    return slot_mapping, seq_lens, sizes, padding_block, block_size


@learning_check(
    "ch11.pad_decode_step",
    signature="pad_decode_step(slot_mapping: list[int], seq_lens: list[int], sizes: list[int], "
    "padding_block: int, block_size: int) -> (bucket: int | None, slot_mapping, seq_lens): the "
    "smallest recorded size that holds the step, and both lists padded to it with harmless "
    "rows (their K/V written in the padding block, their length at least 1 and at most "
    "block_size); (None, the lists unchanged) when no size holds it",
    reference=_our_pad_decode_step,
)
def check_pad_decode_step(pad_decode_step) -> None:
    """The bucket is the smallest recorded size >= the step's rows (None past the largest);
    the real rows come first, unchanged; every padding row writes into the padding block and
    attends over 1..block_size tokens."""

    @check_settings(max_examples=80)
    @given(step=decode_steps())
    # Three rows with sizes 1, 2, 4: the smallest bucket is 4 (not 8, not the largest).
    @example(step=([5, 9, 13], [3, 7, 2], [1, 2, 4, 8], 7, 4))
    # Slot 0 belongs to a request here; the padding block is block 3.
    @example(step=([0, 6], [5, 2], [1, 2, 4], 3, 4))
    def property_(step):
        slot_mapping, seq_lens, sizes, padding_block, block_size = step
        bucket, padded_slots, padded_lens = pad_decode_step(
            list(slot_mapping), list(seq_lens), list(sizes), padding_block, block_size
        )
        fitting = [size for size in sizes if size >= len(seq_lens)]
        expected_bucket = min(fitting) if fitting else None
        assert bucket == expected_bucket, (
            f"{len(seq_lens)} rows with recorded sizes {sizes}: bucket {bucket}, "
            f"expected {expected_bucket}"
        )
        if bucket is None:
            assert list(padded_slots) == slot_mapping and list(padded_lens) == seq_lens, (
                "a step no graph holds runs as it is: its lists unchanged"
            )
            return
        assert len(padded_slots) == len(padded_lens) == bucket, (
            f"padded to {len(padded_slots)} slots and {len(padded_lens)} lengths, not {bucket}"
        )
        real = len(seq_lens)
        assert list(padded_slots[:real]) == slot_mapping, "the real rows' slots changed"
        assert list(padded_lens[:real]) == seq_lens, "the real rows' lengths changed"
        first, last = padding_block * block_size, (padding_block + 1) * block_size - 1
        for row in range(real, bucket):
            assert first <= padded_slots[row] <= last, (
                f"padding row {row} writes slot {padded_slots[row]}, outside the padding "
                f"block {padding_block} (slots {first}..{last}): a request's K/V would change"
            )
            assert 1 <= padded_lens[row] <= block_size, (
                f"padding row {row} attends over {padded_lens[row]} tokens; 1..{block_size} "
                "(its one block) are harmless"
            )

    property_()
