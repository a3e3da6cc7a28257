"""Chapter 10's learning check: applying a grammar's token bitmask to the logits.

A grammar's matcher says which tokens may come next as a packed bitmask, one bit per token in
int32 words: bit j of word w is token 32 * w + j. Every token whose bit is 0 gets the logit
-inf, so the sampler can never pick it. Two details trip learners up: the words are *signed*,
so bit 31 is the sign bit (a word of -1 allows all 32 of its tokens), and the last word may
cover tokens past the vocabulary, whose bits mean nothing.
"""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check

INT32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def bitmasks(draw) -> tuple[int, list[list[int]]]:
    """(vocab, words): a vocabulary size, often not a multiple of 32, and one row of
    ceil(vocab / 32) int32 words per logits row."""
    vocab = draw(st.integers(1, 100))
    num_words = -(-vocab // 32)
    row = st.lists(INT32, min_size=num_words, max_size=num_words)
    return vocab, draw(st.lists(row, min_size=1, max_size=3))


def _our_apply_bitmask():
    from minivllm.structured_output.manager import apply_token_bitmasks

    def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        masked = logits.clone()
        apply_token_bitmasks(masked, list(range(logits.shape[0])), bitmask)
        return masked

    return apply_bitmask


def _allowed(word: int, bit: int) -> bool:
    """Bit `bit` of a signed 32-bit word. Python's >> on a negative int is an arithmetic shift,
    as on the int32 it came from, so the sign bit reads as bit 31 like any other."""
    return (word >> bit) & 1 == 1


@learning_check(
    "ch10.apply_bitmask",
    signature="apply_bitmask(logits: Tensor[rows, vocab] float32, bitmask: Tensor[rows, "
    "ceil(vocab / 32)] int32) -> Tensor[rows, vocab]: the logits, with -inf for every token "
    "whose bit is 0 (bit j of word w is token 32 * w + j; bit 31 is the int32 sign bit; bits "
    "past the vocabulary are ignored)",
    reference=_our_apply_bitmask,
)
def check_apply_bitmask(apply_bitmask) -> None:
    """Equals the definition, token by token: the logit is kept where the token's bit is 1
    and is -inf where it is 0."""

    @check_settings(max_examples=60)
    @given(case=bitmasks(), seed=st.integers(0, 2**16))
    # Words a random draw may miss: -1 (all 32 tokens allowed), the sign bit alone, one token
    # per word.
    @example(case=(32, [[-1]]), seed=0)
    @example(case=(40, [[-(2**31), 1]]), seed=0)
    @example(case=(36, [[1, 2]]), seed=0)
    def property_(case, seed):
        vocab, words = case
        logits = torch.randn(len(words), vocab, generator=torch.Generator().manual_seed(seed))
        got = apply_bitmask(logits.clone(), torch.tensor(words, dtype=torch.int32))
        assert isinstance(got, torch.Tensor) and got.shape == logits.shape, (
            f"expected a tensor of shape {list(logits.shape)}, got "
            f"{list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
        )
        for row, (row_words, row_logits, row_got) in enumerate(
            zip(words, logits.tolist(), got.tolist())
        ):
            for token in range(vocab):
                word, bit = row_words[token // 32], token % 32
                expected = row_logits[token] if _allowed(word, bit) else float("-inf")
                assert row_got[token] == expected, (
                    f"row {row}, token {token}: bit {bit} of word {token // 32} = {word} "
                    f"(bits 31..0: {word & 0xFFFFFFFF:032b}) is {int(_allowed(word, bit))}, so "
                    f"the logit should be {expected:.4g}, got {row_got[token]:.4g} "
                    f"(vocab {vocab}, bitmask {words})"
                )

    property_()
