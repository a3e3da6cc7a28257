"""Chapter 11 checks: what CUDA graphs rely on, checked where no GPU is needed.

A recorded decode step is replayed with new values in the same buffers, by kernels whose
launch parameters were fixed when it was recorded. So: every decode batch has a bucket and the
smallest one is chosen; the buffers hold the step's rows followed by padding rows that write
only to the padding block; and the Triton backend, built once over the buffers while they held
nothing but padding (as at capture), answers a step filled in afterwards with the definition of
attention (its kernels run in Triton's interpreter here). On a GPU, the engine with graphs gives
the eager engine's greedy tokens.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from attention_cases import attention_config, backend_step, paged_batches
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.attention import triton_paged
from minivllm.attention.backend import PagedKVCache
from minivllm.compilation.cuda_graphs import GraphInputs, bucket_for, capture_sizes
from minivllm.utils import cdiv

MAX_CONTEXT = 40  # the longest sequence a test's block tables hold


@given(max_num_seqs=st.integers(1, 600))
def test_every_decode_batch_has_the_smallest_bucket_that_holds_it(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert sizes[: min(4, len(sizes))] == [1, 2, 4, 8][: len(sizes)]
    assert all(size % 8 == 0 for size in sizes[4:])
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))
    assert sizes[-1] >= max_num_seqs and (len(sizes) == 1 or sizes[-2] < max_num_seqs)
    for num_seqs in range(1, max_num_seqs + 1):
        bucket = bucket_for(num_seqs, sizes)
        assert bucket >= num_seqs
        assert all(size < num_seqs for size in sizes if size < bucket)
    assert bucket_for(sizes[-1] + 1, sizes) is None


def test_inputs_hold_the_step_then_padding_and_the_metadata_reads_them_in_place():
    block_size, padding_block = 4, 9
    inputs = GraphInputs.allocate(8, cdiv(MAX_CONTEXT, block_size), padding_block, "cpu")
    inputs.fill([11, 12], [5, 0], [21, 30], [6, 1], [[5, 2], [7]], size=4, block_size=block_size)
    assert inputs.input_ids[:4].tolist() == [11, 12, 0, 0]
    assert inputs.positions[:4].tolist() == [5, 0, 0, 0]
    assert inputs.slot_mapping[:4].tolist() == [21, 30, 36, 36]  # padding: the padding block
    assert inputs.seq_lens[:4].tolist() == [6, 1, 1, 1]
    assert inputs.block_tables[0].tolist()[:3] == [5, 2, 9]
    assert inputs.block_tables[2].tolist() == [9] * inputs.block_tables.shape[1]
    metadata = inputs.metadata(4, block_size)
    for name in ("slot_mapping", "seq_lens", "block_tables"):
        view, buffer = getattr(metadata, name), getattr(inputs, name)
        assert view.data_ptr() == buffer.data_ptr() and len(view) == 4
    assert metadata.query_lens_list == [1] * 4
    assert max(metadata.seq_lens_list) == inputs.block_tables.shape[1] * block_size


@settings(max_examples=15, deadline=None)
@given(
    batch=paged_batches(decodes_only=True, max_cached=MAX_CONTEXT - 1, block_sizes=(1, 4, 16)),
    num_splits=st.integers(1, 4),
)
def test_a_backend_built_at_capture_answers_the_step_filled_in_later(batch, num_splits):
    """Capture: the buffers hold only padding when the backend is built (its split count
    fixed then, as a GPU would choose it). Replay: the step's rows are copied in; attention of
    the real rows is the definition's, and the padding rows wrote nothing but the padding
    block."""
    step = backend_step(batch)
    block_size = step.cache.block_size
    num_blocks = step.cache.num_blocks
    pool = PagedKVCache(step_config(step), num_blocks + 1, block_size, torch.float32, "cpu")
    pool.layers[0][:, :num_blocks] = step.cache.layers[0]
    expected_pool = pool.layers[0].clone()
    triton_paged.store_kv(expected_pool, step.new_k, step.new_v, step.metadata.slot_mapping)

    num_seqs = step.metadata.num_seqs
    size = bucket_for(num_seqs, capture_sizes(5))
    inputs = GraphInputs.allocate(8, cdiv(MAX_CONTEXT, block_size), num_blocks, "cpu")
    inputs.fill([], [], [], [], [], size, block_size)
    with mock.patch.object(triton_paged, "choose_num_splits", lambda *args: num_splits):
        attention = triton_paged.TritonPagedAttention(pool, inputs.metadata(size, block_size))
    assert attention.all_decode and attention.num_splits == num_splits

    seq_lens = step.metadata.seq_lens_list
    inputs.fill(
        [0] * num_seqs,
        [n - 1 for n in seq_lens],
        step.new_slots,
        seq_lens,
        step.metadata.block_tables_list,
        size,
        block_size,
    )
    q, k, v = (padded(t, size) for t in (step.q, step.new_k, step.new_v))
    out = attention(0, q, k, v)
    torch.testing.assert_close(out[:num_seqs].double(), step.expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.layers[0][:, :num_blocks], expected_pool[:, :num_blocks])


def step_config(step):
    """The attention shapes of a drawn step."""
    num_kv_heads, head_dim = step.cache.layers[0].shape[-2:]
    return attention_config(num_heads=step.q.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim)


def padded(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """`tensor`'s rows followed by zero rows up to `size` (what padding rows carry)."""
    out = torch.zeros(size, *tensor.shape[1:], dtype=tensor.dtype)
    out[: len(tensor)] = tensor
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_give_the_eager_engines_greedy_tokens(embedded_dir, chat_prompts):
    """Decode steps replayed from graphs (batches of 1 to 5, each padded to its bucket) give
    the tokens of the same engine run eagerly, float32."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 17, 30)
    ]
    prompts = [{"prompt_token_ids": p} for p in chat_prompts]
    results = {}
    for enforce_eager in (True, False):
        llm = LLM(
            model=str(embedded_dir),
            dtype="float32",
            enforce_eager=enforce_eager,
            max_num_seqs=5,
            kv_cache_memory_bytes=2**28,
        )
        runner = llm.llm_engine.executor.driver_worker.model_runner
        assert (runner.cuda_graphs is None) == enforce_eager
        results[enforce_eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert results[False] == results[True]
