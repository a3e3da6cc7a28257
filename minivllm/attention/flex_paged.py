"""Chapter 06 — FlexAttention: a compiled block-sparse kernel reads the paged pool in place.

PyTorch's `flex_attention` is attention with two hooks. A `mask_mod(b, h, q_idx, kv_idx)` says
which scores exist; a `BlockMask` lists, for each tile of queries, the tiles of keys worth
visiting. `torch.compile` fuses the pair into one kernel (Triton on a GPU, C++ on a CPU) that
never stores the score matrix and skips every tile the block mask leaves out.

The paged pool fits that shape without a copy. Flex gets the *whole* pool as its keys and
values, `[1, kv_heads, slots, head_dim]`, and each sequence gets its own batch entry whose
block-mask row lists exactly the physical blocks of its block table: the kernel visits those
blocks, where they lie, and no others. Inside them the mask_mod turns a physical slot back
into the sequence's position (`physical_to_logical`) and applies the causal rule, shifted by
the tokens already cached:

    block table of sequence b: [7, 2]          (block_size 4, 6 tokens, 2 of them new)
    physical_to_logical[b]:    block 7 -> 0, block 2 -> 1, every other block -> -1
    slot 9 = block 2, offset 1 -> position 1 * 4 + 1 = 5: visible to the query at position 5

A step's decodes (one query each) run as one call, `[decodes, heads, 1, head_dim]`, and each
prefill chunk as a call of its own. What compiles when: flex compiles once per shape it meets
(`dynamic=False`: PyTorch's CPU code generator fails on dynamic flex shapes), so the number of
sequences and a chunk's length are padded to powers of two, and a handful of kernels serve every
step; each compiles at its first call (tens of seconds on a CPU; inductor caches the result on
disk, so the next process loads it), which `warm_up` does at engine start.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from minivllm.attention.backend import (
    AttentionMetadata,
    PagedAttentionBackend,
    PagedKVCache,
    query_starts,
)
from minivllm.attention.torch_paged import TorchPagedAttention, write_kv
from minivllm.config import resolve_dtype
from minivllm.utils import cdiv

logger = logging.getLogger(__name__)

# Query rows per block-mask tile of a prefill chunk: the causal rule skips whole key blocks
# per tile, so smaller tiles skip more; larger tiles cost less bookkeeping.
PREFILL_QUERY_TILE = 64

# The fewest query rows in a tile. On a GPU, inductor's Triton kernels compute a tile with
# `tl.dot` products, whose sides are at least 16, and refuse a block mask whose tiles their
# own tile does not divide: a decode tile of 3 rows (one token, 3 query heads per K/V head)
# would fail at the first decode. The CPU kernel takes any tile; the same rule runs there.
SMALLEST_QUERY_TILE = 16


# The smallest KV block flex takes on a GPU: a block is one tile of keys of inductor's kernel,
# which multiplies the probabilities of a tile by its values with `tl.dot`, whose inner side
# must be at least 16 for 16-bit types (8 for float32).
SMALLEST_GPU_BLOCK_SIZE = 16

# Dynamo compiles once per shape it meets (PyTorch 2.13's CPU code generator fails on dynamic
# flex shapes), so shapes are padded to powers of two: a handful of kernels cover every step.
MAX_COMPILED_SHAPES = 64


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled for static shapes, allowed one kernel per bucket of shapes."""
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return torch._dynamo.config.patch(recompile_limit=MAX_COMPILED_SHAPES)(compiled)


def bucket(n: int, smallest: int = 1) -> int:
    """n rounded up to a power of two, at least `smallest`: the padded size of a shape."""
    return max(smallest, 1 << (n - 1).bit_length())


def _powers_of_two_up_to(n: int, smallest: int = 1) -> list[int]:
    """smallest, 2 * smallest, ... up to the bucket of n: every bucket sizes up to n reach."""
    sizes = [smallest]
    while sizes[-1] < bucket(n, smallest):
        sizes.append(sizes[-1] * 2)
    return sizes


@functools.cache
def slot_blocks_and_offsets(
    num_slots: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pool slot's block and offset, made once per pool rather than once per step. The
    mask_mod looks them up rather than computing // and % (PyTorch 2.13's CPU code generator
    mishandles those on dynamic tiles)."""
    slots = torch.arange(num_slots, device=device, dtype=torch.int32)
    return slots // block_size, slots % block_size


def paged_causal_mask(
    physical_to_logical: torch.Tensor,
    step_rows: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    group: int,
):
    """The mask_mod: key slot `kv_idx` of the pool is visible to query row `q_idx` of the
    call's sequence `b` (query token q_idx // group) when its block belongs to that sequence
    and its position is not after the query's. `step_rows[b]` is the sequence's row in
    `physical_to_logical`, the step's table of block owners (`block_owners`)."""
    num_slots = (physical_to_logical.shape[1] - 1) * block_size  # its last column is a spare
    slot_block, slot_offset = slot_blocks_and_offsets(
        num_slots, block_size, physical_to_logical.device
    )

    def mask_mod(b, h, q_idx, kv_idx):
        logical_block = physical_to_logical[step_rows[b], slot_block[kv_idx]]
        position = logical_block * block_size + slot_offset[kv_idx]
        return (logical_block >= 0) & (position <= context_lens[b] + q_idx // group)

    return mask_mod


def owned_blocks(
    metadata: AttentionMetadata, num_pool_blocks: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each sequence's blocks go in the table of block owners, and what goes there: the
    columns (its physical blocks; table entries past its last block go to the spare column
    `num_pool_blocks`) and the values (logical block indices; -1 in the spare column). Built on
    the device from the step's block tables, with no boolean indexing (which would wait for
    the device)."""
    tables = metadata.block_tables
    num_seqs, width = tables.shape
    num_blocks = (metadata.seq_lens + block_size - 1) // block_size
    logical = torch.arange(width, device=tables.device)[None, :].expand(num_seqs, width)
    owned = logical < num_blocks[:, None]
    columns = torch.where(owned, tables, num_pool_blocks)
    return columns, torch.where(owned, logical, -1).to(torch.int32)


def block_owners(
    metadata: AttentionMetadata, num_pool_blocks: int, block_size: int
) -> torch.Tensor:
    """The step's table of block owners, made afresh: row s, column b is the logical index of
    pool block b in the step's sequence s, or -1 (one spare column at the end; rows padded to
    a power of two, a shape the compiled kernel meets again). The backend keeps one on the
    device instead (`BlockOwnerTable`); this is the same table, for one step."""
    columns, logical = owned_blocks(metadata, num_pool_blocks, block_size)
    table = torch.full(
        (bucket(metadata.num_seqs), num_pool_blocks + 1),
        -1,
        dtype=torch.int32,
        device=columns.device,
    )
    return table.scatter_(1, columns, logical)


class BlockOwnerTable:
    """The table of block owners of one pool, kept on the device from step to step.

    It is as wide as the pool (the mask_mod looks up any slot's block): on a GPU, hundreds of
    thousands of columns per sequence. Made afresh it would be allocated and filled with -1
    every step; this one is filled once, and each step first erases the entries the step before
    wrote, then writes its own: work in proportion to the block tables, not to the pool. Its
    shape never changes (rows for `max_num_seqs` sequences, rounded up to the largest decode
    bucket), so the compiled kernel that reads it is the same from step to step."""

    def __init__(self, num_pool_blocks: int, max_num_seqs: int, device: torch.device):
        self.num_pool_blocks = num_pool_blocks
        self.table = torch.full(
            (bucket(max_num_seqs), num_pool_blocks + 1), -1, dtype=torch.int32, device=device
        )
        self.written: torch.Tensor | None = None  # the columns the last step wrote, per row

    def update(self, metadata: AttentionMetadata, block_size: int) -> torch.Tensor:
        """The table for this step's batch (rows 0..num_seqs-1; the rest all -1)."""
        if metadata.num_seqs > self.table.shape[0]:
            raise ValueError(
                f"a step of {metadata.num_seqs} sequences, but the flex backend's table of "
                f"block owners has rows for {self.table.shape[0]} (max_num_seqs)"
            )
        if self.written is not None:
            self.table[: len(self.written)].scatter_(1, self.written, -1)
        columns, logical = owned_blocks(metadata, self.num_pool_blocks, block_size)
        self.table[: metadata.num_seqs].scatter_(1, columns, logical)
        self.written = columns
        return self.table


# Each pool's table of block owners, made at warm-up; it goes when its pool does.
_owner_tables: weakref.WeakKeyDictionary[PagedKVCache, BlockOwnerTable] = (
    weakref.WeakKeyDictionary()
)


def kernel_options(query_tile: int, block_size: int, device: torch.device) -> dict[str, int]:
    """The tile sizes of inductor's GPU kernel, chosen from the block mask: its tile must
    divide the block mask's (it refuses the call otherwise), and its own defaults (128 or 64
    rows, 64 keys) do not divide a 16-token KV block. The CPU kernel picks its own."""
    if device.type != "cuda":
        return {}
    return {"BLOCK_M": query_tile, "BLOCK_N": block_size}


@dataclass
class FlexCall:
    """One flex_attention call of a step: some sequences, their queries padded to one length."""

    rows: torch.Tensor  # [seqs, longest] flat-batch row of each query (padding repeats row 0)
    valid: torch.Tensor  # [seqs, longest] which entries are real queries
    block_mask: BlockMask
    kernel_options: dict[str, int]  # inductor's tile sizes on a GPU (`kernel_options`)


def build_call(
    metadata: AttentionMetadata,
    seqs: list[int],
    num_pool_blocks: int,
    block_size: int,
    group: int,
    physical_to_logical: torch.Tensor | None = None,
) -> FlexCall:
    """Rows, block mask and mask_mod of the sequences `seqs` (indices into the step's batch).

    Grouped-query attention is folded into the query rows, as chapter 03's decode does: the
    `group` query heads that share a K/V head become `group` rows of that one head, so the
    kernel reads each K/V block once for all of them. Row r is query token r // group.
    `physical_to_logical` is the step's table of block owners (made here when not given).
    """
    device = metadata.seq_lens.device
    if physical_to_logical is None:
        physical_to_logical = block_owners(metadata, num_pool_blocks, block_size)
    # Padding sequences have no query and no block: the kernel skips them.
    padding = bucket(len(seqs)) - len(seqs)
    query_lens = [metadata.query_lens_list[i] for i in seqs] + [0] * padding
    seq_lens = [metadata.seq_lens_list[i] for i in seqs] + [0] * padding
    longest_query = 1 if max(query_lens) == 1 else bucket(max(query_lens), smallest=16)
    num_rows = longest_query * group
    # A decode call is one tile (its few rows padded up to the smallest tile).
    query_tile = bucket(num_rows, SMALLEST_QUERY_TILE) if longest_query == 1 else PREFILL_QUERY_TILE
    num_query_tiles = cdiv(num_rows, query_tile)
    starts = query_starts(metadata.query_lens_list)

    offsets = torch.arange(longest_query)
    query_lens_t = torch.tensor(query_lens)
    valid = offsets[None, :] < query_lens_t[:, None]
    first_rows = torch.tensor([starts[i] for i in seqs] + [0] * padding)
    rows = torch.where(valid, first_rows[:, None] + offsets[None, :], 0)

    # Each sequence's block-mask row: its block table (the rest of the pool never appears).
    # Built on the device from the step's block tables: a GPU pool has hundreds of thousands
    # of blocks, and a pool-wide tensor made on the CPU and copied over every step would cost
    # more than the step.
    num_seqs = len(query_lens)
    tables = metadata.block_tables[seqs]
    tables = torch.cat([tables, tables.new_zeros(padding, tables.shape[1])])
    width = tables.shape[1]
    # The GPU kernel reads each list up to its length only, so a list is as wide as the widest
    # block table. PyTorch 2.13's CPU kernel wants the lists as wide as the pool ("KV seqlen
    # must be smaller than the block_mask size"): zeros past the table, never visited.
    num_columns = num_pool_blocks if device.type == "cpu" else width
    kv_indices = torch.zeros(
        (num_seqs, 1, num_query_tiles, num_columns), dtype=torch.int32, device=device
    )
    kv_indices[:, 0, :, :width] = tables[:, None, :].to(torch.int32)

    # Query tile t sees the blocks up to the one holding its last query token's position.
    context_lens = torch.tensor(seq_lens) - query_lens_t
    tiles = torch.arange(num_query_tiles)[None, :]
    real_rows = query_lens_t[:, None] * group
    last_token = (torch.minimum((tiles + 1) * query_tile, real_rows) - 1) // group
    blocks_seen = (context_lens[:, None] + last_token) // block_size + 1
    kv_num_blocks = torch.where(tiles * query_tile < real_rows, blocks_seen, 0).int()[:, None]

    step_rows = torch.tensor(seqs + [0] * padding, device=device)  # padding: never looked up
    mask_mod = paged_causal_mask(
        physical_to_logical, step_rows, context_lens.to(device), block_size, group
    )
    # Every listed block goes through the mask_mod ("partial" blocks); the "full" lists, for
    # blocks that need no mask, stay empty but are passed (PyTorch 2.13's CPU kernel expects
    # them in some shapes).
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks.to(device),
        kv_indices,
        torch.zeros_like(kv_num_blocks).to(device),
        torch.zeros_like(kv_indices),
        BLOCK_SIZE=(query_tile, block_size),
        compute_q_blocks=False,  # only the backward pass reads them
        mask_mod=mask_mod,
        seq_lengths=(num_rows, num_pool_blocks * block_size),
    )
    return FlexCall(
        rows=rows.to(device),
        valid=valid.to(device),
        block_mask=block_mask,
        kernel_options=kernel_options(query_tile, block_size, device),
    )


class FlexPagedAttention(PagedAttentionBackend):
    """The "flex" backend: the torch reference's store, then flex_attention over the pool."""

    name = "flex"

    @classmethod
    def for_device(cls, device: torch.device) -> type[PagedAttentionBackend]:
        if flex_compiles(device.type):
            return cls
        warnings.warn(
            "attention_backend='flex': flex_attention does not compile here (see the error "
            "above); using the 'torch' backend instead",
            stacklevel=2,
        )
        return TorchPagedAttention

    @classmethod
    def warm_up(
        cls, kv_cache: PagedKVCache, num_heads: int, max_num_seqs: int, max_num_tokens: int
    ) -> None:
        """Make the pool's table of block owners, and compile the kernel for every bucket a
        step can use: decode batches of 1, 2, 4, ... up to max_num_seqs sequences, prefill
        chunks of 16, 32, ... up to max_num_tokens."""
        start = time.perf_counter()
        layer = kv_cache.layers[0]
        num_kv_heads, head_dim, block_size = layer.shape[3], layer.shape[4], kv_cache.block_size
        check_block_size(block_size, layer.device)
        owners = BlockOwnerTable(kv_cache.num_blocks, max_num_seqs, layer.device)
        _owner_tables[kv_cache] = owners
        capacity = kv_cache.num_blocks * block_size
        shapes = [(n, 1) for n in _powers_of_two_up_to(max_num_seqs)]
        shapes += [(1, n) for n in _powers_of_two_up_to(min(max_num_tokens, capacity), 16)]
        for num_seqs, query_len in shapes:
            table = [0] * cdiv(query_len, block_size)  # any blocks will do: only shapes matter
            metadata = AttentionMetadata.build(
                [query_len] * num_seqs,
                [query_len] * num_seqs,
                [table] * num_seqs,
                [0] * (query_len * num_seqs),
                device=layer.device,
            )
            group = num_heads // num_kv_heads
            # The table the steps will read: the kernel is compiled for its shape.
            physical_to_logical = owners.update(metadata, block_size)
            call = build_call(
                metadata,
                list(range(num_seqs)),
                kv_cache.num_blocks,
                block_size,
                group,
                physical_to_logical,
            )
            q = torch.zeros(
                query_len * num_seqs, num_heads, head_dim, dtype=layer.dtype, device=layer.device
            )
            flex_paged_attention(q, layer, [call])
        logger.info(
            "flex_attention: %d shapes ready in %.1f s", len(shapes), time.perf_counter() - start
        )

    def __init__(self, kv_cache: PagedKVCache, metadata: AttentionMetadata):
        super().__init__(kv_cache, metadata)
        self.calls: list[FlexCall] | None = None  # built by the first layer, used by all

    def _build_calls(self, group: int) -> list[FlexCall]:
        query_lens = self.metadata.query_lens_list
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        prefills = [[i] for i, n in enumerate(query_lens) if n > 1]  # one call each
        pool = self.kv_cache
        # A pool that was never warmed up (a one-off forward) gets a table for this step, made
        # once for all of its calls.
        owners = _owner_tables.get(pool)
        if owners is not None:
            physical_to_logical = owners.update(self.metadata, pool.block_size)
        else:
            physical_to_logical = block_owners(self.metadata, pool.num_blocks, pool.block_size)
        return [
            build_call(
                self.metadata, seqs, pool.num_blocks, pool.block_size, group, physical_to_logical
            )
            for seqs in ([decodes] if decodes else []) + prefills
        ]

    def __call__(self, layer_index: int, q, k, v) -> torch.Tensor:
        kv = self.kv_cache.layers[layer_index]
        write_kv(kv, k, v, self.metadata.slot_mapping)
        if self.calls is None:
            self.calls = self._build_calls(group=q.shape[1] // k.shape[1])
        return flex_paged_attention(q, kv, self.calls)


def flex_paged_attention(q: torch.Tensor, kv: torch.Tensor, calls: list[FlexCall]) -> torch.Tensor:
    """Attention of every new token over its sequence, read from one layer's pool `kv`."""
    num_kv_heads, head_dim = kv.shape[-2:]
    group = q.shape[1] // num_kv_heads
    # The pool as flex's keys and values: [1, kv_heads, slots, head_dim], a view.
    keys, values = (half.view(1, -1, num_kv_heads, head_dim).transpose(1, 2) for half in kv)
    out = torch.empty_like(q)
    flex = compiled_flex_attention()
    for call in calls:
        num_seqs, longest = call.rows.shape
        # [seqs, longest, heads, dim] -> [seqs, kv_heads, longest * group, dim]: row r of a K/V
        # head is query token r // group, query head r % group of those sharing it.
        queries = q[call.rows].view(num_seqs, longest, num_kv_heads, group, head_dim)
        queries = queries.permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, -1, head_dim)
        result = flex(
            queries, keys, values, block_mask=call.block_mask, kernel_options=call.kernel_options
        )
        result = result.view(num_seqs, num_kv_heads, longest, group, head_dim).permute(
            0, 2, 1, 3, 4
        )
        result = result.reshape(num_seqs, longest, -1, head_dim)
        out[call.rows[call.valid]] = result[call.valid]
    return out


def check_block_size(block_size: int, device: torch.device) -> None:
    """On a GPU a KV block is one tile of keys of inductor's kernel (`kernel_options`): a
    power of two, at least SMALLEST_GPU_BLOCK_SIZE."""
    too_small = block_size < SMALLEST_GPU_BLOCK_SIZE
    if device.type == "cuda" and (too_small or block_size & (block_size - 1)):
        raise ValueError(
            f"attention_backend='flex' on a GPU needs block_size a power of two, at least "
            f"{SMALLEST_GPU_BLOCK_SIZE} (a KV block is one tile of its kernel), got {block_size}"
        )


@functools.cache
def flex_compiles(device_type: str) -> bool:
    """Try once per process: does flex_attention compile and run on this device type, for both
    kinds of call a step makes (a decode batch, and a prompt chunk after cached tokens, whose
    block mask has query tiles of PREFILL_QUERY_TILE rows: a kernel that only fails there must
    fail here, not at the first long prompt)? It runs as the engine would by default there:
    blocks of SMALLEST_GPU_BLOCK_SIZE tokens (the engine's default block size, and a kernel
    tile a GPU compiles; a smaller one would fail where the engine never goes) in the device's
    "auto" dtype."""
    block_size, group = SMALLEST_GPU_BLOCK_SIZE, 2
    device = torch.device(device_type)
    dtype = resolve_dtype("auto", device)
    try:
        for query_len, seq_len in ((1, 3), (PREFILL_QUERY_TILE // group + 3, PREFILL_QUERY_TILE)):
            num_blocks = cdiv(seq_len, block_size)
            pool = torch.zeros(2, num_blocks, block_size, 1, 16, dtype=dtype, device=device)
            slots = list(range(seq_len - query_len, seq_len))  # blocks 0, 1, ... in order
            metadata = AttentionMetadata.build(
                [query_len], [seq_len], [list(range(num_blocks))], slots, device=device
            )
            call = build_call(metadata, [0], num_blocks, block_size, group)
            q = torch.randn(query_len, group, 16, dtype=dtype, device=device)
            flex_paged_attention(q, pool, [call])
        return True
    except Exception as error:  # noqa: BLE001 -- any failure means "flex cannot run here"
        warnings.warn(f"flex_attention does not compile on {device_type}: {error}", stacklevel=2)
        return False
