"""Chapter 11's learning checks, checked.

Padding a decode step to its CUDA-graph bucket passes on minivllm's own padding
(`GraphInputs.fill`) and on vLLM's padding slot of -1, and fails, with a readable
counterexample, on each typical mistake: the largest bucket instead of the smallest, a bucket
strictly larger than the step, padding rows that write slot 0 (a request's) or another negative
slot, or attend over no token, and a step too large for any graph squeezed into the largest one.

The block tables of a padded step, written into a buffer kept across steps, pass on
`GraphInputs.fill` and fail when a row's newest block alone is written (the rows move when
requests finish), when padding rows keep an earlier step's tables or are zeroed (block 0 is a
request's), and when the tables go to a new tensor instead of the buffer the graph reads."""

from __future__ import annotations

import pytest
import torch

from minivllm.learning_checks import all_checks, assert_check, run_check

NAME = "ch11.pad_decode_step"


def _padded(slot_mapping, seq_lens, bucket, pad_slot, pad_len):
    padding = bucket - len(seq_lens)
    return bucket, slot_mapping + [pad_slot] * padding, seq_lens + [pad_len] * padding


def _largest_bucket(slot_mapping, seq_lens, sizes, padding_block, block_size):
    if len(seq_lens) > sizes[-1]:
        return None, slot_mapping, seq_lens
    return _padded(slot_mapping, seq_lens, sizes[-1], padding_block * block_size, 1)


def _strictly_larger_bucket(slot_mapping, seq_lens, sizes, padding_block, block_size):
    """Pads a step of exactly a recorded size to the next one."""
    fitting = [size for size in sizes if size > len(seq_lens)]
    if not fitting:
        return None, slot_mapping, seq_lens
    return _padded(slot_mapping, seq_lens, min(fitting), padding_block * block_size, 1)


def _padding_in_slot_zero(slot_mapping, seq_lens, sizes, padding_block, block_size):
    fitting = [size for size in sizes if size >= len(seq_lens)]
    if not fitting:
        return None, slot_mapping, seq_lens
    return _padded(slot_mapping, seq_lens, min(fitting), 0, 1)


def _padding_of_length_zero(slot_mapping, seq_lens, sizes, padding_block, block_size):
    fitting = [size for size in sizes if size >= len(seq_lens)]
    if not fitting:
        return None, slot_mapping, seq_lens
    return _padded(slot_mapping, seq_lens, min(fitting), padding_block * block_size, 0)


def _clamped_to_the_largest(slot_mapping, seq_lens, sizes, padding_block, block_size):
    """A step larger than every graph gets the largest one (its rows past it are lost)."""
    fitting = [size for size in sizes if size >= len(seq_lens)] or [sizes[-1]]
    bucket = min(fitting)
    padded = _padded(
        slot_mapping[:bucket], seq_lens[:bucket], bucket, padding_block * block_size, 1
    )
    return padded


def test_the_check_passes_on_minivllm():
    assert_check(NAME, all_checks()[NAME].reference())


@pytest.mark.parametrize(
    "mistake, words",
    [
        (_largest_bucket, "bucket"),
        (_strictly_larger_bucket, "bucket"),
        (_padding_in_slot_zero, "outside the padding block"),
        (_padding_of_length_zero, "attends over 0 tokens"),
        (_clamped_to_the_largest, "bucket"),
    ],
    ids=["largest", "strictly-larger", "slot-zero", "length-zero", "clamped"],
)
def test_the_check_fails_on_a_typical_mistake(mistake, words):
    result = run_check(NAME, mistake)
    assert not result.passed
    assert words in result.report


def _padding_writes_nowhere(slot_mapping, seq_lens, sizes, padding_block, block_size):
    """vLLM's convention: a padding row's slot is -1 (PAD_SLOT_ID), which the store skips."""
    fitting = [size for size in sizes if size >= len(seq_lens)]
    if not fitting:
        return None, slot_mapping, seq_lens
    return _padded(slot_mapping, seq_lens, min(fitting), -1, 1)


def _padding_in_slot_minus_two(slot_mapping, seq_lens, sizes, padding_block, block_size):
    fitting = [size for size in sizes if size >= len(seq_lens)]
    if not fitting:
        return None, slot_mapping, seq_lens
    return _padded(slot_mapping, seq_lens, min(fitting), -2, 1)


def test_a_padding_slot_of_minus_one_passes():
    """-1 writes nothing (the Triton store kernel, the one a graph records, skips it)."""
    assert_check(NAME, _padding_writes_nowhere)


def test_another_negative_padding_slot_fails():
    result = run_check(NAME, _padding_in_slot_minus_two)
    assert not result.passed
    assert "not -1" in result.report


# ch11.fill_block_tables: the block tables of a padded step, in a buffer kept across steps.
TABLES = "ch11.fill_block_tables"


def _whole_tables(buffer, block_tables, size, padding_block):
    for row, table in enumerate(block_tables):
        buffer[row, : len(table)] = torch.tensor(table)


def _newest_block_only(buffer, block_tables, size, padding_block):
    """Writes each row's last block alone, as if every row kept its sequence and grew by one."""
    for row, table in enumerate(block_tables):
        buffer[row, len(table) - 1] = table[-1]
    buffer[len(block_tables) : size, 0] = padding_block


def _padding_rows_left_alone(buffer, block_tables, size, padding_block):
    """The real rows right; rows that were sequences last step keep their old tables."""
    _whole_tables(buffer, block_tables, size, padding_block)


def _padding_rows_zeroed(buffer, block_tables, size, padding_block):
    """Padding rows cleared to 0, as a fresh torch.zeros buffer would hold: block 0 is a
    request's block."""
    _whole_tables(buffer, block_tables, size, padding_block)
    buffer[len(block_tables) : size] = 0


def _a_new_buffer(buffer, block_tables, size, padding_block):
    """Builds the step's tables in a tensor of its own; the graph reads the old one."""
    fresh = torch.full_like(buffer, padding_block)
    _whole_tables(fresh, block_tables, size, padding_block)
    return fresh


def test_the_tables_check_passes_on_minivllm():
    """GraphInputs.fill, the engine's own, as a learner's function."""
    assert_check(TABLES, all_checks()[TABLES].reference())


@pytest.mark.parametrize(
    "mistake, words",
    [
        (_newest_block_only, "write its whole table"),
        (_padding_rows_left_alone, "left there by an earlier step"),
        (_padding_rows_zeroed, "not the padding block"),
        (_a_new_buffer, "in place"),
    ],
    ids=["newest-block-only", "padding-left-alone", "padding-zeroed", "new-buffer"],
)
def test_the_tables_check_fails_on_a_typical_mistake(mistake, words):
    result = run_check(TABLES, mistake)
    assert not result.passed
    assert words in result.report, result.report
