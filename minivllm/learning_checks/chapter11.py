"""Chapter 11's learning checks: padding a decode step to its CUDA-graph bucket, and the
block tables of a padded step.

A recorded graph replays one batch size, so a step of n decodes is padded to the smallest
recorded size that holds it, and a step larger than every recorded size runs without a graph.
The padding rows go through every kernel like real ones, so each must be harmless: its K/V are
written into the padding block (a block no request owns, never slot 0, which a request may
hold) or nowhere (slot -1, vLLM's PAD_SLOT_ID, which the Triton store kernel skips), and it
attends over at least one token (a length of 0 divides by an empty softmax) and no more than
the padding block holds.

The block tables live in a buffer the graph reads in place, kept from step to step. A row
holds whichever sequence sits there this step: when requests finish, the rows move, so a row's
table must be written whole, not just its newest block; and a row that was a sequence's last
step is padding now, whose table must name the padding block, not the blocks it held before.
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
    "rows (their K/V written in the padding block, or nowhere with slot -1; their length at "
    "least 1 and at most block_size); (None, the lists unchanged) when no size holds it",
    reference=_our_pad_decode_step,
)
def check_pad_decode_step(pad_decode_step) -> None:
    """The bucket is the smallest recorded size >= the step's rows (None past the largest);
    the real rows come first, unchanged; every padding row writes into the padding block (or
    nowhere: slot -1) and attends over 1..block_size tokens."""

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
            # -1 writes nothing: the store kernel a graph records skips negative slots.
            assert padded_slots[row] == -1 or first <= padded_slots[row] <= last, (
                f"padding row {row} writes slot {padded_slots[row]}, outside the padding "
                f"block {padding_block} (slots {first}..{last}) and not -1 (write nothing): a "
                "request's K/V would change"
            )
            assert 1 <= padded_lens[row] <= block_size, (
                f"padding row {row} attends over {padded_lens[row]} tokens; 1..{block_size} "
                "(its one block) are harmless"
            )

    property_()


def _our_fill_block_tables():
    import weakref

    import torch

    from minivllm.compilation.cuda_graphs import GraphInputs

    # The engine's GraphInputs remembers what each row of its tables holds, so it needs one per
    # buffer: the check fills one buffer over several steps, then starts a new one.
    writers: dict[int, tuple[weakref.ref, GraphInputs]] = {}

    def fill_block_tables(buffer, block_tables, size, padding_block):
        known = writers.get(id(buffer))
        if known is None or known[0]() is not buffer:
            rows, width = buffer.shape
            inputs = GraphInputs.allocate(rows, width, padding_block, torch.device("cpu"))
            inputs.block_tables = buffer  # the buffer the graph reads: fill's copy lands here
            writers[id(buffer)] = (weakref.ref(buffer), inputs)
        inputs = writers[id(buffer)][1]
        real = len(block_tables)
        inputs.fill([0] * real, [0] * real, [0] * real, [1] * real, block_tables, size, 1)

    return fill_block_tables


@st.composite
def decode_step_sequences(draw):
    """(max_size, width, padding_block, steps): the decode steps of one engine in a row, each
    (block_tables, size). Between steps some requests finish (the rows after them move up),
    some arrive (at the end), and the others may grow by a block; size is the step's bucket."""
    num_blocks = draw(st.integers(4, 40))
    padding_block = draw(st.integers(0, num_blocks - 1))
    block = st.integers(0, num_blocks - 2).map(lambda b: b + (b >= padding_block))
    width = draw(st.integers(1, 5))
    max_num_seqs = draw(st.integers(1, 12))
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 8)
    sizes = sizes[: next(i for i, s in enumerate(sizes) if s >= max_num_seqs) + 1]
    table = st.lists(block, min_size=1, max_size=width)
    live: list[list[int]] = []
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        live = [t for t in live if not draw(st.booleans())]  # these finish
        live = [t + [draw(block)] if len(t) < width and draw(st.booleans()) else t for t in live]
        arriving = draw(st.lists(table, min_size=0 if live else 1, max_size=3))
        live = (live + arriving)[:max_num_seqs]
        size = next(s for s in sizes if s >= len(live))
        steps.append(([list(t) for t in live], size))
    return sizes[-1], width, padding_block, steps


def _stale(before, row: int, column: int, got: int) -> str:
    if got != before[row, column].item():
        return ""
    return " (left there by an earlier step: the buffer keeps what earlier steps wrote)"


@learning_check(
    "ch11.fill_block_tables",
    signature="fill_block_tables(buffer: Tensor[max_size, width] int64, block_tables: "
    "list[list[int]], size: int, padding_block: int) -> None: write one decode step's block "
    "tables into the persistent buffer, in place; row i < len(block_tables) begins with "
    "block_tables[i] (the row's sequence may differ from the last step's), rows "
    "len(block_tables)..size-1 are padding rows of one token, whose table begins with "
    "padding_block; the buffer keeps what earlier calls wrote",
    reference=_our_fill_block_tables,
)
def check_fill_block_tables(fill_block_tables) -> None:
    """Over several steps on one buffer: every real row reads exactly its sequence's blocks,
    and every padding row reads the padding block, whatever the buffer held before."""
    import torch

    @check_settings(max_examples=60)
    @given(case=decode_step_sequences())
    # Four sequences, then the first finishes: the rows move up (row 1 now holds [4, 5], not
    # [3] grown by a block), and row 3 becomes padding while it still names block 6.
    @example(case=(4, 3, 9, [([[1, 2], [3], [4, 5], [6]], 4), ([[3], [4, 5], [6, 7]], 4)]))
    def property_(case):
        max_size, width, padding_block, steps = case
        # As the engine allocates it: every entry the padding block.
        buffer = torch.full((max_size, width), padding_block, dtype=torch.long)
        for number, (tables, size) in enumerate(steps):
            before = buffer.clone()
            returned = fill_block_tables(buffer, [list(t) for t in tables], size, padding_block)
            step = f"step {number + 1} of {len(steps)} ({len(tables)} sequences, bucket {size})"
            if torch.equal(buffer, before) and returned is not None:
                raise AssertionError(
                    f"{step}: the buffer did not change and fill_block_tables returned a "
                    f"{type(returned).__name__}: write into `buffer` in place (buffer[row, "
                    "column] = ...), since the recorded graph reads that tensor's memory"
                )
            assert tuple(buffer.shape) == (max_size, width), "the buffer's shape changed"
            for row, table in enumerate(tables):
                got = buffer[row, : len(table)].tolist()
                if got != table:
                    column = next(c for c, (a, b) in enumerate(zip(got, table)) if a != b)
                    raise AssertionError(
                        f"{step}: row {row}'s sequence has the blocks {table}, but the buffer "
                        f"gives it {got}: column {column} holds block {got[column]}"
                        f"{_stale(before, row, column, got[column])}, so its attention would "
                        "read another sequence's K/V. When requests finish the rows move up, "
                        "so a row may hold another sequence than last step: write its whole "
                        "table, not only its newest block"
                    )
            for row in range(len(tables), size):
                got = buffer[row, 0].item()
                assert got == padding_block, (
                    f"{step}: row {row} is padding (one token), but its table begins with "
                    f"block {got}{_stale(before, row, 0, got)}, not the padding block "
                    f"{padding_block}: a padding row must read the block it writes, which no "
                    "request owns, whatever sat in this row before"
                )

    property_()
