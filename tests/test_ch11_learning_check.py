"""Chapter 11's learning check, checked: padding a decode step to its CUDA-graph bucket passes
on minivllm's own padding (`GraphInputs.fill`) and fails, with a readable counterexample, on
each typical mistake: the largest bucket instead of the smallest, a bucket strictly larger than
the step, padding rows that write slot 0 (a request's) or attend over no token, and a step too
large for any graph squeezed into the largest one."""

from __future__ import annotations

import pytest

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
