"""Chapter 11 checks: a compiled model changes how a step runs, never which tokens it makes.

The model compiled by torch.compile (attention an opaque operator, the products on the same
packed oneDNN weights) gives transformers' greedy float32 tokens, on a mixed batch agrees with
eager to float32 rounding, and never mixes up two models of the same shape. The checks compile
a tiny two-layer model of the embedded model's family (inductor's compile time grows with the
layers, and every layer is the same code); notebook 11 compiles the embedded model itself.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import ENGINE_TEST_FAMILY, EOS_TOKEN_ID

from minivllm import LLM, SamplingParams
from minivllm.attention.backend import AttentionMetadata, PagedKVCache, slot_mapping
from minivllm.attention.torch_paged import TorchPagedAttention
from minivllm.compilation.compiled_model import CompiledModel
from minivllm.compilation.forward_context import OPAQUE_ATTENTION
from minivllm.config import EngineConfig
from minivllm.models.loader import load_model
from minivllm.models.tiny import make_tiny_model

BLOCK_SIZE = 4


def attention_over(pool, query_lens, seq_lens, tables):
    """The reference backend over `pool`, for one step of sequences."""
    slots = []
    for table, query_len, seq_len in zip(tables, query_lens, seq_lens):
        slots += slot_mapping(table, BLOCK_SIZE, seq_len - query_len, seq_len)
    return TorchPagedAttention(pool, AttentionMetadata.build(query_lens, seq_lens, tables, slots))


@torch.inference_mode()
def mixed_batch(model, prompt_lens: list[int], decode_lens: list[int]):
    """A step with one whole prompt per `prompt_lens` entry and one decode per `decode_lens`
    entry, whose context (that many tokens) the eager model prefilled into the pool first.
    Returns (input_ids, positions, make_backend): each backend works on its own copy of the
    pool, so two forwards read the same cached K/V."""
    generator = torch.Generator().manual_seed(sum(prompt_lens) + sum(decode_lens))
    vocab = model.config.vocab_size
    tables, next_block = [], 0
    for length in prompt_lens + decode_lens:
        count = -(-length // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    pool = PagedKVCache(
        model.config, next_block, BLOCK_SIZE, model.model.embed_tokens.weight.dtype, "cpu"
    )
    decode_tables = tables[len(prompt_lens) :]
    if decode_lens:  # the decodes' contexts, all but each one's last token
        contexts = [n - 1 for n in decode_lens]
        ids = torch.randint(0, vocab, (sum(contexts),), generator=generator)
        positions = torch.cat([torch.arange(n) for n in contexts])
        model(ids, positions, attention_over(pool, contexts, contexts, decode_tables))
    query_lens = prompt_lens + [1] * len(decode_lens)
    seq_lens = prompt_lens + decode_lens
    input_ids = torch.randint(0, vocab, (sum(query_lens),), generator=generator)
    positions = torch.cat([torch.arange(n - q, n) for q, n in zip(query_lens, seq_lens)])

    def make_backend():
        copy = PagedKVCache(
            model.config, next_block, BLOCK_SIZE, model.model.embed_tokens.weight.dtype, "cpu"
        )
        copy.layers = [layer.clone() for layer in pool.layers]
        return attention_over(copy, query_lens, seq_lens, tables)

    return input_ids, positions, make_backend


def runner(llm):
    return llm.llm_engine.executor.driver_worker.model_runner


def step_forward(llm):
    """What the engine's steps call: the model itself or the model compiled."""
    return runner(llm).forward


@pytest.fixture(scope="module")
def tiny_model(tiny_models):
    return tiny_models(ENGINE_TEST_FAMILY)[0]


@pytest.fixture(scope="module")
def compiled_tiny(tiny_model):
    return CompiledModel(tiny_model)


@pytest.fixture(scope="module")
def tiny_model_float64(tiny_model_dirs):
    """The reference both float32 forwards are measured against."""
    return load_model(tiny_model_dirs[ENGINE_TEST_FAMILY], torch.float64)


@pytest.mark.parametrize(
    "prompt_lens, decode_lens",
    [([], [9]), ([7], []), ([5, 12], [3, 17, 30]), ([1], [40])],
    ids=["one-decode", "one-prompt", "mixed", "one-token-prompt-and-decode"],
)
@torch.inference_mode()
def test_compiled_forward_is_as_accurate_as_eager(
    tiny_model, compiled_tiny, tiny_model_float64, prompt_lens, decode_lens
):
    """Against the same model in float64, the compiled float32 logits are no further off than
    the eager ones (fused loops round differently, not worse), for batches of one token
    (batch-1 decode, a graph of its own) and of many (the dynamic graph), prefills and
    decodes. Random tokens make the rounding of either large enough to compare."""

    def logits(model, forward):
        input_ids, positions, make_backend = mixed_batch(model, prompt_lens, decode_lens)
        return model.compute_logits(forward(input_ids, positions, make_backend())).double()

    reference = logits(tiny_model_float64, tiny_model_float64)
    eager_error = (logits(tiny_model, tiny_model) - reference).abs().max().item()
    compiled_error = (logits(tiny_model, compiled_tiny) - reference).abs().max().item()
    assert compiled_error <= 2 * eager_error + 1e-5, (compiled_error, eager_error)


@torch.inference_mode()
def test_two_models_of_one_shape_never_share_weights(tmp_path, embedded_dir, tiny_model):
    """Compiled code is reused across models of the same shapes (weights are its inputs), so
    a second model must give its own outputs, not the first one's."""
    other_weights = make_tiny_model(
        ENGINE_TEST_FAMILY, tmp_path, seed=1, tokenizer_dir=embedded_dir
    )
    first, second = tiny_model, load_model(other_weights)
    for model in (first, second):
        input_ids, positions, make_backend = mixed_batch(model, [6], [5])
        expected = model(input_ids, positions, make_backend())
        got = CompiledModel(model)(input_ids, positions, make_backend())
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_compiled_engine_equals_transformers(tiny_model_dirs, chat_prompts, tiny_greedy):
    """The engine compiled emits transformers' greedy tokens, batched, also while it verifies
    drafts (chapter 08: several rows per request in one step, which the dynamic graph serves).
    The drafts come from the model's first layer alone (layer_skip): the target accepts some
    and rejects others."""
    llm = LLM(
        model=str(tiny_model_dirs[ENGINE_TEST_FAMILY]),
        max_num_seqs=4,
        enforce_eager=False,
        speculative_config={
            "method": "layer_skip",
            "num_draft_layers": 1,
            "num_speculative_tokens": 3,
        },
    )
    assert isinstance(step_forward(llm), CompiledModel)
    prompts = chat_prompts
    max_tokens = [6, 20, 24, 20]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=[EOS_TOKEN_ID])
        for n in max_tokens
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for output, prompt, n in zip(outputs, prompts, max_tokens):
        assert list(output.outputs[0].token_ids) == tiny_greedy(prompt, n)
    metrics = {metric.name: metric.value for metric in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_draft_tokens"]
    assert 0 < metrics["vllm:spec_decode_num_accepted_tokens"] < drafts  # both kinds verified


def test_enforce_eager_runs_the_model_itself(embedded_dir):
    llm = LLM(model=str(embedded_dir), enforce_eager=True)
    assert step_forward(llm) is runner(llm).model


def test_compiling_is_the_default_unless_the_environment_says_eager():
    """vLLM's default (enforce_eager=False) unless MINIVLLM_ENFORCE_EAGER=1, which the test
    suite sets so that its engines start in a second; anything but a bool is refused."""
    environment = {k: v for k, v in os.environ.items() if k != "MINIVLLM_ENFORCE_EAGER"}
    defaults = []
    for value in (None, "1"):
        if value is not None:
            environment["MINIVLLM_ENFORCE_EAGER"] = value
        script = "from minivllm.config import EngineConfig; print(EngineConfig().enforce_eager)"
        result = subprocess.run(
            [sys.executable, "-c", script], env=environment, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        defaults.append(result.stdout.strip())
    assert defaults == ["False", "True"]
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="no")


def test_attention_outside_a_forward_context_is_an_error():
    q = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="forward_context"):
        OPAQUE_ATTENTION(0, q, q, q)


def test_a_compiled_int8_engine_compiles_nothing_at_its_first_prompt(
    tiny_model_dirs, chat_prompts, monkeypatch
):
    """Chapter 12's int8 layers choose their product by the number of rows (minivllm's inside
    one opaque operator; PyTorch's, where ours did not build, in the graph, which is then
    guarded on it): the engine's start traces a prompt-sized count too, and no request waits
    for a compile. The compiled engine's tokens are the eager one's (in float32, admitted here
    for PyTorch's kernels, which an engine refuses it for; bfloat16's roundings differ between
    compiled and eager code)."""
    from torch._dynamo.utils import counters

    from minivllm.config import KERNEL_ACTIVATION_DTYPES
    from minivllm.models.quantization import INT8_FUSED_MAX_ROWS

    monkeypatch.setitem(KERNEL_ACTIVATION_DTYPES["cpu"], "int8", (torch.float32,))
    model = str(tiny_model_dirs[ENGINE_TEST_FAMILY])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in chat_prompts[:2]]
    assert all(len(p["prompt_token_ids"]) > INT8_FUSED_MAX_ROWS for p in prompts)
    eager = LLM(model=model, dtype="float32", quantization="int8", enforce_eager=True)
    expected = [list(o.outputs[0].token_ids) for o in eager.generate(prompts, params)]
    compiled = LLM(model=model, dtype="float32", quantization="int8", enforce_eager=False)
    graphs_at_start = counters["stats"]["unique_graphs"]
    outputs = compiled.generate(prompts, params)
    assert counters["stats"]["unique_graphs"] == graphs_at_start
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
