"""Chapter 10's solution: applying a grammar's token bitmask to the logits."""

import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Every token whose bit is 0 gets the logit -inf; bit j of word w is token 32 * w + j."""
    vocab = logits.shape[-1]
    # Shift each word right by 0..31 and keep the lowest bit. On int32 the shift is arithmetic:
    # the sign bit copies itself downward, but the one kept is still bit j, so bit 31 (the sign)
    # reads like any other.
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    allowed = bits.flatten(-2)[..., :vocab].bool()  # token order; bits past the vocab dropped
    return logits.masked_fill(~allowed, float("-inf"))
