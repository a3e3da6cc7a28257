"""Chapter 08 — what the model runner hands a proposer, and what it gets back.

After every step the runner asks its proposer for the next step's drafts, for all the
requests that just received tokens at once (a draft model runs them as one batch). A proposer
is anything with `propose_batch(requests) -> proposals`: the n-gram lookup
(`ngram_proposer.py`) or a draft model (`draft_model_proposer.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.sample.sampler import SamplingRow


@dataclass
class ProposalRequest:
    """One request the proposer guesses for."""

    req_id: str
    token_ids: list[int]  # prompt + output, this step's new tokens included
    block_ids: list[int]  # its block table (a draft model keeps its own K/V in the same slots)
    num_draft_cached: int  # leading tokens whose K/V the draft model already holds
    row: SamplingRow  # how the request samples: the draft samples the same way


@dataclass
class Proposal:
    """The drafts for one request, and the distributions they were drawn from."""

    token_ids: list[int]
    # [len(token_ids), vocab], the draft's distribution at each position (the q of the
    # rejection rule); None when each draft was certain (n-gram lookups, greedy drafts): q is
    # then one-hot at the draft token.
    probs: torch.Tensor | None = None
    # A draft model: the request's leading tokens it holds K/V for afterwards (all of them,
    # unless its catch-up was cut by the token budget). None: the proposer keeps no K/V.
    num_draft_cached: int | None = None
