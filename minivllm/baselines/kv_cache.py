"""Chapter 02 — the KV cache: compute each token's keys and values once, keep them, reuse them.

In chapter 01 every step recomputed K and V of the whole sequence, although only the new
token's are new. Here each sequence owns a contiguous row of `max_len` slots per layer:

    keys[layer]:   [batch, max_len, num_kv_heads, head_dim]     (values: the same)

Generation becomes two phases:
- prefill: run the prompt once, write its K/V into slots 0..len-1, sample the first token;
- decode: run only the newest token, write its K/V at slot `len`, attend over slots 0..len.

Static batching runs several sequences together: one prefill for all prompts, then decode
steps for the whole batch until its *longest* member is done. Two costs are visible here and
motivate the next chapters: every row reserves `max_len` slots whether it uses them or not
(chapter 03 allocates in small blocks instead), and rows that finished early keep occupying
the batch until the last one ends (chapter 04 refills the batch every step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.baselines.naive import causal_attention
from minivllm.config import ModelConfig
from minivllm.core.request import Request
from minivllm.models.llama import LlamaForCausalLM
from minivllm.sample.sampler import Sampler


class ContiguousKVCache:
    """K and V of a batch of sequences, each in its own preallocated row of `max_len` slots."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (config.num_layers, batch_size, max_len, config.num_kv_heads, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @property
    def reserved_bytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def prefill(self, prompt_lengths: list[int]) -> PrefillAttention:
        """Attention for a flat batch holding every row's whole prompt, row after row."""
        return PrefillAttention(self, prompt_lengths)

    def decode(self, seq_lens: torch.Tensor) -> DecodeAttention:
        """Attention for one new token per row; row b's token goes to slot seq_lens[b] - 1."""
        return DecodeAttention(self, seq_lens)


@dataclass
class PrefillAttention:
    """Writes each prompt's K/V into its row, then attends causally within the prompt."""

    cache: ContiguousKVCache
    prompt_lengths: list[int]

    def __call__(self, layer_index: int, q, k, v) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for row, length in enumerate(self.prompt_lengths):
            end = start + length
            self.cache.keys[layer_index, row, :length] = k[start:end]
            self.cache.values[layer_index, row, :length] = v[start:end]
            out[start:end] = causal_attention(q[start:end], k[start:end], v[start:end])
            start = end
        return out


@dataclass
class DecodeAttention:
    """One query per row against that row's cached keys: a batched matrix product.

    Rows have different lengths, so slots past a row's length are masked out. The mask is
    where static batching's padding shows up: every row pays for the longest row's slots.
    """

    cache: ContiguousKVCache
    seq_lens: torch.Tensor  # [batch], length of each row *including* the new token

    def __post_init__(self):
        self.longest = int(self.seq_lens.max())
        slots = torch.arange(self.longest, device=self.seq_lens.device)
        # [batch, 1 (heads), 1 (query), slots]: True where the slot holds one of the row's tokens
        self.mask = (slots[None, :] < self.seq_lens[:, None])[:, None, None, :]
        self.rows = torch.arange(len(self.seq_lens), device=self.seq_lens.device)

    def __call__(self, layer_index: int, q, k, v) -> torch.Tensor:
        keys, values = self.cache.keys[layer_index], self.cache.values[layer_index]
        keys[self.rows, self.seq_lens - 1] = k
        values[self.rows, self.seq_lens - 1] = v
        # [batch, heads, 1, head_dim] queries against [batch, kv_heads, slots, head_dim] keys
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],
            keys[:, : self.longest].transpose(1, 2),
            values[:, : self.longest].transpose(1, 2),
            attn_mask=self.mask,
            enable_gqa=True,
        )
        return out[:, :, 0, :]


@dataclass
class StaticBatchStats:
    """What a static batch cost: steps run, and how many of the computed rows were wasted."""

    decode_steps: int = 0
    computed_rows: int = 0  # decode rows computed, finished or not
    useful_rows: int = 0  # decode rows that produced a token someone wanted
    reserved_kv_bytes: int = 0


@torch.inference_mode()
def generate_static_batch(
    model: LlamaForCausalLM, requests: list[Request], sampler: Sampler
) -> StaticBatchStats:
    """Run `requests` to completion as one static batch; their outputs are filled in place."""
    device = model.device
    dtype = model.dtype
    # Every row advances one slot per decode step, finished or not, for as many steps as the
    # longest output: so each row needs room for the longest prompt plus the longest output.
    max_len = max(len(r.prompt_token_ids) for r in requests) + max(r.max_tokens for r in requests)
    cache = ContiguousKVCache(model.config, len(requests), max_len, dtype, device)
    stats = StaticBatchStats(reserved_kv_bytes=cache.reserved_bytes)

    # Prefill: all prompts in one flat batch; logits only at each prompt's last token.
    prompt_lengths = [len(r.prompt_token_ids) for r in requests]
    input_ids = torch.tensor([t for r in requests for t in r.prompt_token_ids], device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in prompt_lengths])
    hidden = model(input_ids, positions, cache.prefill(prompt_lengths))
    last_token_rows = torch.tensor(prompt_lengths, device=device).cumsum(0) - 1
    _sample_and_append(model, hidden[last_token_rows], requests, sampler)

    seq_lens = torch.tensor(prompt_lengths, device=device)
    while not all(r.is_finished for r in requests):
        # Every row runs, finished or not: that is what makes the batch static. A finished
        # row feeds its last token again and its result is thrown away.
        input_ids = torch.tensor([r.output_token_ids[-1] for r in requests], device=device)
        positions = seq_lens.clone()
        seq_lens = seq_lens + 1
        hidden = model(input_ids, positions, cache.decode(seq_lens))
        stats.decode_steps += 1
        stats.computed_rows += len(requests)
        stats.useful_rows += sum(not r.is_finished for r in requests)
        _sample_and_append(model, hidden, requests, sampler)
    return stats


def _sample_and_append(model, hidden, requests: list[Request], sampler: Sampler) -> None:
    """Sample a token for every unfinished row and append it to its request."""
    live = [i for i, r in enumerate(requests) if not r.is_finished]
    logits = model.compute_logits(hidden[live])
    sampled = sampler(logits, [requests[i].sampling_row() for i in live])
    for i, token_id, token_logprobs in zip(live, sampled.token_ids, sampled.logprobs):
        requests[i].append_token(token_id, token_logprobs)
