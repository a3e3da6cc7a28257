"""Chapter 08 — the rejection sampler: accept draft tokens so that the output is distributed
exactly as the target model's own samples (Leviathan et al. 2023; Chen et al. 2023).

A draft proposed token x with probability q(x); the target model, run once over all the drafts,
gives p(·) at each position. Accept x with probability min(1, p(x) / q(x)). On the first
rejection, draw the replacement from the residual norm(max(0, p − q)) and stop. If every draft
is accepted, the target's distribution after the last one is already computed: draw a bonus
token from it. Why this is exact: a token y comes out at a position with probability

    q(y) · min(1, p(y)/q(y))  +  P(reject) · residual(y)  =  min(q(y), p(y)) + max(0, p(y) − q(y))
                                                          =  p(y).

Special cases fall out of the same rule. An n-gram draft has q = one-hot(x): x is kept with
probability p(x), and the residual is p without x, renormalised. Greedy decoding is the case
p = one-hot(argmax): a draft is kept exactly when it is the target's argmax, and on rejection
the argmax comes out, so greedy speculation gives greedy decoding's tokens.
"""

from __future__ import annotations

import torch

from minivllm.sample.sampler import NOTHING_TO_SAMPLE


class NothingToSample(Exception):
    """A distribution without any mass (the request's logits were all NaN or -inf there): the
    request cannot go on, and ends with this error."""


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens one request emits this step: the accepted drafts, then one more token (the
    residual draw at the first rejection, or the bonus token).

    target_probs: [k + 1, vocab], the target's distribution at each draft position and after
    the last one. draft_probs: [k, vocab], the draft's distributions, or None for drafts that
    were certain (n-gram: q = one-hot).
    """
    emitted = []
    for i, token in enumerate(draft_token_ids):
        p = target_probs[i]
        q = one_hot_like(p, token) if draft_probs is None else draft_probs[i]
        accept_probability = min(1.0, float(p[token]) / max(float(q[token]), 1e-30))
        if uniform(generator) < accept_probability:
            emitted.append(token)
            continue
        residual = (p - q).clamp_min(0.0)
        mass = float(residual.sum())
        # Rounding can leave no residual where p equals q to float precision: p is its limit.
        emitted.append(draw(residual / mass if mass > 0 else p, generator))
        return emitted
    emitted.append(draw(target_probs[len(draft_token_ids)], generator))
    return emitted


def one_hot_like(probs: torch.Tensor, token: int) -> torch.Tensor:
    q = torch.zeros_like(probs)
    q[token] = 1.0
    return q


def uniform(generator: torch.Generator | None) -> float:
    device = "cpu" if generator is None else generator.device
    return float(torch.rand((), generator=generator, device=device))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a distribution (a one-hot one gives its token without a random draw).
    Raises NothingToSample for one without mass."""
    largest = float(probs.max())
    if largest == 1.0:
        return int(probs.argmax())
    if not largest > 0.0:  # all zero (or NaN)
        raise NothingToSample(NOTHING_TO_SAMPLE)
    device = "cpu" if generator is None else generator.device
    return int(torch.multinomial(probs.to(device), 1, generator=generator))
