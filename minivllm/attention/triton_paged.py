"""Chapter 06 — attention kernels that read the paged KV cache where it lies (Triton, for GPUs).

Chapter 03's reference backend copies every sequence's blocks into a padded contiguous batch,
then calls ordinary attention on the copy. The copy is pure overhead: a decode step reads every
cached K/V byte twice (once to copy, once to attend) and writes it once. PagedAttention's answer
is a kernel that walks the block table itself. Three kernels, written in Triton (Python that
compiles to GPU code), make the "triton" backend:

1. `_store_kv_kernel` — one program per new token: copy its K and V row into the pool at its
   slot. Slots below 0 mean "padding, write nothing".
2. `_decode_kernel` — one query token per sequence (a decode step). A program owns one
   (sequence, K/V head, split): it loads the queries of every head that shares that K/V head
   (grouped-query attention: the K/V tile is read once for all of them), walks its share of the
   sequence in tiles of `BLOCK_N` tokens, looking up each token's slot in the block table, and
   keeps a running softmax (the "online softmax": maximum, sum and weighted values are updated
   tile by tile, so no score matrix is ever stored). With few sequences a GPU would sit mostly
   idle, so each sequence is cut into `num_splits` parts attended in parallel
   (flash-decoding); `_combine_splits_kernel` merges the parts using each part's log-sum-exp.
3. `_prefill_kernel` — any mix of query lengths (prefill chunks, prefix-cache hits, decodes):
   flash-attention tiling over variable-length sequences. A program owns a tile of query
   tokens of one sequence and one K/V head; the tile's rows are (token, query head of the
   group) pairs, so again K/V are read once per group. The causal mask is shifted by the
   tokens already in the cache: query token i of a chunk sits at position
   `seq_len - query_len + i`.

The same kernels run on a CPU under Triton's interpreter (`TRITON_INTERPRET=1`, set before
Triton is imported): slowly, one program at a time in NumPy, but exactly, which is how the
tests check them against the reference without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from minivllm.attention.backend import AttentionMetadata, PagedAttentionBackend, PagedKVCache
from minivllm.utils import cdiv

# Tile sizes. Powers of two (Triton's tiles must be) and at least 16 (the smallest matrix
# product a GPU's tensor cores take).
BLOCK_N = 64  # K/V tokens per tile, in both attention kernels
BLOCK_M = 64  # (query token, head) rows per prefill tile
MIN_TOKENS_PER_SPLIT = 256  # a decode split shorter than this costs more to merge than it saves


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (decided when Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --- 1. storing the new tokens' K/V ---


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [tokens, kv_heads * head_dim] this step's keys
    v_ptr,
    k_cache_ptr,  # the pool's K half viewed as [slots, kv_heads * head_dim]
    v_cache_ptr,
    slot_mapping_ptr,  # [tokens]
    row_size,  # kv_heads * head_dim
    BLOCK: tl.constexpr,  # row_size rounded up to a power of two
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        columns = tl.arange(0, BLOCK)
        in_row = columns < row_size
        source = token * row_size + columns
        target = slot * row_size + columns
        tl.store(k_cache_ptr + target, tl.load(k_ptr + source, mask=in_row), mask=in_row)
        tl.store(v_cache_ptr + target, tl.load(v_ptr + source, mask=in_row), mask=in_row)


def store_constants(row_size: int) -> dict:
    """The store kernel's compile-time constants for rows of `row_size` values."""
    return dict(BLOCK=triton.next_power_of_2(row_size))


def store_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
    """Write K/V `[tokens, kv_heads, head_dim]` into the layer's pool `kv` at `slot_mapping`."""
    num_tokens = k.shape[0]
    row_size = k.shape[1] * k.shape[2]
    _store_kv_kernel[(num_tokens,)](
        k.contiguous(), v.contiguous(), kv[0], kv[1], slot_mapping, row_size,
        **store_constants(row_size),
    )  # fmt: skip


# --- 2. decode: one query per sequence, split along the sequence ---


@triton.jit
def _load_kv_tile(
    cache_ptr,
    block_table_ptr,  # this sequence's row of the block table
    tokens,  # [BLOCK_N] logical positions
    valid,  # [BLOCK_N] which of them exist
    kv_head,
    dims,  # [HEAD_DIM_PAD]
    head_dim,
    num_kv_heads,
    PAGE_SIZE: tl.constexpr,
):
    """K or V of a tile of a sequence's tokens, [BLOCK_N, HEAD_DIM_PAD]: each token's block comes
    from the block table, its slot is block * PAGE_SIZE + offset (chapter 03's formula)."""
    blocks = tl.load(block_table_ptr + tokens // PAGE_SIZE, mask=valid, other=0)
    slots = blocks * PAGE_SIZE + tokens % PAGE_SIZE
    offsets = (slots[:, None] * num_kv_heads + kv_head) * head_dim + dims[None, :]
    return tl.load(cache_ptr + offsets, mask=valid[:, None] & (dims[None, :] < head_dim), other=0.0)


@triton.jit
def _attend_tile(
    q,  # [rows, HEAD_DIM_PAD] queries
    running_max,  # [rows] the online softmax's state, updated and returned
    running_sum,  # [rows]
    acc,  # [rows, HEAD_DIM_PAD]
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    tokens,  # [BLOCK_N] the tile's positions in the sequence
    in_range,  # [BLOCK_N] which of them exist (the others are not loaded)
    visible,  # [rows or 1, BLOCK_N] which scores count (causal mask, range)
    kv_head,
    dims,
    head_dim,
    num_kv_heads,
    scale,
    PAGE_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fold one tile of keys and values into the online softmax: scores of the tile, a new
    running maximum, the old sum and output rescaled to it, the tile's share added."""
    k = _load_kv_tile(
        k_cache_ptr, block_table_ptr, tokens, in_range, kv_head, dims, head_dim, num_kv_heads,
        PAGE_SIZE,
    )  # fmt: skip
    v = _load_kv_tile(
        v_cache_ptr, block_table_ptr, tokens, in_range, kv_head, dims, head_dim, num_kv_heads,
        PAGE_SIZE,
    )  # fmt: skip
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [rows, BLOCK_N]
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    # A row that sees no key yet (prefill padding) keeps a finite maximum: exp() gives 0, not NaN.
    new_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp(running_max - new_max)  # how much the old sum and output shrink
    probs = tl.exp(scores - new_max[:, None])
    running_sum = running_sum * rescale + tl.sum(probs, axis=1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
    return new_max, running_sum, acc


# Triton compiles a kernel for each kind of integer argument it meets: 1 (made a constant), a
# multiple of 16, any other. A block table's row stride is the width of the step's widest table,
# any of the three; not specialized on, it is one kernel for every step, the one `warm_up` built.
@triton.jit(do_not_specialize=["block_table_stride"])
def _decode_kernel(
    q_ptr,  # [seqs, heads, head_dim]: the decode tokens' queries
    k_cache_ptr,  # the layer's pool halves, [slots, kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [seqs, max_blocks]
    seq_lens_ptr,  # [seqs]
    partial_out_ptr,  # [seqs, heads, splits, head_dim] float32: each split's normalised output
    partial_lse_ptr,  # [seqs, heads, splits] float32: each split's log-sum-exp of scores
    scale,
    head_dim,
    num_kv_heads,
    block_table_stride,
    QUERIES_PER_KV: tl.constexpr,  # query heads sharing one K/V head
    GROUP_PAD: tl.constexpr,  # QUERIES_PER_KV rounded up to a power of two, at least 16
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # tokens per KV block
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32 rounding), "tf32" otherwise
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = num_kv_heads * QUERIES_PER_KV

    # The queries of the heads that read this K/V head: a [GROUP_PAD, HEAD_DIM_PAD] tile.
    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * QUERIES_PER_KV + group
    head_valid = group < QUERIES_PER_KV
    dim_valid = dims < head_dim
    q_offsets = (seq * num_heads + heads[:, None]) * head_dim + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=head_valid[:, None] & dim_valid[None, :], other=0.0)

    # This split's share of the sequence, in whole tiles.
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    block_table_ptr = block_tables_ptr + seq * block_table_stride

    # The online softmax: running maximum, running sum of exp(score - max), running output.
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        in_split = tokens < end
        running_max, running_sum, acc = _attend_tile(
            q, running_max, running_sum, acc, k_cache_ptr, v_cache_ptr, block_table_ptr,
            tokens, in_split, in_split[None, :], kv_head, dims, head_dim, num_kv_heads, scale,
            PAGE_SIZE, PRECISION,
        )  # fmt: skip

    # An empty split (a short sequence) leaves sum 0: its log-sum-exp is -inf, its weight 0.
    has_tokens = running_sum > 0
    out = acc / tl.where(has_tokens, running_sum, 1.0)[:, None]
    lse = tl.where(
        has_tokens, running_max + tl.log(tl.where(has_tokens, running_sum, 1.0)), float("-inf")
    )
    row = (seq * num_heads + heads) * NUM_SPLITS + split
    tl.store(
        partial_out_ptr + row[:, None] * head_dim + dims[None, :],
        out,
        mask=head_valid[:, None] & dim_valid[None, :],
    )
    tl.store(partial_lse_ptr + row, lse, mask=head_valid)


@triton.jit
def _combine_splits_kernel(
    partial_out_ptr,  # [seqs, heads, splits, head_dim]
    partial_lse_ptr,  # [seqs, heads, splits]
    out_ptr,  # [seqs, heads, head_dim]
    head_dim,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """softmax over all tokens = the splits' softmaxes, each weighted by its share of the total
    exp-sum: weight_s = exp(lse_s - max_lse) / sum_t exp(lse_t - max_lse)."""
    seq_head = tl.program_id(0)  # seq * heads + head
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_valid = splits < NUM_SPLITS
    lse = tl.load(
        partial_lse_ptr + seq_head * NUM_SPLITS + splits, mask=split_valid, other=float("-inf")
    )
    weights = tl.exp(lse - tl.max(lse, axis=0))
    weights = weights / tl.sum(weights, axis=0)
    partial = tl.load(
        partial_out_ptr + (seq_head * NUM_SPLITS + splits[:, None]) * head_dim + dims[None, :],
        mask=split_valid[:, None] & (dims[None, :] < head_dim),
        other=0.0,
    )
    out = tl.sum(partial * weights[:, None], axis=0)
    tl.store(out_ptr + seq_head * head_dim + dims, out, mask=dims < head_dim)


# The decode kernel's split count is a compile-time constant, so each value is a kernel of its
# own: the counts are powers of two up to this, a handful of kernels `warm_up` compiles at start.
MAX_SPLITS = 64
SPLIT_COUNTS = tuple(2**i for i in range(MAX_SPLITS.bit_length()))  # 1, 2, 4, ..., 64


def choose_num_splits(num_seqs: int, num_kv_heads: int, longest: int, device: torch.device) -> int:
    """Enough splits to give the GPU about four programs per streaming multiprocessor, but none
    shorter than MIN_TOKENS_PER_SPLIT tokens; rounded down to one of SPLIT_COUNTS."""
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return split_count(num_seqs, num_kv_heads, longest, num_sms)


def split_count(num_seqs: int, num_kv_heads: int, longest: int, num_sms: int) -> int:
    """`choose_num_splits` on a GPU of `num_sms` multiprocessors."""
    wanted = cdiv(4 * num_sms, num_seqs * num_kv_heads)
    most = max(1, min(wanted, longest // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))
    return 1 << (most.bit_length() - 1)  # the largest power of two <= most


def head_dim_pad(head_dim: int) -> int:
    """A tile's width along the head dimension: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def decode_constants(
    queries_per_kv: int, head_dim: int, block_size: int, num_splits: int, dtype: torch.dtype
) -> dict:
    """The decode kernel's compile-time constants: each distinct set is a kernel of its own,
    compiled on first use (tests/test_kernels_compile_for_gpus.py compiles them for real chips)."""
    return dict(
        QUERIES_PER_KV=queries_per_kv,
        GROUP_PAD=max(16, triton.next_power_of_2(queries_per_kv)),
        HEAD_DIM_PAD=head_dim_pad(head_dim),
        PAGE_SIZE=block_size,
        NUM_SPLITS=num_splits,
        BLOCK_N=BLOCK_N,
        PRECISION=dot_precision(dtype),
    )


def combine_constants(num_splits: int, head_dim: int) -> dict:
    return dict(
        NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM_PAD=head_dim_pad(head_dim),
    )


def paged_decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int = 1,
) -> torch.Tensor:
    """Attention of one query token per sequence over its cached tokens, `[seqs, heads, dim]`.

    `kv` is one layer of the pool, `[2, blocks, block_size, kv_heads, head_dim]`.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv.shape
    queries_per_kv = num_heads // num_kv_heads
    partial_out = torch.empty(
        num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q.contiguous(),
        kv[0],
        kv[1],
        block_tables,
        seq_lens,
        partial_out,
        partial_lse,
        head_dim**-0.5,
        head_dim,
        num_kv_heads,
        block_tables.stride(0),
        **decode_constants(queries_per_kv, head_dim, block_size, num_splits, q.dtype),
    )
    return combine_splits(partial_out, partial_lse).to(q.dtype)


def combine_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor) -> torch.Tensor:
    """Each split's normalised output `[seqs, heads, splits, head_dim]` and log-sum-exp
    `[seqs, heads, splits]` (float32; -inf for an empty split) merged into the attention over
    all the splits' tokens, `[seqs, heads, head_dim]` float32."""
    num_seqs, num_heads, num_splits, head_dim = partial_out.shape
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32, device=partial_out.device)
    _combine_splits_kernel[(num_seqs * num_heads,)](
        partial_out, partial_lse, out, head_dim, **combine_constants(num_splits, head_dim)
    )
    return out


def dot_precision(dtype: torch.dtype) -> str:
    """float32 products in full IEEE precision: a GPU's default TF32 keeps 10 mantissa bits, enough
    to flip a greedy token against transformers."""
    return "ieee" if dtype == torch.float32 else "tf32"


# --- 3. prefill and mixed batches: variable-length query tiles ---


@triton.jit(do_not_specialize=["block_table_stride"])  # as the decode kernel's
def _prefill_kernel(
    q_ptr,  # [tokens, heads, head_dim]: every new token of the step
    out_ptr,  # [tokens, heads, head_dim]
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,  # [seqs + 1]
    tile_seqs_ptr,  # [tiles]: the sequence each query tile belongs to
    tile_starts_ptr,  # [tiles]: its first query token, counted within the sequence's chunk
    scale,
    head_dim,
    num_kv_heads,
    block_table_stride,
    QUERIES_PER_KV: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,  # BLOCK_M // QUERIES_PER_KV query tokens per tile
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_heads = num_kv_heads * QUERIES_PER_KV
    seq = tl.load(tile_seqs_ptr + tile)
    tile_start = tl.load(tile_starts_ptr + tile)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # tokens cached before this step

    # Row r of the tile is query token tile_start + r // QUERIES_PER_KV of the chunk, as seen by
    # query head kv_head * QUERIES_PER_KV + r % QUERIES_PER_KV.
    rows = tl.arange(0, BLOCK_M)
    query_index = tile_start + rows // QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < TOKENS_PER_TILE * QUERIES_PER_KV) & (query_index < query_len)
    query_positions = context_len + query_index
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < head_dim
    q_offsets = ((query_start + query_index[:, None]) * num_heads + heads[:, None]) * head_dim
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_offsets + dims[None, :], mask=q_mask, other=0.0)

    block_table_ptr = block_tables_ptr + seq * block_table_stride
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Keys past the tile's last query position are masked for every row: stop before them.
    last_position = context_len + tl.minimum(tile_start + TOKENS_PER_TILE, query_len) - 1
    for kv_start in range(0, last_position + 1, BLOCK_N):
        tokens = kv_start + tl.arange(0, BLOCK_N)
        in_range = tokens <= last_position
        causal = tokens[None, :] <= query_positions[:, None]
        running_max, running_sum, acc = _attend_tile(
            q, running_max, running_sum, acc, k_cache_ptr, v_cache_ptr, block_table_ptr,
            tokens, in_range, causal & in_range[None, :], kv_head, dims, head_dim, num_kv_heads,
            scale, PAGE_SIZE, PRECISION,
        )  # fmt: skip

    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(out_ptr + q_offsets + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def query_tiles(query_lens: list[int], tokens_per_tile: int) -> tuple[list[int], list[int]]:
    """Cut every sequence's new tokens into tiles: (sequence, first token in its chunk) each."""
    tile_seqs, tile_starts = [], []
    for seq, query_len in enumerate(query_lens):
        for start in range(0, query_len, tokens_per_tile):
            tile_seqs.append(seq)
            tile_starts.append(start)
    return tile_seqs, tile_starts


def prefill_constants(
    queries_per_kv: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> dict:
    """The prefill kernel's compile-time constants (one kernel per distinct set)."""
    return dict(
        QUERIES_PER_KV=queries_per_kv,
        TOKENS_PER_TILE=tokens_per_tile(queries_per_kv),
        HEAD_DIM_PAD=head_dim_pad(head_dim),
        PAGE_SIZE=block_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        PRECISION=dot_precision(dtype),
    )


def paged_prefill_attention(
    q: torch.Tensor, kv: torch.Tensor, metadata: AttentionMetadata, tiles: torch.Tensor
) -> torch.Tensor:
    """Attention of every new token of a mixed batch over its own sequence, `[tokens, heads, dim]`.

    `tiles` is `[2, num_tiles]` (sequences, first tokens) from `query_tiles`.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv.shape
    queries_per_kv = num_heads // num_kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    _prefill_kernel[(tiles.shape[1], num_kv_heads)](
        q,
        out,
        kv[0],
        kv[1],
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        tiles[0],
        tiles[1],
        head_dim**-0.5,
        head_dim,
        num_kv_heads,
        metadata.block_tables.stride(0),
        **prefill_constants(queries_per_kv, head_dim, block_size, q.dtype),
    )
    return out


def tokens_per_tile(queries_per_kv: int) -> int:
    if queries_per_kv > BLOCK_M:
        raise ValueError(f"at most {BLOCK_M} query heads per K/V head, got {queries_per_kv}")
    return BLOCK_M // queries_per_kv


class TritonPagedAttention(PagedAttentionBackend):
    """The "triton" backend: store kernel, then the decode kernel when every sequence decodes
    one token, the prefill kernel otherwise."""

    name = "triton"

    @classmethod
    def for_device(cls, device: torch.device) -> type[PagedAttentionBackend]:
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                f"attention_backend='triton' needs a CUDA device, got {device.type!r} (set "
                "TRITON_INTERPRET=1 before starting Python to run its kernels, slowly, on a CPU)"
            )
        return cls

    @classmethod
    def warm_up(
        cls, kv_cache: PagedKVCache, num_heads: int, max_num_seqs: int, max_num_tokens: int
    ) -> None:
        """Compile every kernel a step can launch before the first request: the store, the
        prefill, and the decode kernel with its combine for each of SPLIT_COUNTS. Otherwise the
        first step with a new split count stops every running request while Triton compiles
        (about a second a kernel). Each launch is one token over block 0, which it only reads
        (its store slot is -1: padding, nothing written). The interpreter compiles nothing.

        Triton also compiles a kernel for each alignment of a pointer: 16 bytes or not. The
        prefill's tile starts are row 1 of the step's `[2, tiles]` table, 16-byte aligned when
        the number of tiles is even, so both an odd and an even number are warmed up."""
        if interpreting():
            return
        layer = kv_cache.layers[0]
        num_kv_heads, head_dim = layer.shape[3], layer.shape[4]
        device = layer.device

        def zeros(*shape, dtype=layer.dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        q, k = zeros(1, num_heads, head_dim), zeros(1, num_kv_heads, head_dim)
        store_kv(layer, k, k, torch.full((1,), -1, dtype=torch.long, device=device))
        one_token = AttentionMetadata.build([1], [1], [[0]], [-1], device=device)
        for num_splits in SPLIT_COUNTS:
            paged_decode_attention(q, layer, one_token.block_tables, one_token.seq_lens, num_splits)
        for num_tiles in (1, 2):  # every tile: sequence 0, token 0
            tiles = torch.zeros(2, num_tiles, dtype=torch.long, device=device)
            paged_prefill_attention(q, layer, one_token, tiles)

    def __init__(self, kv_cache: PagedKVCache, metadata: AttentionMetadata):
        super().__init__(kv_cache, metadata)
        device = metadata.seq_lens.device
        self.all_decode = all(n == 1 for n in metadata.query_lens_list)
        num_kv_heads = kv_cache.layers[0].shape[3]
        longest = max(metadata.seq_lens_list)
        self.num_splits = choose_num_splits(metadata.num_seqs, num_kv_heads, longest, device)
        self.prefill_tiles: torch.Tensor | None = None  # made by the first layer, read by all

    def __call__(self, layer_index: int, q, k, v) -> torch.Tensor:
        kv = self.kv_cache.layers[layer_index]
        store_kv(kv, k, v, self.metadata.slot_mapping)
        if self.all_decode:
            return paged_decode_attention(
                q, kv, self.metadata.block_tables, self.metadata.seq_lens, self.num_splits
            )
        if self.prefill_tiles is None:
            per_tile = tokens_per_tile(q.shape[1] // k.shape[1])
            self.prefill_tiles = torch.tensor(
                query_tiles(self.metadata.query_lens_list, per_tile), device=q.device
            )
        return paged_prefill_attention(q, kv, self.metadata, self.prefill_tiles)
