"""Solutions to chapter 02's exercises: KV-cache bytes per token, batched decode attention."""

import torch


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Every layer keeps, for every token, one key and one value vector per KV head."""
    bytes_per_element = torch.empty((), dtype=dtype).element_size()  # 4 for float32, 2 for bf16
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element  # 2: a key and a value


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """One new query per row, against that row's cached keys and values.

    q: [batch, heads, head_dim]; keys, values: [batch, max_len, kv_heads, head_dim]; row b
    attends to its slots 0 .. seq_lens[b] - 1 only; query head h reads KV head
    h // (heads // kv_heads). Returns [batch, heads, head_dim]."""
    batch, heads, head_dim = q.shape
    group = heads // keys.shape[2]  # query heads per KV head
    k = keys.repeat_interleave(group, dim=2)  # [batch, max_len, heads, head_dim]
    v = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bshd->bhs", q, k) / head_dim**0.5  # [batch, heads, max_len]
    slots = torch.arange(keys.shape[1], device=q.device)
    beyond = slots[None, None, :] >= seq_lens.to(q.device)[:, None, None]  # past a row's end
    weights = scores.masked_fill(beyond, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhs,bshd->bhd", weights, v)
