"""Chapter 06 checks: the Triton kernels that read the paged pool in place.

Without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), on the
same random paged steps as chapter 03's reference: decodes with long contexts split in parts,
mixed prefill chunks that start mid-sequence, block sizes that are not powers of two, grouped
query heads, float32 and float16. Every output is compared with the definition of attention.
Then the engine runs end to end on the triton backend and must produce transformers' greedy
tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from attention_cases import backend_step, paged_batches
from conftest import ENGINE_TEST_FAMILY, assert_pool_is_empty
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")
tl = triton.language

from minivllm.attention import triton_paged  # noqa: E402
from minivllm.attention.torch_paged import (  # noqa: E402
    TorchPagedAttention,
    paged_attention,
    write_kv,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = st.sampled_from([torch.float32, torch.float16])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2}


def on_device(step):
    """The step's pool, metadata and tensors on the test device."""
    step.cache.layers = [layer.to(DEVICE) for layer in step.cache.layers]
    metadata = step.metadata
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(metadata, name, getattr(metadata, name).to(DEVICE))
    step.q, step.new_k, step.new_v = (t.to(DEVICE) for t in (step.q, step.new_k, step.new_v))
    return step


def assert_matches_definition(out: torch.Tensor, step, dtype: torch.dtype) -> None:
    assert out.shape == step.q.shape and out.dtype == step.q.dtype
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), step.expected, atol=tolerance, rtol=tolerance)


@settings(max_examples=25, deadline=None)
@given(
    batch=paged_batches(decodes_only=True, max_cached=200, block_sizes=(1, 3, 16, 32)),
    num_splits=st.integers(1, 4),
    dtype=DTYPES,
)
def test_decode_kernel_equals_attention(batch, num_splits, dtype):
    """One query per sequence over up to 200 cached tokens, split into 1-4 parts merged by
    their log-sum-exps."""
    step = on_device(backend_step(batch, dtype))
    kv = step.cache.layers[0]
    write_kv(kv, step.new_k, step.new_v, step.metadata.slot_mapping)
    out = triton_paged.paged_decode_attention(
        step.q, kv, step.metadata.block_tables, step.metadata.seq_lens, num_splits
    )
    assert_matches_definition(out, step, dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_merge_survives_scores_past_the_exponents_range(num_splits):
    """Sharply peaked attention: queries scaled so scores reach the hundreds, where exp()
    overflows float32 (past about 88.7). The kernel and the split merge subtract the running
    maximum before exponentiating, so the output stays finite and equal to a float64
    reference, with one split and with four."""
    block_size, num_kv_heads, group, head_dim = 16, 1, 2, 8
    sequences = [(150, 1), (90, 1)]
    physical = list(range(20))[::-1]
    batch = (block_size, num_kv_heads, group, head_dim, sequences, physical, 0)
    step = on_device(backend_step(batch))
    kv = step.cache.layers[0]
    write_kv(kv, step.new_k, step.new_v, step.metadata.slot_mapping)
    q = 200 * step.q
    out = triton_paged.paged_decode_attention(
        q, kv, step.metadata.block_tables, step.metadata.seq_lens, num_splits
    )
    expected = paged_attention(q.double(), kv.double(), step.metadata)  # the torch reference
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(
    batch=paged_batches(max_cached=100, max_new=70, max_group=4, block_sizes=(1, 5, 16)),
    dtype=DTYPES,
)
def test_prefill_kernel_equals_attention(batch, dtype):
    """Mixed decodes and prefill chunks (up to 70 new tokens after up to 100 cached), tiled in
    (token, head) rows of 64."""
    step = on_device(backend_step(batch, dtype))
    kv = step.cache.layers[0]
    write_kv(kv, step.new_k, step.new_v, step.metadata.slot_mapping)
    group = step.q.shape[1] // step.new_k.shape[1]
    tiles = triton_paged.query_tiles(
        step.metadata.query_lens_list, triton_paged.tokens_per_tile(group)
    )
    out = triton_paged.paged_prefill_attention(
        step.q, kv, step.metadata, torch.tensor(tiles, device=DEVICE)
    )
    assert_matches_definition(out, step, dtype)


@settings(max_examples=25, deadline=None)
@given(batch=paged_batches(max_cached=80), dtype=DTYPES)
def test_triton_backend_writes_new_tokens_then_attends(batch, dtype):
    """The backend as the model calls it: store kernel, then the decode or the prefill kernel."""
    step = on_device(backend_step(batch, dtype))
    backend = triton_paged.TritonPagedAttention(step.cache, step.metadata)
    out = backend(0, step.q, step.new_k, step.new_v)
    assert_matches_definition(out, step, dtype)
    # The new tokens' K/V are in the pool, at their slots.
    kv = step.cache.layers[0]
    slots = step.metadata.slot_mapping
    num_kv_heads, head_dim = kv.shape[-2:]
    torch.testing.assert_close(kv[0].view(-1, num_kv_heads, head_dim)[slots], step.new_k)
    torch.testing.assert_close(kv[1].view(-1, num_kv_heads, head_dim)[slots], step.new_v)


@settings(max_examples=25, deadline=None)
@given(
    num_slots=st.integers(1, 40),
    data=st.data(),
    num_kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([4, 8, 12]),
)
def test_store_kernel_writes_each_row_at_its_slot_and_skips_padding(
    num_slots, data, num_kv_heads, head_dim
):
    """Distinct slots in any order, some tokens marked -1 (padding): those write nothing."""
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, min_size=1))
    padding = data.draw(st.lists(st.booleans(), min_size=len(slots), max_size=len(slots)))
    slot_mapping = [-1 if pad else slot for slot, pad in zip(slots, padding)]
    block_size = 4
    num_blocks = -(-num_slots // block_size)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE)
    k = torch.randn(len(slots), num_kv_heads, head_dim, device=DEVICE)
    v = torch.randn(len(slots), num_kv_heads, head_dim, device=DEVICE)
    expected = kv.clone()
    real = [i for i, slot in enumerate(slot_mapping) if slot >= 0]
    if real:
        write_kv(
            expected, k[real], v[real], torch.tensor([slot_mapping[i] for i in real], device=DEVICE)
        )
    triton_paged.store_kv(kv, k, v, torch.tensor(slot_mapping, device=DEVICE))
    assert torch.equal(kv, expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_triton_backend_without_gpu_or_interpreter_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend='triton' needs a CUDA device"):
        triton_paged.TritonPagedAttention.for_device(torch.device("cpu"))


def test_engine_on_the_triton_backend_gives_transformers_greedy_tokens(
    tiny_model_dirs, tiny_greedy, tokenizer
):
    """Prompts of different lengths through chunked prefill (budget 24 tokens), a shared prefix
    (prefix-cache hits start a chunk mid-sequence) and decodes: the tokens of model.generate."""
    from minivllm import LLM, SamplingParams

    shared = tokenizer.encode("The history of the printing press begins in")
    prompts = [
        shared + tokenizer.encode(" Germany, where"),
        shared + tokenizer.encode(" Asia, long before"),
        tokenizer.encode("Hi"),
        tokenizer.encode("A list of prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23,"),
    ]
    llm = LLM(
        str(tiny_model_dirs[ENGINE_TEST_FAMILY]),
        attention_backend="triton",
        device=DEVICE,
        block_size=8,
        max_num_batched_tokens=24,
        kv_cache_memory_bytes=1 << 20,
    )
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == tiny_greedy(prompt, 12)
    assert_pool_is_empty(llm.llm_engine)


# --- the learning check: the store kernel -------------------------------------------------


@triton.jit
def _store_kernel_one_head_apart(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, kv_heads, head_dim,
    HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """The typical mistake: slots taken to be head_dim apart, forgetting the K/V heads."""
    token, head = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        dims = tl.arange(0, HEAD_DIM_PAD)
        inside = dims < head_dim
        source = (token * kv_heads + head) * head_dim + dims
        target = (slot + head) * head_dim + dims
        tl.store(k_cache_ptr + target, tl.load(k_ptr + source, mask=inside), mask=inside)
        tl.store(v_cache_ptr + target, tl.load(v_ptr + source, mask=inside), mask=inside)


def _store_kv_one_head_apart(kv, k, v, slot_mapping):
    num_tokens, kv_heads, head_dim = k.shape
    _store_kernel_one_head_apart[(num_tokens, kv_heads)](
        k.contiguous(), v.contiguous(), kv[0], kv[1], slot_mapping, kv_heads, head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def test_store_check_passes_on_minivllm_and_fails_on_a_typical_mistake():
    from minivllm.learning_checks import all_checks, assert_check, run_check

    assert_check("ch06.store_kv", all_checks()["ch06.store_kv"].reference())
    result = run_check("ch06.store_kv", _store_kv_one_head_apart)
    assert not result.passed
    assert "should hold" in result.report and "slot_mapping=" in result.report


def _merge_by_average(outs, lses):
    return outs.mean(dim=0)  # as if every split held as many tokens and as much weight


def _merge_by_exp_without_the_max(outs, lses):
    weights = torch.exp(lses)  # overflows float32 once a split's lse passes ~88
    return (weights[:, :, None] * outs).sum(dim=0) / weights.sum(dim=0)[:, None]


def _merge_normalised_over_heads(outs, lses):
    weights = torch.softmax(lses, dim=1)  # the wrong axis: heads compete, splits do not
    return (weights[:, :, None] * outs).sum(dim=0)


@pytest.mark.parametrize(
    "mistake", [_merge_by_average, _merge_by_exp_without_the_max, _merge_normalised_over_heads]
)
def test_merge_check_passes_on_minivllm_and_fails_on_typical_mistakes(mistake):
    from minivllm.learning_checks import all_checks, assert_check, run_check

    assert_check("ch06.merge_splits", all_checks()["ch06.merge_splits"].reference())
    result = run_check("ch06.merge_splits", mistake)
    assert not result.passed
    assert "expected" in result.report and "split lengths" in result.report


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_compiled_for_the_gpu_at_serving_sizes():
    """On a GPU the kernels compile (no interpreter) and run at serving sizes: 64 sequences of
    2,048 tokens with the splits `choose_num_splits` picks, and a 2,048-token prefill chunk
    after as many cached tokens, in bfloat16, against the reference."""
    from minivllm.bench.attention import one_layer_pool, random_decode_step, random_step
    from minivllm.models.loader import embedded_model_dir, load_model

    config = load_model(embedded_model_dir(), torch.float32, "cpu").config
    pool = one_layer_pool(config, 64, 2048, 16, torch.bfloat16, "cuda")
    for step in (
        random_decode_step(config, pool, 64, 2048),
        random_step(config, pool, [2048], [4096]),
    ):
        reference = TorchPagedAttention(pool, step.metadata)(0, step.q, step.k, step.v)
        out = triton_paged.TritonPagedAttention(pool, step.metadata)(0, step.q, step.k, step.v)
        torch.testing.assert_close(out.float(), reference.float(), atol=2e-2, rtol=2e-2)


@given(
    num_seqs=st.integers(1, 512),
    num_kv_heads=st.integers(1, 16),
    longest=st.integers(1, 200_000),
    num_sms=st.sampled_from([108, 132, 144]),  # A100, H100, H200-class
)
def test_split_counts_are_the_few_that_warm_up_compiles(num_seqs, num_kv_heads, longest, num_sms):
    """A split count is a kernel of its own: the engine only ever chooses one of SPLIT_COUNTS,
    the largest power of two within both limits (programs for the GPU, tokens per split)."""
    splits = triton_paged.split_count(num_seqs, num_kv_heads, longest, num_sms)
    assert splits in triton_paged.SPLIT_COUNTS
    wanted = -(-4 * num_sms // (num_seqs * num_kv_heads))
    limit = max(1, min(wanted, longest // triton_paged.MIN_TOKENS_PER_SPLIT))
    assert splits <= limit and (splits == triton_paged.MAX_SPLITS or 2 * splits > limit)


def test_warm_up_launches_every_kernel_a_step_can_need(monkeypatch):
    """On a GPU, warm_up launches the store, the prefill (odd and even tile counts), and the
    decode (with its combine) at every split count, so Triton compiles them before serving. Here the launches are recorded
    instead of run (the interpreter compiles nothing, and warm_up skips itself under it)."""
    launched = []
    monkeypatch.setattr(triton_paged, "interpreting", lambda: False)
    monkeypatch.setattr(triton_paged, "store_kv", lambda *args: launched.append("store"))
    monkeypatch.setattr(
        triton_paged,
        "paged_decode_attention",
        lambda q, kv, tables, lens, num_splits: launched.append(("decode", num_splits)),
    )
    monkeypatch.setattr(
        triton_paged, "paged_prefill_attention", lambda *args: launched.append("prefill")
    )
    # warm_up reads only the pool's first layer: [K/V, blocks, block_size, kv_heads, head_dim]
    pool = SimpleNamespace(layers=[torch.zeros(2, 4, 16, 2, 16)])
    triton_paged.TritonPagedAttention.warm_up(pool, 4, max_num_seqs=8, max_num_tokens=64)
    decodes = [entry[1] for entry in launched if isinstance(entry, tuple)]
    assert decodes == list(triton_paged.SPLIT_COUNTS)
    # The prefill twice: for an odd and an even number of query tiles (the tile starts' two
    # alignments).
    assert launched.count("store") == 1 and launched.count("prefill") == 2
