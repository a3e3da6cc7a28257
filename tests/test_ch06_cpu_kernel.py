"""Chapter 06, "The same kernel on a CPU": the C++ paged-attention kernel and its work plan.

The kernel is built at first use (the test session's first call builds it, later ones load
the cached library). It is checked on the random paged steps that check chapter 03's
reference: shuffled block tables, prefill chunks that start mid-sequence mixed with decodes,
contexts up to 2,000 tokens split along their keys, grouped query heads, the head sizes of
real models, float32 and bfloat16, against the definition of attention in float64. Then the
engine, whose `auto` backend on a CPU is this one (so every engine test of the suite runs on
it), gives transformers' greedy tokens; bad calls raise; without a compiler the engine warns
and runs the torch reference.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from attention_cases import backend_step, paged_batches
from conftest import ENGINE_TEST_FAMILY, assert_pool_is_empty
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ch04_engine import pool_bytes

from minivllm import cpu_kernels
from minivllm.attention import cpu_paged
from minivllm.attention.backend import (
    get_attention_backend,
    query_starts,
    resolve_attention_backend_name,
)
from minivllm.attention.torch_paged import TorchPagedAttention
from minivllm.utils import cdiv

if cpu_kernels.load_kernels() is None:
    pytest.fail("the CPU attention kernel did not build on this machine (see the warning)")

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
REAL_HEAD_DIMS = (64, 80, 96, 128)


def run_kernel(step, num_threads: int, min_split_keys: int) -> torch.Tensor:
    """One layer's attention on the kernel, planned as if `num_threads` cores wanted work:
    many threads and a short minimum split make the plan cut every long decode."""
    kv = step.cache.layers[0]
    num_kv_heads, head_dim = kv.shape[-2:]
    plan = cpu_paged.plan_work(
        step.metadata, num_kv_heads, step.cache.block_size, num_threads, min_split_keys
    )
    return cpu_paged.store_and_attend(kv, step.q, step.new_k, step.new_v, plan, head_dim**-0.5)


def assert_matches_definition(out: torch.Tensor, step, dtype: torch.dtype) -> None:
    assert out.shape == step.q.shape and out.dtype == dtype
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), step.expected, atol=tolerance, rtol=tolerance)


@settings(max_examples=40, deadline=None)
@given(
    batch=paged_batches(
        block_sizes=(1, 3, 16, 32),
        head_dims=(4, *REAL_HEAD_DIMS),
        max_group=8,
        max_cached=2000,
        max_new=40,
    ),
    num_threads=st.integers(1, 64),
    min_split_keys=st.sampled_from([1, 16, 256]),
    dtype=DTYPES,
)
def test_kernel_equals_attention(batch, num_threads, min_split_keys, dtype):
    """Decodes and chunks in one call, contexts up to 2,040 tokens, split or not."""
    step = backend_step(batch, dtype)
    assert_matches_definition(run_kernel(step, num_threads, min_split_keys), step, dtype)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", REAL_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_group_and_head_size_of_real_models(group, head_dim, dtype):
    """A long decode cut into splits, a chunk starting mid-sequence and a fresh prefill, with
    the GQA groups and head sizes of real models (SmolLM2: 3 and 64; Llama-3-8B: 4 and 128)."""
    sequences = [(700, 1), (37, 20), (0, 33)]
    batch = (16, 2, group, head_dim, sequences, list(range(60))[::-1], 7)
    step = backend_step(batch, dtype)
    assert_matches_definition(run_kernel(step, 64, 64), step, dtype)


@pytest.mark.parametrize("min_split_keys", [1, 100_000])
def test_scores_past_the_range_of_exp_stay_exact(min_split_keys):
    """Queries scaled until scores reach the hundreds, where exp() overflows float32 (past
    about 88.7): the running maximum is subtracted before every exponential, in the kernel
    and in the merge of splits, so the output is still the float64 definition."""
    batch = (8, 1, 2, 64, [(300, 1), (120, 9)], list(range(60)), 3)
    step = backend_step(batch, torch.float32)
    step.q *= 40.0
    in_float64 = copy.copy(step.cache)
    in_float64.layers = [layer.double() for layer in step.cache.layers]
    reference = TorchPagedAttention(in_float64, step.metadata)(
        0, step.q.double(), step.new_k.double(), step.new_v.double()
    )
    out = run_kernel(step, 64, min_split_keys)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)


# --- the work plan -------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    batch=paged_batches(max_cached=3000, max_new=40, block_sizes=(1, 16, 32)),
    num_threads=st.integers(1, 64),
    min_split_keys=st.sampled_from([1, 16, 256]),
)
def test_plan_covers_every_row_and_key_exactly_once(batch, num_threads, min_split_keys):
    """Every (query row, K/V head) is attended over its visible keys exactly once: prefill rows
    in one item each, a decode's keys in disjoint splits whose edges are block edges, so no
    block is read by two splits, and every split row has a merge with its number of splits."""
    block_size, num_kv_heads, _, _, sequences, _, _ = batch
    step = backend_step(batch)
    plan = cpu_paged.plan_work(step.metadata, num_kv_heads, block_size, num_threads, min_split_keys)
    row_starts = query_starts([new for _, new in sequences])
    seen: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for seq, head, row_begin, row_end, first, key_begin, key_end, split in plan.work.tolist():
        for row in range(row_begin, row_end):
            seen.setdefault((row, head), []).append((key_begin, key_end, split))
        assert row_end - row_begin <= cpu_paged.QUERY_TILE
        assert first == sequences[seq][0] + row_begin - row_starts[seq]
    merges = dict(plan.merges.tolist())
    row = 0
    for cached, new in sequences:
        for offset in range(new):
            for head in range(num_kv_heads):
                ranges = sorted(seen.pop((row, head)))
                if len(ranges) == 1:
                    ((key_begin, key_end, split),) = ranges
                    assert split == -1 and key_begin == 0 and key_end >= cached + offset + 1
                else:
                    assert new == 1 and merges[row] == len(ranges) <= plan.max_splits
                    assert [s for _, _, s in sorted(ranges, key=lambda r: r[2])] == list(
                        range(len(ranges))
                    )
                    edges = [
                        edge for key_begin, key_end, _ in ranges for edge in (key_begin, key_end)
                    ]
                    assert edges[0] == 0 and edges[-1] == cached + 1
                    assert all(a == b for a, b in zip(edges[1:-1:2], edges[2::2]))
                    assert all(edge % block_size == 0 for edge in edges[1:-1])
            row += 1
    assert not seen  # no item attends a row that is not in the batch


def test_plan_splits_long_decodes_only_when_threads_would_idle():
    """Four decodes of 4,000 tokens over 4 K/V heads already give 16 items: enough for 2
    threads, so none is split; with 32 threads each is split until there are 4 items a thread."""
    batch = (16, 4, 1, 8, [(3999, 1)] * 4, list(range(4 * 250)), 0)
    step = backend_step(batch)
    assert cpu_paged.plan_work(step.metadata, 4, 16, 2).max_splits == 1
    wide = cpu_paged.plan_work(step.metadata, 4, 16, 32)
    assert wide.max_splits == cdiv(4 * 32, 16) and len(wide.work) == 4 * 32


# --- bad calls -------------------------------------------------------------------------


def planned_step():
    batch = (4, 1, 2, 8, [(10, 1), (0, 5)], list(range(8)), 0)
    step = backend_step(batch)
    plan = cpu_paged.plan_work(step.metadata, 1, 4, 2)
    return step, plan


@pytest.mark.parametrize(
    "mistake, message",
    [
        ("block id past the pool", "names block 99"),
        ("negative slot", "has slot -1"),
        ("float64 queries", "share one dtype"),
        ("int64 block tables", "block_tables must be contiguous int32"),
        ("head size unlike the pool's", "head size"),
        ("rows past the batch", "not in the batch"),
    ],
)
def test_bad_calls_raise_instead_of_reading_outside_the_pool(mistake, message):
    step, plan = planned_step()
    kv, q = step.cache.layers[0], step.q
    if mistake == "block id past the pool":
        plan.block_tables[0, 1] = 99
    elif mistake == "negative slot":
        plan.slot_mapping[0] = -1
    elif mistake == "float64 queries":
        q = q.double()
    elif mistake == "int64 block tables":
        plan.block_tables = plan.block_tables.long()
    elif mistake == "head size unlike the pool's":
        q = q[..., :4]
    elif mistake == "rows past the batch":
        plan.work[0, 3] = 100
    with pytest.raises(RuntimeError, match=message):
        cpu_paged.store_and_attend(kv, q, step.new_k, step.new_v, plan, 0.5)


# --- the engine ----------------------------------------------------------------------------


def test_auto_is_the_cpu_kernel_on_a_cpu():
    """So every engine test of the suite that runs on a CPU with the default backend runs on
    this kernel."""
    cpu = torch.device("cpu")
    assert resolve_attention_backend_name("auto", cpu) == "cpu"
    assert get_attention_backend("cpu").for_device(cpu) is cpu_paged.CpuPagedAttention
    with pytest.raises(ValueError, match="runs on the CPU"):
        cpu_paged.CpuPagedAttention.for_device(torch.device("cuda"))


PROMPT_TEXTS = (
    "The history of the printing press begins in",
    "Hi",
    "A list of prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23,",
)


def engine_prompts(tokenizer) -> list[list[int]]:
    shared = tokenizer.encode(PROMPT_TEXTS[0])
    return [
        shared + tokenizer.encode(" Germany, where"),
        shared + tokenizer.encode(" Asia, long before"),
        tokenizer.encode(PROMPT_TEXTS[1]),
        tokenizer.encode(PROMPT_TEXTS[2]),
    ]


def generate_on(model_dir, prompts, **engine_args):
    from minivllm import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        block_size=8,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
        **engine_args,
    )
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [output.outputs[0].token_ids for output in outputs]


def test_engine_on_the_cpu_kernel_gives_transformers_greedy_tokens(
    tiny_model_dirs, tiny_greedy, tokenizer
):
    """Chunked prefill (24 tokens a step), prefix-cache hits that start a chunk mid-sequence,
    and a pool of 12 blocks for four sequences, so some are preempted and recomputed."""
    prompts, model_dir = engine_prompts(tokenizer), tiny_model_dirs[ENGINE_TEST_FAMILY]
    llm, tokens = generate_on(
        model_dir,
        prompts,
        attention_backend="cpu",
        kv_cache_memory_bytes=pool_bytes(model_dir, 12, 8),
    )
    assert llm.llm_engine.executor.driver_worker.attention_backend.name == "cpu"
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert tokens == [tiny_greedy(p, 12) for p in prompts]
    assert_pool_is_empty(llm.llm_engine)


def test_without_a_compiler_the_engine_warns_and_gives_the_same_tokens(
    monkeypatch, tiny_model_dirs, tiny_greedy, tokenizer
):
    """No compiler on the PATH: one warning naming why, then the torch reference runs."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "get_cxx_compiler", lambda: "no-such-compiler-c++")
    cpu_kernels.load_kernels.cache_clear()
    prompts = engine_prompts(tokenizer)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            llm, tokens = generate_on(tiny_model_dirs[ENGINE_TEST_FAMILY], prompts)
    finally:
        cpu_kernels.load_kernels.cache_clear()
    reasons = [str(w.message) for w in caught if "C++ CPU kernels" in str(w.message)]
    assert len(reasons) == 1 and "no C++ compiler found" in reasons[0]
    assert llm.llm_engine.executor.driver_worker.attention_backend is TorchPagedAttention
    assert tokens == [tiny_greedy(p, 12) for p in prompts]
    assert_pool_is_empty(llm.llm_engine)


def test_an_interrupted_builds_lock_is_removed_and_a_running_builds_is_kept(tmp_path):
    """A lock file older than any build is what a killed build leaves: without removing it,
    every later process would wait on it for ever. A young one is a build in progress."""
    lock = tmp_path / "lock"
    assert not cpu_kernels.remove_stale_lock(tmp_path)  # no lock: nothing to do
    lock.touch()
    now = lock.stat().st_mtime
    assert not cpu_kernels.remove_stale_lock(tmp_path, now=now + 60)
    assert lock.exists()
    with pytest.warns(UserWarning, match="interrupted"):
        removed = cpu_kernels.remove_stale_lock(
            tmp_path, now=now + cpu_kernels.STALE_LOCK_SECONDS + 1
        )
    assert removed and not lock.exists()
