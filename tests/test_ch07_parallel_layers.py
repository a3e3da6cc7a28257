"""Chapter 07 checks: each parallel layer, split over two real ranks (two processes in a gloo
group), computes what its unsplit counterpart computes: its slice of the outputs
(column-parallel), the whole output (row-parallel, the embedding), the whole logits on rank 0
(the LM head). Shapes come from hypothesis; the cases themselves are in `parallel_cases.py`.
"""

from __future__ import annotations

import parallel_cases
import pytest
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.bench.parallel import RankPool, allreduce_bytes_per_token
from minivllm.config import ModelConfig

TP = 2
TOLERANCE = 1e-4  # float32, sums in a different order
CASE_SETTINGS = settings(max_examples=12, deadline=None)


@pytest.fixture(scope="module")
def ranks():
    pool = RankPool(TP)
    yield pool
    pool.close()


def assert_close_on_every_rank(differences):
    for rank, difference in enumerate(differences):
        if difference is not None:
            assert difference < TOLERANCE, f"rank {rank} differs by {difference}"


seeds = st.integers(0, 2**16)
tokens = st.integers(1, 5)
widths = st.integers(1, 6).map(lambda n: n * TP)  # a split needs sizes the ranks divide


@CASE_SETTINGS
@given(
    tokens=tokens, input_size=st.integers(1, 12), output_size=widths, bias=st.booleans(), seed=seeds
)
def test_column_parallel_gives_each_rank_its_slice(
    ranks, tokens, input_size, output_size, bias, seed
):
    assert_close_on_every_rank(
        ranks.run(parallel_cases.column, tokens, input_size, output_size, bias, seed)
    )


@CASE_SETTINGS
@given(
    tokens=tokens,
    input_size=st.integers(1, 12),
    sizes=st.lists(widths, min_size=1, max_size=3),
    seed=seeds,
)
def test_merged_column_parallel_stacks_each_parts_slice(ranks, tokens, input_size, sizes, seed):
    assert_close_on_every_rank(
        ranks.run(parallel_cases.merged_column, tokens, input_size, sizes, seed)
    )


@CASE_SETTINGS
@given(
    tokens=tokens,
    head_dim=st.sampled_from([2, 4]),
    num_kv_heads=st.sampled_from([1, 2, 4]),  # 1: fewer KV heads than ranks, each copied
    group=st.integers(1, 3),
    bias=st.booleans(),
    seed=seeds,
)
def test_qkv_parallel_gives_each_rank_its_heads(
    ranks, tokens, head_dim, num_kv_heads, group, bias, seed
):
    num_heads = num_kv_heads * group
    if num_heads % TP:
        num_heads *= TP
        group *= TP
    assert_close_on_every_rank(
        ranks.run(parallel_cases.qkv, tokens, 8, head_dim, num_heads, num_kv_heads, bias, seed)
    )


@CASE_SETTINGS
@given(
    tokens=tokens, input_size=widths, output_size=st.integers(1, 12), bias=st.booleans(), seed=seeds
)
def test_row_parallel_all_reduces_to_the_whole_output(
    ranks, tokens, input_size, output_size, bias, seed
):
    assert_close_on_every_rank(
        ranks.run(parallel_cases.row, tokens, input_size, output_size, bias, seed)
    )


@CASE_SETTINGS
@given(vocab_size=st.integers(1, 40), dim=st.integers(1, 8), seed=seeds, data=st.data())
def test_vocab_parallel_embedding_looks_every_id_up(ranks, vocab_size, dim, seed, data):
    """Odd vocabularies too: the last rank's share is padded with rows no id reaches."""
    ids = data.draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=8))
    assert_close_on_every_rank(ranks.run(parallel_cases.embedding, vocab_size, dim, ids, seed))


@CASE_SETTINGS
@given(vocab_size=st.integers(1, 40), dim=st.integers(1, 8), tokens=tokens, seed=seeds)
def test_parallel_lm_head_gathers_the_whole_vocabulary_on_rank_0(
    ranks, vocab_size, dim, tokens, seed
):
    differences = ranks.run(parallel_cases.lm_head, vocab_size, dim, tokens, seed)
    assert differences[0] is not None and differences[1] is None
    assert_close_on_every_rank(differences)


def test_a_case_with_a_wrong_answer_fails(ranks):
    """The harness can fail: a row-parallel layer that skips its all-reduce returns a partial
    sum, which the comparison must catch."""
    differences = ranks.run(parallel_cases.row_without_all_reduce, 3, 4, 5, 7)
    assert any(difference > TOLERANCE for difference in differences)


def test_allreduce_bytes_per_token_counts_two_per_layer_and_the_embedding():
    config = ModelConfig(
        model_type="llama",
        vocab_size=10,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    assert allreduce_bytes_per_token(config) == (2 * 30 + 1) * 576 * 4
    assert allreduce_bytes_per_token(config, element_size=2) == (2 * 30 + 1) * 576 * 2


def test_tp_size_must_fit_the_heads():
    """vLLM's rule: query heads divide by the size; KV heads divide by it or divide it."""
    config = ModelConfig("llama", 10, 64, 192, 2, 9, 3, 16, 1e-5, 64, True)
    config.check_tensor_parallel_size(3)
    config.check_tensor_parallel_size(1)
    with pytest.raises(ValueError, match="9 query heads do not divide"):
        config.check_tensor_parallel_size(2)
    replicated = ModelConfig("llama", 10, 64, 192, 2, 4, 1, 16, 1e-5, 64, True)
    replicated.check_tensor_parallel_size(4)
    assert replicated.per_rank(4).num_kv_heads == 1 and replicated.per_rank(4).num_heads == 1
    uneven = ModelConfig("llama", 10, 64, 192, 2, 8, 6, 16, 1e-5, 64, True)
    with pytest.raises(ValueError, match="6 KV heads neither divide"):
        uneven.check_tensor_parallel_size(4)


def _row_parallel_with_bias_on_every_rank(x_shard, weight_shard, bias, tp):
    """Adds the bias before the all-reduce: it is counted once per rank."""
    out = F.linear(x_shard, weight_shard, bias)
    return tp.all_reduce(out)


def test_row_parallel_check_passes_on_minivllm_and_fails_on_a_typical_mistake():
    from minivllm.learning_checks import all_checks, assert_check, run_check

    assert_check("ch07.row_parallel_linear", all_checks()["ch07.row_parallel_linear"].reference())
    result = run_check("ch07.row_parallel_linear", _row_parallel_with_bias_on_every_rank)
    assert not result.passed
    assert "expected x @ W.T + bias" in result.report


def test_a_rank_that_skips_the_all_reduce_fails_in_seconds_not_never(monkeypatch):
    """The learning check's simulated ranks: when one rank never calls all_reduce, the others
    stop waiting after MEETING_TIMEOUT_S with an error that names the rule."""
    import torch

    from minivllm.learning_checks.chapter07 import ThreadRanks

    both_reduce = ThreadRanks(2).run(
        lambda x, tp: tp.all_reduce(x), [(torch.ones(2),), (torch.ones(2),)]
    )
    assert [out.tolist() for out in both_reduce] == [[2.0, 2.0], [2.0, 2.0]]

    def only_rank_0_reduces(x, tp):
        return tp.all_reduce(x) if tp.rank == 0 else x

    monkeypatch.setattr(ThreadRanks, "MEETING_TIMEOUT_S", 0.5)  # the wait this test sits out
    with pytest.raises(RuntimeError, match="every rank must call all_reduce"):
        ThreadRanks(2).run(only_rank_0_reduces, [(torch.ones(2),), (torch.ones(2),)])
