"""Chapter 08 — the n-gram proposer (prompt lookup): guess the next tokens by finding the
sequence's latest n tokens earlier in the sequence and copying what followed them there.

    tokens:  ... def area(r): return 3.14 * r * r ... print(area(2)) ... return 3.14 *
                                                                          ^^^^^^^^^^^^^ the
    latest 3 tokens, "return 3.14 *", also occur earlier: propose what followed them, " r * r".

Copying workloads (editing code, summaries that quote, answers that repeat the question) are
full of such repeats, and finding them costs nothing next to a forward pass. The longest match
(from `prompt_lookup_max` tokens down to `prompt_lookup_min`) wins, and among equal lengths the
most recent occurrence, the likeliest to continue the same way.
"""

from __future__ import annotations

import numpy as np

from minivllm.spec_decode.proposal import Proposal, ProposalRequest


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_batch(self, requests: list[ProposalRequest]) -> list[Proposal]:
        return [Proposal(self.propose(request.token_ids)) for request in requests]

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (prompt + output), [] when nothing matches."""
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # Every earlier window of n tokens (the suffix itself excluded: each window must be
            # followed by at least one token to copy).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if len(matches):
                start = matches[-1] + n  # what followed the most recent occurrence
                return tokens[start : start + self.k].tolist()
        return []
