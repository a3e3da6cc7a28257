"""Chapter 08's learning check: the rejection sampler of speculative decoding."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check, show_values

# One fixed case for the distribution: a target p and a draft q that disagree, so that a
# wrong rule (say, resampling from p instead of the residual max(0, p - q)) is far off.
TARGET = torch.tensor([0.5, 0.3, 0.1, 0.1])
DRAFT = torch.tensor([0.1, 0.2, 0.6, 0.1])
TRIALS = 4000
TOLERANCE = 0.035  # total variation; sampling noise is about 0.01 at 4,000 draws
# The one-hot path (an n-gram draft, draft_probs None) and the bonus row: fewer draws each,
# a looser bound (noise about 0.016 at 2,000 draws; each mistake below is 0.3 or more off).
PATH_TRIALS = 2000
PATH_TOLERANCE = 0.06
BONUS_TARGET = torch.tensor([0.1, 0.2, 0.3, 0.4])


def _assert_follows(tokens: list[int], expected: torch.Tensor, tolerance: float, what: str):
    """Raise, saying `what` ("the first emitted token should follow p"), unless the tokens'
    frequencies are within `tolerance` (total variation) of `expected`."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).float()
    observed = counts / counts.sum()
    distance = 0.5 * float((observed - expected).abs().sum())
    if distance > tolerance:
        raise AssertionError(
            f"{what} = {show_values(expected)}, but over {len(tokens)} draws it followed "
            f"{show_values(observed)} (total variation {distance:.3f})"
        )


def _our_rejection_sample():
    from minivllm.spec_decode.rejection_sampler import rejection_sample

    return rejection_sample


@learning_check(
    "ch08.rejection_sample",
    signature="rejection_sample(target_probs: Tensor[k+1, vocab], draft_token_ids: list[int] "
    "(k of them), draft_probs: Tensor[k, vocab] | None (None: each draft was certain, q = "
    "one-hot), generator: torch.Generator | None) -> list[int]: keep draft i with probability "
    "min(1, p_i(x) / q_i(x)); at the first rejection emit a token drawn from max(0, p_i - q_i) "
    "renormalised and stop; if all are kept, emit a bonus token drawn from target_probs[k].",
    reference=_our_rejection_sample,
)
def check_rejection_sample(rejection_sample) -> None:
    """Greedy targets (one-hot) must give exactly the greedy tokens; over many seeded draws the
    first emitted token must follow the target distribution, not the draft's, with a drafted
    distribution and with a certain (n-gram) draft alike; and when every draft is kept, the
    bonus token must follow the row after the last draft."""

    @check_settings(max_examples=25)
    @given(
        vocab=st.integers(2, 5),
        argmaxes=st.lists(st.integers(0, 4), min_size=2, max_size=4),
        drafts=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    )
    def greedy_property(vocab, argmaxes, drafts):
        argmaxes = [a % vocab for a in argmaxes]
        drafts = [d % vocab for d in drafts][: len(argmaxes) - 1]
        target = torch.eye(vocab)[argmaxes[: len(drafts) + 1]]
        expected = []
        for draft, best in zip(drafts, argmaxes):
            expected.append(best)  # a kept draft is the argmax; a rejected one is replaced by it
            if draft != best:
                break
        else:
            expected.append(argmaxes[len(drafts)])  # the bonus token
        got = rejection_sample(target, drafts, None, torch.Generator().manual_seed(0))
        if list(got) != expected:
            raise AssertionError(
                f"greedy targets (argmax per position {argmaxes[: len(drafts) + 1]}), drafts "
                f"{drafts}: expected {expected}, got {list(got)}"
            )

    greedy_property()
    generator = torch.Generator().manual_seed(0)
    first_tokens = []
    for _ in range(TRIALS):
        draft = int(torch.multinomial(DRAFT, 1, generator=generator))
        emitted = rejection_sample(torch.stack([TARGET, TARGET]), [draft], DRAFT[None], generator)
        first_tokens.append(int(emitted[0]))
    _assert_follows(
        first_tokens,
        TARGET,
        TOLERANCE,
        f"drafts drawn from q = {show_values(DRAFT)}: the first emitted token should follow p",
    )

    # An n-gram draft is certain (draft_probs None: q is one-hot at the draft): the draft is
    # kept with probability p(draft), and a rejection draws from p without the draft.
    draft = 0  # the target's likeliest token: a wrong rejection rule shows most here
    first_tokens = [
        int(rejection_sample(torch.stack([TARGET, TARGET]), [draft], None, generator)[0])
        for _ in range(PATH_TRIALS)
    ]
    _assert_follows(
        first_tokens,
        TARGET,
        PATH_TOLERANCE,
        f"a certain draft (draft_probs None, q one-hot at token {draft}): the first emitted "
        "token should follow p",
    )

    # Every draft kept: the bonus token comes from the row after the last draft, target_probs[k].
    certain = torch.eye(len(BONUS_TARGET))[[1, 3]]  # drafts 1 then 3, both the target's choice
    rows = torch.cat([certain, BONUS_TARGET[None]])
    bonus_tokens = []
    for _ in range(PATH_TRIALS):
        emitted = rejection_sample(rows, [1, 3], None, generator)
        if list(emitted[:2]) != [1, 3] or len(emitted) != 3:
            raise AssertionError(
                f"drafts [1, 3] that the target is certain of must both be kept and followed by "
                f"one bonus token; got {list(emitted)}"
            )
        bonus_tokens.append(int(emitted[2]))
    _assert_follows(
        bonus_tokens,
        BONUS_TARGET,
        PATH_TOLERANCE,
        "both drafts kept: the bonus token should follow target_probs[k] (the row after the "
        "last draft)",
    )
