"""Chapter 06 checks: the FlexAttention backend, natively on the CPU.

flex_attention is compiled once per padded shape, so these checks keep the shapes few (one pool
size, one head layout per test) and vary what matters inside them: sequence lengths, the mix of
decodes and prefill chunks, where the blocks lie, what the rest of the pool holds. Then the
engine runs the embedded model on the flex backend and must produce transformers' greedy
tokens; and where flex cannot compile, the engine falls back to the torch backend, saying so.
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import backend_step, paged_batches
from conftest import CHAT_MESSAGES, ENGINE_TEST_FAMILY, chat_prompt_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.attention import flex_paged
from minivllm.attention.backend import AttentionMetadata
from minivllm.attention.torch_paged import TorchPagedAttention

# One pool and head layout: every example reuses the same few compiled kernels.
FIXED_SHAPES = dict(block_sizes=(16,), head_dims=(16,), kv_heads=(3,), max_group=3, pool_blocks=32)


@settings(max_examples=10, deadline=None)
@given(batch=paged_batches(max_cached=100, max_new=40, **FIXED_SHAPES))
def test_flex_backend_equals_attention(batch):
    """Decodes (one batched call) and prefill chunks that start mid-sequence (one call each),
    reading the pool's table of block owners as the engine's steps do (one shape for every
    step: rows for the strategy's 5 sequences at most)."""
    step = backend_step(batch)
    flex_paged._owner_tables[step.cache] = flex_paged.BlockOwnerTable(
        step.cache.num_blocks, 5, step.cache.layers[0].device
    )
    backend = flex_paged.FlexPagedAttention(step.cache, step.metadata)
    out = backend(0, step.q, step.new_k, step.new_v)
    assert out.shape == step.q.shape
    torch.testing.assert_close(out.double(), step.expected, atol=1e-5, rtol=1e-5)


def test_block_mask_lists_each_sequence_its_own_blocks_up_to_its_last_query():
    """Two sequences in one decode call, padded to a batch of 2, a pool of 8 blocks of 4."""
    metadata = AttentionMetadata.build(
        query_lens=[1, 1], seq_lens=[6, 3], block_tables=[[7, 2], [5]], slot_mapping=[9, 22]
    )
    call = flex_paged.build_call(metadata, [0, 1], num_pool_blocks=8, block_size=4, group=3)
    mask = call.block_mask
    assert mask.kv_num_blocks[:, 0, 0].tolist() == [2, 1]
    assert mask.kv_indices[0, 0, 0, :2].tolist() == [7, 2]
    assert mask.kv_indices[1, 0, 0, :1].tolist() == [5]
    # Sequence 0's query (position 5) sees slots 28-31 (block 7) and 8-9 (positions 4, 5 of
    # block 2), not slot 10 (position 6, not written yet) nor sequence 1's block 5.
    visible = [
        kv
        for kv in range(32)
        if mask.mask_mod(torch.tensor(0), 0, torch.tensor(0), torch.tensor(kv))
    ]
    assert visible == [8, 9, 28, 29, 30, 31]


def test_engine_on_flex_gives_transformers_greedy_tokens(
    embedded_dir, tokenizer, transformers_greedy
):
    """The embedded model, four chat prompts of different lengths, chunked prefill: the tokens
    of model.generate for each prompt alone."""
    from minivllm import LLM, SamplingParams

    prompts = [chat_prompt_ids(tokenizer, message) for message in CHAT_MESSAGES]
    llm = LLM(
        attention_backend="flex",
        max_num_seqs=4,  # few shapes to compile: decodes of 1, 2, 4; chunks of 16 to 64 tokens
        max_num_batched_tokens=64,
        kv_cache_memory_bytes=16 * 2**20,
    )
    assert llm.llm_engine.executor.driver_worker.attention_backend is flex_paged.FlexPagedAttention
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=10, temperature=0.0),
        use_tqdm=False,
    )
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == transformers_greedy(prompt, 10)


def test_engine_falls_back_to_torch_where_flex_does_not_compile(monkeypatch):
    monkeypatch.setattr(flex_paged, "flex_compiles", lambda device_type: False)
    with pytest.warns(UserWarning, match="using the 'torch' backend instead"):
        chosen = flex_paged.FlexPagedAttention.for_device(torch.device("cpu"))
    assert chosen is TorchPagedAttention


def test_the_probe_tries_a_prompt_chunk_as_well_as_a_decode(monkeypatch):
    """flex_compiles runs both kinds of call a step makes: a kernel that only fails on a prompt
    chunk's block mask is found at start, not at the first long prompt."""
    shapes = []
    real = flex_paged.flex_paged_attention

    def recording(q, kv, calls):
        shapes.append(tuple(calls[0].rows.shape))  # [sequences, queries per sequence]
        return real(q, kv, calls)

    monkeypatch.setattr(flex_paged, "flex_paged_attention", recording)
    flex_paged.flex_compiles.cache_clear()
    try:
        assert flex_paged.flex_compiles("cpu")
    finally:
        flex_paged.flex_compiles.cache_clear()
    assert shapes[0] == (1, 1) and shapes[1][1] > 1


def test_a_benchmark_row_named_flex_refuses_to_time_the_fallback(tiny_model_dirs, monkeypatch):
    """Where flex cannot run, the engine falls back to the torch backend; a benchmark method
    named "engine:flex" then stops with an error instead of timing torch under flex's name."""
    from minivllm.bench.benchmark import BenchmarkContext, run_benchmark
    from minivllm.bench.workloads import Workload

    monkeypatch.setattr(flex_paged, "flex_compiles", lambda device_type: False)
    ctx = BenchmarkContext.load(tiny_model_dirs[ENGINE_TEST_FAMILY])
    workload = Workload("tiny", [[5, 6, 7]], [2], "one request")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="fell back to 'torch'"):
        run_benchmark(ctx, workload, ["engine:flex"], measure_peak=False)


POOL_BLOCKS, OWNER_BLOCK_SIZE, MAX_SEQS = 12, 4, 4


@st.composite
def decode_steps(draw) -> AttentionMetadata:
    """One step's batch over a pool of 12 blocks of 4: 1-4 sequences, each with its own blocks
    in any order (sequences may share a block, as prefix caching makes them)."""
    num_seqs = draw(st.integers(1, MAX_SEQS))
    seq_lens = draw(st.lists(st.integers(1, 24), min_size=num_seqs, max_size=num_seqs))
    tables = [
        draw(st.permutations(range(POOL_BLOCKS)))[: -(-n // OWNER_BLOCK_SIZE)] for n in seq_lens
    ]
    slots = [
        t[(n - 1) // OWNER_BLOCK_SIZE] * OWNER_BLOCK_SIZE + (n - 1) % OWNER_BLOCK_SIZE
        for t, n in zip(tables, seq_lens)
    ]
    return AttentionMetadata.build([1] * num_seqs, seq_lens, tables, slots)


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(decode_steps(), min_size=1, max_size=6))
def test_the_kept_table_of_block_owners_is_a_fresh_one_at_every_step(steps):
    """The backend keeps the pool-wide table between steps and rewrites only what changed: at
    every step of a run it must equal the table made afresh, with nothing left from the steps
    before in any row (a row no sequence uses this step is all -1)."""
    kept = flex_paged.BlockOwnerTable(POOL_BLOCKS, MAX_SEQS, torch.device("cpu"))
    for metadata in steps:
        table = kept.update(metadata, OWNER_BLOCK_SIZE)
        fresh = flex_paged.block_owners(metadata, POOL_BLOCKS, OWNER_BLOCK_SIZE)
        assert table.shape == (MAX_SEQS, POOL_BLOCKS + 1)
        assert torch.equal(table[: metadata.num_seqs], fresh[: metadata.num_seqs])
        assert (fresh[metadata.num_seqs :] == -1).all()
        assert (table[metadata.num_seqs :] == -1).all()
        for row, (table_row, n) in enumerate(
            zip(metadata.block_tables_list, metadata.seq_lens_list)
        ):
            for logical, physical in enumerate(table_row[: -(-n // OWNER_BLOCK_SIZE)]):
                assert table[row, physical] == logical


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("query_len", [1, 7, 40])
def test_block_mask_tiles_are_ones_a_gpu_kernel_divides(group, query_len):
    """inductor's GPU kernels (torch/_inductor/kernel/flex/flex_attention.py for prompt chunks,
    flex_decoding.py for decodes) refuse a block mask whose query tile their own BLOCK_M does
    not divide, or whose KV tile BLOCK_N does not divide; tensor-core products need tiles of
    at least 16 on a side, and flex_decoding takes BLOCK_M = the rows rounded up to a power of
    two, at least 16. The tiles the backend asks for (`kernel_options` on CUDA) must obey that
    for every call it builds: a decode of 1-8 query heads per K/V head, a chunk of a prompt."""
    block_size = 16
    num_tokens = 30 + query_len
    table = list(range(-(-num_tokens // block_size)))
    metadata = AttentionMetadata.build(
        [query_len], [num_tokens], [table], list(range(num_tokens - query_len, num_tokens))
    )
    call = flex_paged.build_call(metadata, [0], len(table), block_size, group)
    query_tile, kv_tile = call.block_mask.BLOCK_SIZE
    options = flex_paged.kernel_options(query_tile, kv_tile, torch.device("cuda"))
    block_m, block_n = options["BLOCK_M"], options["BLOCK_N"]
    for side in (block_m, block_n):
        assert side >= 16 and side & (side - 1) == 0, options
    assert query_tile % block_m == 0 and kv_tile % block_n == 0
    if query_len == 1:
        rows = group  # a decode's rows: its token for each query head of the K/V head
        assert query_tile % max(16, 1 << (rows - 1).bit_length()) == 0
    assert flex_paged.kernel_options(query_tile, kv_tile, torch.device("cpu")) == {}


def test_flex_on_a_gpu_refuses_a_block_size_its_kernel_cannot_tile():
    for block_size in (16, 32, 64):
        flex_paged.check_block_size(block_size, torch.device("cuda"))
    for block_size in (1, 8, 24):
        with pytest.raises(ValueError, match="block_size a power of two, at least 16"):
            flex_paged.check_block_size(block_size, torch.device("cuda"))
    flex_paged.check_block_size(8, torch.device("cpu"))  # the CPU kernel takes any
