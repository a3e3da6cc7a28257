"""Chapter 08's solution: the rejection sampler."""

import torch


def rejection_sample(target_probs, draft_token_ids, draft_probs, generator=None):
    emitted = []
    for i, token in enumerate(draft_token_ids):
        p = target_probs[i]
        if draft_probs is None:  # a certain draft: q is one-hot at the token
            q = torch.zeros_like(p)
            q[token] = 1.0
        else:
            q = draft_probs[i]
        if float(torch.rand((), generator=generator)) < min(1.0, float(p[token] / q[token])):
            emitted.append(token)  # kept
            continue
        residual = (p - q).clamp_min(0.0)  # what p has that q over-proposed away from
        emitted.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return emitted
    # Every draft kept: the target's distribution after the last one gives a bonus token.
    emitted.append(
        int(torch.multinomial(target_probs[len(draft_token_ids)], 1, generator=generator))
    )
    return emitted
