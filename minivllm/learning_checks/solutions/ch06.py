"""Chapter 06's solutions: the store kernel, one program per (token, K/V head); the merge of
splits by their log-sum-exps."""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, kv_heads, head_dim,
    HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:  # -1 marks padding: nothing to store
        dims = tl.arange(0, HEAD_DIM_PAD)
        inside = dims < head_dim
        source = (token * kv_heads + head) * head_dim + dims
        # The pool half is [slots, kv_heads, head_dim] in memory: a slot is kv_heads rows apart.
        target = (slot * kv_heads + head) * head_dim + dims
        tl.store(k_cache_ptr + target, tl.load(k_ptr + source, mask=inside), mask=inside)
        tl.store(v_cache_ptr + target, tl.load(v_ptr + source, mask=inside), mask=inside)


def store_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
    num_tokens, kv_heads, head_dim = k.shape
    _store_kernel[(num_tokens, kv_heads)](
        k.contiguous(), v.contiguous(), kv[0], kv[1], slot_mapping, kv_heads, head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def merge_splits(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    # Split s holds exp(lse_s) of the whole sum of exp(score): its share is exp(lse_s) / sum_t
    # exp(lse_t). Subtracting the largest lse first keeps every exp at most 1 (no overflow),
    # and an empty split's exp(-inf) is 0: it adds nothing.
    weights = torch.exp(lses - lses.max(dim=0).values)  # [splits, heads]
    weights = weights / weights.sum(dim=0)
    return (weights[:, :, None] * outs).sum(dim=0)
