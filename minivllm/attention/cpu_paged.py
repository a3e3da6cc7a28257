"""Chapter 06, "The same kernel on a CPU": paged attention in C++, one call per layer per step.

The reference backend (`torch_paged.py`) copies every sequence's K/V out of its blocks at every
layer and calls SDPA once per group of decodes and once per prefill chunk. This backend does
what chapter 06's Triton kernels do on a GPU, on the CPU's cores: one call attends the whole
flat batch, decodes and prefill chunks alike, reading K and V where they lie in the pool
through the block tables. Nothing is gathered, nothing is padded to the longest sequence.

The step is planned once (`plan_work`) and the plan serves every layer: the batch is cut into
work items, each one sequence's query rows (up to `QUERY_TILE` of them) for one K/V head over
a range of its keys. A long decode is split along its keys when there would otherwise be too
few items to keep every core busy; its splits are merged with their log-sum-exps (the
algorithm of the Triton decode kernel and of the `merge_splits` exercise). The C++ source,
`csrc/paged_attention.cpp` (its inner loops in `csrc/attention_tiles.h`), is built at first
use with the compiler that inductor needs anyway and cached on disk (`minivllm/cpu_kernels.py`);
without a compiler the engine says so once and runs the torch backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minivllm import cpu_kernels
from minivllm.attention.backend import (
    AttentionMetadata,
    PagedAttentionBackend,
    PagedKVCache,
    query_starts,
)
from minivllm.utils import cdiv

# Query rows of a prefill chunk per work item: their K/V tiles are gathered once for all of them.
# 32 tokens (96 rows with 3 query heads per K/V head) rather than 16: a 2,048-token chunk over a
# 4,096-token context measured 85 ms against 89 (the gathering shared by twice the rows), and a
# 32-token slice still leaves a long prompt hundreds of items to share between the cores.
QUERY_TILE = 32
MIN_SPLIT_KEYS = 256  # a split of a decode's keys is never shorter (merging costs a pass)
ITEMS_PER_THREAD = 4  # split decodes until there are this many items per thread
MAX_SPLITS = 16


@dataclass
class WorkPlan:
    """One step's partition of the flat batch, int32 tensors the kernel reads for every layer."""

    work: torch.Tensor  # [items, 8] seq, kv_head, row_begin, row_end, first_position,
    #                     key_begin, key_end, split (-1: the item writes its rows of the output)
    merges: torch.Tensor  # [rows, 2] the query row of a split decode and its number of splits
    block_tables: torch.Tensor  # [seqs, width]
    slot_mapping: torch.Tensor  # [tokens]
    max_splits: int


def plan_work(
    metadata: AttentionMetadata,
    num_kv_heads: int,
    block_size: int,
    num_threads: int,
    min_split_keys: int = MIN_SPLIT_KEYS,
) -> WorkPlan:
    """Cut the step into work items (see the module docstring), the costliest first: threads
    take the next untaken item, so a long prefill started last cannot keep one core busy while
    the other waits."""
    query_lens, seq_lens = metadata.query_lens_list, metadata.seq_lens_list
    row_starts = query_starts(query_lens)
    unsplit_items = sum(cdiv(n, QUERY_TILE) for n in query_lens) * num_kv_heads
    wanted_splits = cdiv(ITEMS_PER_THREAD * num_threads, unsplit_items)

    items, merges = [], []
    for seq, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        cached = seq_len - query_len  # tokens of this sequence computed in earlier steps
        if query_len == 1:
            splits = max(1, min(wanted_splits, seq_len // min_split_keys, MAX_SPLITS))
            # Split boundaries fall on block boundaries, so no block is read by two splits.
            split_keys = cdiv(cdiv(seq_len, splits), block_size) * block_size
            splits = cdiv(seq_len, split_keys)
            row = row_starts[seq]
            if splits > 1:
                merges.append((row, splits))
            for s in range(splits):
                key_begin, key_end = s * split_keys, min(seq_len, (s + 1) * split_keys)
                split = s if splits > 1 else -1
                items += [
                    (seq, h, row, row + 1, cached, key_begin, key_end, split)
                    for h in range(num_kv_heads)
                ]
            continue
        for tile_begin in range(0, query_len, QUERY_TILE):
            tile_end = min(query_len, tile_begin + QUERY_TILE)
            rows = (row_starts[seq] + tile_begin, row_starts[seq] + tile_end)
            first_position = cached + tile_begin
            key_end = cached + tile_end  # what the tile's last row sees
            items += [(seq, h, *rows, first_position, 0, key_end, -1) for h in range(num_kv_heads)]
    # Cost of an item: its query rows times its keys.
    items.sort(key=lambda item: (item[3] - item[2]) * (item[6] - item[5]), reverse=True)
    return WorkPlan(
        work=torch.tensor(items, dtype=torch.int32).view(-1, 8),
        merges=torch.tensor(merges, dtype=torch.int32).view(-1, 2),
        block_tables=metadata.block_tables.to(torch.int32),
        slot_mapping=metadata.slot_mapping.to(torch.int32),
        max_splits=max([splits for _, splits in merges], default=1),
    )


class CpuPagedAttention(PagedAttentionBackend):
    """Chapter 06's paged attention in C++ on the CPU: a store and one kernel call per layer."""

    name = "cpu"

    def __init__(self, kv_cache: PagedKVCache, metadata: AttentionMetadata):
        super().__init__(kv_cache, metadata)
        num_kv_heads, head_dim = kv_cache.layers[0].shape[-2:]
        self.scale = 1.0 / math.sqrt(head_dim)
        self.plan = plan_work(
            metadata, num_kv_heads, kv_cache.block_size, torch.get_num_threads()
        )  # once per step, for every layer

    @classmethod
    def for_device(cls, device: torch.device) -> type[PagedAttentionBackend]:
        if device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on the CPU, not on {device}")
        if cpu_kernels.load_kernels() is None:
            from minivllm.attention.torch_paged import TorchPagedAttention

            return TorchPagedAttention
        return cls

    def __call__(self, layer_index: int, q, k, v) -> torch.Tensor:
        return store_and_attend(self.kv_cache.layers[layer_index], q, k, v, self.plan, self.scale)


def store_and_attend(
    kv: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: WorkPlan,
    scale: float,
) -> torch.Tensor:
    """One layer's attention: the new tokens' K/V into the pool, then one kernel call."""
    kernels = torch.ops.minivllm_cpu
    kernels.store_kv(kv, k, v, plan.slot_mapping)
    out = q.new_empty(q.shape)
    kernels.paged_attention(
        out, q, kv, plan.block_tables, plan.work, plan.merges, scale, plan.max_splits
    )
    return out
