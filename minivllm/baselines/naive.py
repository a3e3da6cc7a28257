"""Chapter 01 — naive generation: recompute the whole sequence for every new token.

Generating n tokens means n forward passes. Without a cache, pass t runs the model over all
prompt + t tokens again, although only the last position's logits are used: the total work
grows with the square of the length. This module keeps that loop on purpose, as the baseline
every later chapter is measured against, next to transformers' own `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.models.llama import LlamaForCausalLM
from minivllm.utils import tokens_first_attention


@dataclass
class CausalAttention:
    """An attention backend with no memory: each sequence attends causally to its own tokens
    in this very batch. `query_start_loc[i]:query_start_loc[i+1]` are sequence i's rows."""

    query_start_loc: list[int]

    def __call__(self, layer_index: int, q, k, v) -> torch.Tensor:
        out = torch.empty_like(q)
        for start, end in zip(self.query_start_loc[:-1], self.query_start_loc[1:]):
            out[start:end] = causal_attention(q[start:end], k[start:end], v[start:end])
        return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v for one sequence, [tokens, heads, head_dim].

    With grouped-query attention, k and v have fewer heads than q; `enable_gqa` lets each
    group of query heads read its shared K/V head without copying it.
    """
    return tokens_first_attention(q, k, v, is_causal=True)


@torch.inference_mode()
def generate_without_cache(
    model: LlamaForCausalLM,
    prompt_token_ids: list[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> list[int]:
    """Greedy decoding that reruns the model over the full sequence at every step."""
    device = model.device
    tokens = list(prompt_token_ids)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        input_ids = torch.tensor(tokens, device=device)
        positions = torch.arange(len(tokens), device=device)
        hidden = model(input_ids, positions, CausalAttention([0, len(tokens)]))
        next_token = int(model.compute_logits(hidden[-1:]).argmax(dim=-1))
        generated.append(next_token)
        tokens.append(next_token)
        if next_token == eos_token_id:
            break
    return generated


@torch.inference_mode()
def generate_with_transformers(
    hf_model, prompt_token_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    """The baseline: transformers' `generate`, greedy, one request at a time."""
    input_ids = torch.tensor([prompt_token_ids], device=hf_model.device)
    output = hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if eos_token_id is not None else 0,
    )
    return output[0, len(prompt_token_ids) :].tolist()
