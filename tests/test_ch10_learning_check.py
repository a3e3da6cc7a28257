"""Chapter 10's learning check, checked: applying a token bitmask passes on minivllm's own
masking (xgrammar's kernel) and fails, with a readable counterexample, on each typical mistake:
the bits of a word read in the wrong order, the sign bit lost, a forbidden token's logit set
to 0 instead of -inf."""

from __future__ import annotations

import re

import pytest
import torch

from minivllm.learning_checks import all_checks, assert_check, run_check

NAME = "ch10.apply_bitmask"


def _token_bits(bitmask: torch.Tensor, shifts: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool: bit shifts[j] of word w taken as token 32 * w + j."""
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab].bool()


def _bits_in_reverse_order(logits, bitmask):
    """Reads a word's bits from the top: token 32 * w + j from bit 31 - j."""
    allowed = _token_bits(bitmask, 31 - torch.arange(32, dtype=torch.int32), logits.shape[-1])
    return logits.masked_fill(~allowed, float("-inf"))


def _unsigned_bit_test(logits, bitmask):
    """Tests bit j with `word & (1 << j) > 0`, as if the words were unsigned: on int32,
    1 << 31 is negative, and so is `word & (1 << 31)` when bit 31 is set, so the last token of
    every word is never allowed."""
    powers = 1 << torch.arange(32, dtype=torch.int32)
    allowed = (bitmask.unsqueeze(-1) & powers) > 0
    allowed = allowed.flatten(-2)[..., : logits.shape[-1]]
    return logits.masked_fill(~allowed, float("-inf"))


def _forbidden_set_to_zero(logits, bitmask):
    """Multiplies by the mask: a forbidden token gets logit 0, still a likely token."""
    allowed = _token_bits(bitmask, torch.arange(32, dtype=torch.int32), logits.shape[-1])
    return logits * allowed


def test_the_check_passes_on_minivllm():
    assert_check(NAME, all_checks()[NAME].reference())


@pytest.mark.parametrize(
    "mistake, shown",
    [
        # Only the sign bit is set, and the mistake reads it as token 0.
        (_bits_in_reverse_order, r"token 0: bit 0 of word 0 = -2147483648 .* should be -inf"),
        (_unsigned_bit_test, r"token 31: bit 31 of word 0 = -1 .* is 1, .* got -inf"),
        (_forbidden_set_to_zero, r"is 0, so the logit should be -inf, got -?0 "),
    ],
)
def test_the_check_fails_on_a_typical_mistake(mistake, shown):
    result = run_check(NAME, mistake)
    assert not result.passed and str(result).startswith(f"FAIL {NAME}")
    assert re.search(shown, result.report), result.report
    assert "Falsifying example" in result.report or "Failing explicit example" in result.report
