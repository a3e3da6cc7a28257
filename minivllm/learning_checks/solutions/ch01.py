"""Solution to chapter 01's exercise: greedy generation without a cache."""

import torch
import torch.nn.functional as F


def causal_attention(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The attention the model asks for, for one sequence with no cache: every token attends
    to itself and the tokens before it. q: [tokens, heads, head_dim], k and v: [tokens,
    kv_heads, head_dim]. (The notebook's `CausalAttention([0, n])` does the same.)"""
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # SDPA wants [1, heads, tokens, dim]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


@torch.inference_mode()
def generate_without_cache(
    model, prompt_token_ids: list[int], max_new_tokens: int, eos_token_id: int | None
) -> list[int]:
    """Greedy decoding: run the model over the whole sequence, append the argmax of the last
    row's logits, repeat; stop after max_new_tokens, or right after producing eos_token_id.
    Returns only the new tokens."""
    device = next(model.parameters()).device
    sequence = list(prompt_token_ids)
    new_tokens: list[int] = []
    while len(new_tokens) < max_new_tokens:
        n = len(sequence)
        hidden = model(
            torch.tensor(sequence, device=device), torch.arange(n, device=device), causal_attention
        )  # [n, hidden]: one row per token
        token = int(model.compute_logits(hidden[-1:])[0].argmax())  # only the last row matters
        sequence.append(token)
        new_tokens.append(token)
        if token == eos_token_id:
            break  # after appending it: EOS is part of the output
    return new_tokens
