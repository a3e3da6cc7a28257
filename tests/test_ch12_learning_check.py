"""Chapter 12's learning check, checked: int4 group-wise quantization passes on minivllm's own
(`models/quantization.py`) and fails, with a readable counterexample, on each typical mistake:
one scale for the whole tensor or the whole row instead of one per group, 16 steps instead of 15,
floor instead of round, and a dequantization that forgets the minimum."""

from __future__ import annotations

import pytest
import torch

from minivllm.learning_checks import all_checks, assert_check, run_check

NAME = "ch12.quantize_int4"


def _quantize(weight, group_size, low, high, levels=15, rounding=torch.round, add_minimum=True):
    """The scheme with its range (`low`, `high` broadcast over [N, groups, group_size]) and its
    details as parameters, so that each mistake below changes one of them."""
    rows, columns = weight.shape
    groups = weight.reshape(rows, columns // group_size, group_size)
    low = torch.broadcast_to(low, groups.shape[:2])
    high = torch.broadcast_to(high, groups.shape[:2])
    scale = (high - low) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = rounding((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    back = q * scale[..., None] + (low[..., None] if add_minimum else 0)
    return q.reshape(rows, columns), scale, low, back.reshape(rows, columns)


def _ranges_of_groups(weight, group_size):
    """Each group's own minimum and maximum, [N, groups] each."""
    rows, columns = weight.shape
    groups = weight.reshape(rows, columns // group_size, group_size)
    return groups.amin(-1), groups.amax(-1)


def _scale_per_tensor(weight, group_size):
    """One minimum and one scale for the whole matrix."""
    return _quantize(weight, group_size, weight.min(), weight.max())


def _scale_per_row(weight, group_size):
    """One range per row, as int8 does: too coarse for 16 levels."""
    return _quantize(weight, group_size, weight.amin(1, keepdim=True), weight.amax(1, keepdim=True))


def _sixteen_steps(weight, group_size):
    """(max - min) / 16: the group's largest weight falls past the last level."""
    return _quantize(weight, group_size, *_ranges_of_groups(weight, group_size), levels=16)


def _floor(weight, group_size):
    """Truncates to the level below instead of rounding to the nearest."""
    low, high = _ranges_of_groups(weight, group_size)
    return _quantize(weight, group_size, low, high, rounding=torch.floor)


def _dequantize_without_minimum(weight, group_size):
    """Reads back q * scale, forgetting the group's minimum."""
    low, high = _ranges_of_groups(weight, group_size)
    return _quantize(weight, group_size, low, high, add_minimum=False)


def test_the_check_passes_on_minivllm():
    assert_check(NAME, all_checks()[NAME].reference())


@pytest.mark.parametrize(
    "mistake, words",
    [
        (_scale_per_tensor, "expected the group's own minimum"),
        (_scale_per_row, "expected the group's own minimum"),
        (_sixteen_steps, "16 levels are 15 steps apart"),
        (_floor, "half a step"),
        (_dequantize_without_minimum, "does not follow the scheme"),
    ],
    ids=["per-tensor", "per-row", "16-steps", "floor", "no-minimum"],
)
def test_the_check_fails_on_a_typical_mistake(mistake, words):
    result = run_check(NAME, mistake)
    assert not result.passed
    assert words in result.report


# --- Q4_1's nibble order -------------------------------------------------------------------------

PACK = "ch12.pack_q4_1"


def _pack_neighbours(q):
    """Levels 2j and 2j + 1 in one byte: the order most people guess first."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _pack_high_first(q):
    """Q4_1's pairs, level j in the high nibble instead of the low one."""
    rows, columns = q.shape
    halves = q.to(torch.uint8).reshape(rows, columns // 32, 2, 16)
    return ((halves[:, :, 0] << 4) | halves[:, :, 1]).reshape(rows, columns // 2)


def test_the_packing_check_passes_on_minivllm():
    assert_check(PACK, all_checks()[PACK].reference())


@pytest.mark.parametrize(
    "mistake, words",
    [
        (_pack_neighbours, "neighbours 2j and 2j + 1"),
        (_pack_high_first, "the low 4 bits hold level j"),
    ],
    ids=["neighbours", "high-first"],
)
def test_the_packing_check_fails_on_a_typical_mistake(mistake, words):
    result = run_check(PACK, mistake)
    assert not result.passed
    assert words in result.report
