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

from minivllm.attention import flex_paged
from minivllm.attention.torch_paged import TorchPagedAttention

# One pool and head layout: every example reuses the same few compiled kernels.
FIXED_SHAPES = dict(block_sizes=(16,), head_dims=(16,), kv_heads=(3,), max_group=3, pool_blocks=32)


@settings(max_examples=15, deadline=None)
@given(batch=paged_batches(max_cached=100, max_new=40, **FIXED_SHAPES))
def test_flex_backend_equals_attention(batch):
    """Decodes (one batched call) and prefill chunks that start mid-sequence (one call each)."""
    step = backend_step(batch)
    backend = flex_paged.FlexPagedAttention(step.cache, step.metadata)
    out = backend(0, step.q, step.new_k, step.new_v)
    assert out.shape == step.q.shape
    torch.testing.assert_close(out.double(), step.expected, atol=1e-5, rtol=1e-5)


def test_block_mask_lists_each_sequence_its_own_blocks_up_to_its_last_query():
    """Two sequences in one decode call, padded to a batch of 2, a pool of 8 blocks of 4."""
    from minivllm.attention.backend import AttentionMetadata

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
