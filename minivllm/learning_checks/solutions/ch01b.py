"""Solutions to chapter 01b's exercises: top-k, top-p and min-p filters, and vLLM's penalties.

Each filter takes one row of logits and returns it with -inf where a token is removed, so the
next filter (and finally softmax) simply never sees that token again: exp(-inf) = 0.
"""

import torch

REMOVED = float("-inf")


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits, and every token tied with the k-th largest."""
    vocab_size = logits.shape[-1]
    if k <= 0 or k >= vocab_size:  # k = 0 means "top-k off"; k >= vocab keeps everything
        return logits.clone()
    kth_largest = torch.sort(logits, descending=True).values[k - 1]
    # Comparing with the k-th largest *value* keeps ties with it; torch.topk would keep exactly
    # k tokens and choose among the tied ones arbitrarily.
    return logits.masked_fill(logits < kth_largest, REMOVED)


def top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the shortest run of most likely tokens whose probability adds up to at least p."""
    if p >= 1.0:  # a float sum may never reach exactly 1.0, so do not trust it to
        return logits.clone()
    # stable=True: equal logits stay in token-id order, so ties are broken by token id.
    sorted_logits, sorted_ids = torch.sort(logits, descending=True, stable=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # The probability of everything ranked above each token: 0 for the first token, then the
    # running sum up to (not including) the token itself.
    mass_above = torch.cat([torch.zeros(1), torch.cumsum(sorted_probs, dim=-1)[:-1]])
    # A token is needed only while the tokens above it have not reached p yet. So the token
    # that crosses p is kept, and the most likely token (mass above = 0 < p) always is.
    remove_sorted = mass_above >= p
    remove = torch.zeros_like(remove_sorted)
    remove[sorted_ids] = remove_sorted  # back from rank order to token-id order
    return logits.masked_fill(remove, REMOVED)


def min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Remove the tokens whose probability is below min_p times the largest probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.max()  # relative to the most likely token, not an absolute floor
    return logits.masked_fill(probs < threshold, REMOVED)


def penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    repetition_penalty: float,
    presence_penalty: float,
    frequency_penalty: float,
) -> torch.Tensor:
    """vLLM's penalties: repetition for tokens seen anywhere (prompt or output), then presence
    and frequency for tokens in the output."""
    penalised = logits.clone()
    seen = set(prompt_token_ids) | set(output_token_ids)
    for token in seen:
        # Dividing a negative logit would make it *larger*; multiplying it pushes it down.
        if penalised[token] > 0:
            penalised[token] = penalised[token] / repetition_penalty
        else:
            penalised[token] = penalised[token] * repetition_penalty
    for token in set(output_token_ids):
        count = output_token_ids.count(token)
        penalised[token] -= frequency_penalty * count + presence_penalty
    return penalised
