"""The benchmark harness's own arithmetic: the FLOP count behind the MFU column, token agreement
between methods, method specs with a dtype, and the CPU allocator setting every method runs with.

The FLOP count is checked against PyTorch's own counter (`FlopCounterMode`) running the model,
not against a second copy of the formula.
"""

from __future__ import annotations

import math
import shutil
import statistics
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from minivllm.bench.benchmark import (
    BenchmarkContext,
    engine_overrides,
    format_table,
    matching_token_share,
    model_flops,
    run_benchmark,
)
from minivllm.bench.workloads import Workload
from minivllm.worker.cpu_allocator import keep_freed_memory_in_process


def onednn_linear_flops(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of oneDNN's product (`minivllm.models.linear`), which PyTorch's counter does not
    know: 2 per multiply-add, as the counter counts `aten::mm`."""
    return 2 * math.prod(x_shape) * weight_shape[0]


COUNT_ONEDNN = {torch.ops.mkldnn._linear_pointwise: onednn_linear_flops}


class NoAttention:
    """A backend that returns the queries: no FLOPs, so the counter sees only linear layers."""

    def __call__(self, layer_index, q, k, v):
        return q


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("prompt_length,output_length", [(1, 1), (7, 3), (30, 12)])
def test_model_flops_equals_pytorchs_count_plus_attention_pairs(
    tiny_models, family, prompt_length, output_length
):
    """Linear layers and the LM head as PyTorch counts them while the model runs the tokens a
    request feeds through it, plus attention: position t meets t + 1 keys, 4 FLOPs per head
    dimension each (QK^T and PV), summed pair by pair."""
    model, _ = tiny_models(family)
    config = model.config
    fed = prompt_length + output_length - 1  # the last generated token is never fed back
    with (
        FlopCounterMode(display=False, custom_mapping=COUNT_ONEDNN) as counter,
        torch.inference_mode(),
    ):
        hidden = model(torch.zeros(fed, dtype=torch.long), torch.arange(fed), NoAttention())
        model.compute_logits(hidden[-output_length:])
    pairs = sum(t + 1 for t in range(fed))
    attention = 4 * config.num_heads * config.head_dim * config.num_layers * pairs

    expected = counter.get_total_flops() + attention
    assert model_flops(config, [prompt_length], [output_length]) == expected


@pytest.mark.parametrize("prompt_length,output_length,cached", [(8, 3, 4), (30, 12, 16), (5, 1, 0)])
def test_model_flops_leave_out_what_the_prefix_cache_served(
    tiny_models, prompt_length, output_length, cached
):
    """With `cached` prompt tokens served by the prefix cache, the count is what PyTorch counts
    while the model runs only the other tokens, plus attention for their queries alone (each
    still meets every earlier key, cached ones included)."""
    model, _ = tiny_models("llama")
    config = model.config
    tokens = prompt_length + output_length - 1
    fed = tokens - cached
    with (
        FlopCounterMode(display=False, custom_mapping=COUNT_ONEDNN) as counter,
        torch.inference_mode(),
    ):
        positions = torch.arange(cached, tokens)
        hidden = model(torch.zeros(fed, dtype=torch.long), positions, NoAttention())
        model.compute_logits(hidden[-output_length:])
    pairs = sum(t + 1 for t in range(cached, tokens))
    attention = 4 * config.num_heads * config.head_dim * config.num_layers * pairs

    expected = counter.get_total_flops() + attention
    assert model_flops(config, [prompt_length], [output_length], [cached]) == expected


def test_prefix_cached_runs_count_only_computed_flops(tiny_model_dirs):
    """On prompts that share a prefix (in two waves, so the second finds the first's blocks),
    the prefix-cached engine computes fewer FLOPs than the workload needs; its MFU counts only
    those, and its work delivered is the workload's, the same as without the cache."""
    ctx = BenchmarkContext.load(tiny_model_dirs["mistral"])
    shared = list(range(10, 42))
    prompts = [shared + [50 + i, 60 + i] for i in range(4)]
    workload = Workload(
        "shared", prompts, [3] * 4, "four requests, one 32-token prefix", num_waves=2
    )
    off, on = run_benchmark(ctx, workload, ["engine-no-prefix-cache", "engine"])
    assert off.model_flops == off.workload_flops == on.workload_flops
    assert on.prompt_tokens_computed < off.prompt_tokens_computed == workload.num_prompt_tokens
    assert on.model_flops < on.workload_flops
    assert 0.0 < on.mfu < 1.0


def test_repeated_rounds_each_start_cold_and_report_median_and_range(tiny_model_dirs):
    """Three timed rounds after one warm-up, the two engines interleaved: every round starts
    with an empty prefix cache (the last round computes every prompt token, as a single run
    does), seconds are the median of the rounds, and the table shows ranges."""
    ctx = BenchmarkContext.load(tiny_model_dirs["mistral"])
    workload = Workload("tiny", [[1, 2, 3, 4, 5], [6, 7, 8]], [3, 2], "two requests")
    off, on = run_benchmark(
        ctx, workload, ["engine-no-prefix-cache", "engine"], False, repeats=3, warmups=1
    )
    for result in (off, on):
        assert len(result.round_seconds) == 3
        assert result.seconds == statistics.median(result.round_seconds)
    assert on.prompt_tokens_computed == workload.num_prompt_tokens
    table = format_table([off, on])
    assert "3 rounds, methods interleaved" in table
    assert f"{min(on.round_seconds):.2f}-{max(on.round_seconds):.2f}" in table


def test_a_method_named_twice_is_refused_in_favour_of_repeats(tiny_model_dirs):
    ctx = BenchmarkContext.load(tiny_model_dirs["llama"])
    workload = Workload("tiny", [[1, 2, 3]], [2], "one request")
    with pytest.raises(ValueError, match="'?engine'? given more than once.*repeats"):
        run_benchmark(ctx, workload, ["engine", "static", "engine"], measure_peak=False)


def test_model_flops_adds_up_over_requests(tiny_models):
    config = tiny_models("llama")[0].config
    both = model_flops(config, [5, 9], [2, 4])
    assert both == model_flops(config, [5], [2]) + model_flops(config, [9], [4])


token_lists = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12), min_size=1, max_size=6)


@settings(max_examples=100, deadline=None)
@given(reference=token_lists, data=st.data())
def test_matching_token_share_counts_tokens_before_the_first_difference(reference, data):
    assert matching_token_share(reference, reference) == 1.0
    # Change one token in each request: what comes before it still counts, the rest does not.
    positions = [data.draw(st.integers(0, len(r) - 1)) for r in reference]
    changed = [r[:p] + [r[p] + 1] + r[p + 1 :] for r, p in zip(reference, positions)]
    total = sum(len(r) for r in reference)
    assert matching_token_share(changed, reference) == pytest.approx(sum(positions) / total)


def test_unknown_method_or_dtype_is_refused_by_name(tiny_model_dirs):
    ctx = BenchmarkContext.load(tiny_model_dirs["llama"])
    workload = Workload("tiny", [[1, 2, 3]], [2], "one request")
    with pytest.raises(ValueError, match="'warp-drive'"):
        run_benchmark(ctx, workload, ["engine", "warp-drive"])
    with pytest.raises(ValueError, match="float33"):
        run_benchmark(ctx, workload, ["engine@float33"])


def test_dtypes_run_side_by_side_in_one_benchmark(tiny_model_dirs):
    """The spec "engine@bfloat16" runs the engine with the model in bfloat16 next to float32;
    the float32 methods agree token for token, and every result says its dtype and its MFU."""
    ctx = BenchmarkContext.load(tiny_model_dirs["mistral"])
    workload = Workload("tiny", [[5, 6, 7, 8], [9] * 13, [3, 1]], [4, 6, 3], "three requests")
    results = run_benchmark(ctx, workload, ["engine", "static", "engine@bfloat16"])

    engine, static, engine_bf16 = results
    assert [r.dtype for r in results] == ["float32", "float32", "bfloat16"]
    assert static.same_tokens_as_first == static.matching_tokens == 1.0
    assert engine_bf16.label.endswith("bf16")
    assert 0.0 <= engine_bf16.matching_tokens <= 1.0
    assert engine.matmul_peak_flops != engine_bf16.matmul_peak_flops  # measured per dtype
    for r in results:
        assert r.output_tokens == sum(workload.output_lengths)
        assert 0.0 < r.mfu < 1.0


def test_engines_with_different_attention_backends_run_side_by_side(tiny_model_dirs):
    """ "engine:flex" builds its own engine on the flex backend next to the default one; both
    give the same greedy tokens."""
    ctx = BenchmarkContext.load(tiny_model_dirs["mistral"])
    # Few shapes to compile (decodes of 1 and 2 sequences, chunks of 16 tokens), and a small
    # pool (flex compiles for the pool size).
    ctx.engine_args = {
        "max_num_seqs": 2,
        "max_num_batched_tokens": 16,
        "kv_cache_memory_bytes": 2**20,
    }
    workload = Workload("tiny", [[5, 6, 7, 8], [9] * 13], [4, 6], "two requests")
    default, flex = run_benchmark(
        ctx, workload, ["engine-no-prefix-cache", "engine-no-prefix-cache:flex"], False
    )
    assert flex.same_tokens_as_first == 1.0 and flex.label == default.label + " [flex]"
    backends = {key: llm.llm_engine.executor.driver_worker.attention_backend.name
                for key, llm in ctx.engines.items()}  # fmt: skip
    assert backends == {"engine-no-prefix-cache": "cpu", "engine-no-prefix-cache:flex": "flex"}


def test_transformers_generate_batch_gives_the_tokens_of_generate(tiny_model_dirs):
    """The "hf-cb" method, transformers' continuous batching with a KV cache sized for the workload,
    produces the greedy tokens of transformers' `generate` run one request at a time."""
    ctx = BenchmarkContext.load(tiny_model_dirs["llama"])
    workload = Workload("tiny", [[5, 6, 7, 8], [9] * 13, [3, 1]], [6, 6, 6], "three requests")
    one_at_a_time, batched = run_benchmark(ctx, workload, ["hf", "hf-cb:64"], measure_peak=False)
    assert batched.output_tokens == sum(workload.output_lengths)
    assert batched.same_tokens_as_first == 1.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_allocator_setting_is_accepted_by_glibc():
    """mallopt returns 1 for each setting it accepts, 0 for one it refuses (a threshold over
    glibc's maximum, say)."""
    assert keep_freed_memory_in_process() is True


def test_workload_kv_cache_budget_holds_every_request_at_once(tiny_model_dirs):
    """The KV budget the benchmark gives engines on CUDA: each request's prompt + output in whole
    blocks, plus an eighth (at least a block). An engine given it runs the whole workload at
    once without a preemption (checked here on the CPU, where the sizing is the same)."""
    from minivllm.bench.benchmark import workload_kv_cache_bytes
    from minivllm.entrypoints.llm import LLM
    from minivllm.models.loader import load_model_config
    from minivllm.sample.sampling_params import SamplingParams

    model_dir = tiny_model_dirs["mistral"]
    config = load_model_config(model_dir)
    workload = Workload("tiny", [[5] * 5, [6] * 8, [7]], [3, 1, 2], "three requests")
    block_bytes = 4 * config.kv_bytes_per_token(torch.float32)
    # Blocks of 4 tokens: 8 tokens -> 2 blocks, 9 -> 3, 3 -> 1; 6 blocks + 1 of margin.
    assert workload_kv_cache_bytes(workload, config, torch.float32, 4) == 7 * block_bytes
    assert workload_kv_cache_bytes(workload, config, torch.bfloat16, 4) == 7 * block_bytes // 2

    budget = workload_kv_cache_bytes(workload, config, torch.float32, 4)
    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=4, kv_cache_memory_bytes=budget)
    assert llm.llm_engine.kv_cache_manager.num_blocks == 7
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in [3, 1, 2]]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == workload.output_lengths
    metrics = {m.name: m.value for m in llm.get_metrics()}
    assert metrics["vllm:num_preemptions"] == 0


def test_engine_settings_name_a_backend_and_the_parallel_sizes(tiny_model_dirs):
    assert engine_overrides("") == {}
    assert engine_overrides("flex") == {"attention_backend": "flex"}
    assert engine_overrides("tp=3") == {"tensor_parallel_size": 3}
    assert engine_overrides("dp=2,torch") == {"data_parallel_size": 2, "attention_backend": "torch"}
    assert engine_overrides("eager") == {"enforce_eager": True}
    assert engine_overrides("compiled,flex") == {
        "enforce_eager": False,
        "attention_backend": "flex",
    }
    assert engine_overrides("int4,eager") == {"quantization": "int4", "enforce_eager": True}
    with pytest.raises(ValueError, match="unknown engine setting 'pp=2'"):
        run_benchmark(BenchmarkContext.load(tiny_model_dirs["llama"]), None, ["engine:pp=2"])


def test_code_version_names_the_last_commit_of_the_code(tmp_path):
    """Notebooks print it beside their numbers: the last commit that changed the package (or its
    scripts), "+changes" when the code differs from it; prose and notebook outputs are not code."""
    import subprocess

    from minivllm.bench.benchmark import code_version

    def git(*args: str) -> str:
        command = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()

    def commit(path: str, text: str) -> str:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        git("add", path)
        git("commit", "-q", "-m", f"change {path}")
        return git("rev-parse", "--short", "HEAD")

    git("init", "-q")
    code = commit("minivllm/engine.py", "x = 1\n")
    assert code_version(tmp_path) == f"commit {code}"
    commit("chapters/01.md", "# prose\n")
    commit("notebooks/01.ipynb", "{}\n")
    assert code_version(tmp_path) == f"commit {code}"  # a later commit of prose is not code
    (tmp_path / "notebooks/01.ipynb").write_text("{ }\n")
    assert code_version(tmp_path) == f"commit {code}"
    (tmp_path / "minivllm/engine.py").write_text("x = 2\n")
    assert code_version(tmp_path) == f"commit {code}+changes"
    commit("scripts/mutate.py", "print()\n")  # a tool that makes no notebook number
    commit("minivllm/bench/gpu/ch01.py", "y = 1\n")  # its records are the notebooks' data
    assert code_version(tmp_path) == f"commit {code}+changes"
    script = commit("scripts/serve_vs_vllm.py", "print()\n")  # notebook 09 runs it
    assert code_version(tmp_path) == f"commit {script}+changes"


# vLLM's offline API is ours (LLM, SamplingParams, generate, reset_prefix_cache), so an
# interpreter that imports minivllm under the name "vllm" stands in for vLLM's venv.
VLLM_STAND_IN = "from minivllm import LLM, SamplingParams  # noqa: F401\n"


def test_vllm_runs_in_its_own_process_as_a_method(tiny_model_dirs, tmp_path, monkeypatch):
    """The "vllm" method sends each wave of the workload to a peer process and reads back its
    tokens; with our engine standing in for vLLM they equal the engine's, token for token."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(VLLM_STAND_IN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("MINIVLLM_VLLM_PYTHON", sys.executable)
    ctx = BenchmarkContext.load(tiny_model_dirs["mistral"])
    workload = Workload("tiny", [[5, 6, 7, 8], [9] * 13, [3, 1]], [4, 6, 3], "three requests")
    engine, peer = run_benchmark(ctx, workload, ["engine", "vllm"], measure_peak=False)
    assert peer.same_tokens_as_first == peer.matching_tokens == 1.0
    assert peer.output_tokens == engine.output_tokens and peer.chapter == 11
    peer_process = ctx.engines["vllm"].process
    ctx.close_engines()  # the peer's process stopped, every engine let go
    assert peer_process.returncode == 0 and not ctx.engines


def test_vllm_methods_without_vllm_say_how_to_install_it(tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_VLLM_PYTHON", str(tmp_path / "missing" / "python"))
    ctx = BenchmarkContext.load(tiny_model_dirs["mistral"])
    workload = Workload("tiny", [[5, 6, 7]], [2], "one request")
    with pytest.raises(ValueError, match="make peers"):
        run_benchmark(ctx, workload, ["vllm-tuned"], measure_peak=False)


def test_long_context_workload_fills_2k_to_8k_tokens_per_request(tokenizer):
    """Prompt and answer together span the range from 2,048 to 8,192 tokens (the embedded
    model's context), evenly, so that attention over long contexts is most of the work."""
    from minivllm.bench.workloads import make_workload

    workload = make_workload("long-context", tokenizer)
    assert workload.num_requests == 8 and set(workload.output_lengths) == {64}
    contexts = sorted(len(p) + n for p, n in zip(workload.prompts, workload.output_lengths))
    assert contexts[0] == 2048 and contexts[-1] == 8192
    gaps = [b - a for a, b in zip(contexts, contexts[1:])]
    assert max(gaps) - min(gaps) <= 1


def test_the_bench_command_runs_its_methods_in_rounds(tiny_model_dirs, capsys):
    """`minivllm bench --repeats 2 --warmups 1`: the table gives each method's median and range
    over two rounds and says the methods were interleaved."""
    from minivllm.entrypoints.cli import main

    main(
        ["bench", "--model", str(tiny_model_dirs["llama"]), "--methods", "engine,static",
         "--num-requests", "2", "--output-len", "2", "--repeats", "2", "--warmups", "1",
         "--enforce-eager"]
    )  # fmt: skip
    table = capsys.readouterr().out
    assert "2 rounds, methods interleaved: median (range)" in table
    assert all(label in table for label in ("paged continuous batching", "static"))


# A stand-in for llama-cpp-python's `Llama`: greedy over made-up scores in which the
# end-of-sequence token (2) always wins unless banned, and otherwise the next token is the
# previous one plus one.
LLAMA_CPP_STAND_IN = """
import numpy as np


class Llama:
    def __init__(self, model_path, n_ctx, n_threads, verbose):
        open(model_path).close()

    def token_eos(self):
        return 2

    def reset(self):
        pass

    def generate(self, tokens, logits_processor, **sampling):
        assert sampling["top_k"] == 1 and sampling["temp"] == 0.0
        tokens = list(tokens)
        while True:
            scores = np.zeros(100, dtype=np.float32)
            scores[2], scores[(tokens[-1] + 1) % 100] = 2.0, 1.0
            for processor in logits_processor:
                scores = processor(np.array(tokens), scores)
            tokens.append(int(scores.argmax()))
            yield tokens[-1]
"""


def test_llamacpp_runs_in_its_own_process_as_a_method(tiny_model_dirs, tmp_path, monkeypatch):
    """The "llamacpp" method sends the workload's prompts to a peer process running
    llama-cpp-python on the model's GGUF file, and reads back exactly each request's length of
    greedy tokens, the end of sequence banned (with a stand-in for llama-cpp-python)."""
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(LLAMA_CPP_STAND_IN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))  # for llamacpp_available() in this process
    model_dir = shutil.copytree(tiny_model_dirs["llama"], tmp_path / "model")
    (model_dir / "model.Q4_1.gguf").write_bytes(b"")  # the stand-in only opens it
    ctx = BenchmarkContext.load(model_dir)
    workload = Workload("tiny", [[5, 6, 7, 8], [1], [97]], [4, 6, 3], "three requests")
    (peer,) = run_benchmark(ctx, workload, ["llamacpp"], measure_peak=False)
    assert peer.output_tokens == 13 and peer.chapter == 12
    assert ctx.engines["llamacpp"].generate(workload.prompts, workload.output_lengths) == [
        [9, 10, 11, 12],
        [0, 1, 0, 1, 0, 1],  # 2 (the end of sequence) would follow 1: banned, 0 is next best
        [98, 99, 0],
    ]
    peer_process = ctx.engines["llamacpp"].process
    ctx.close_engines()
    assert peer_process.returncode == 0 and not ctx.engines


def test_llamacpp_method_without_llama_cpp_says_how_to_install_it(
    tiny_model_dirs, tmp_path, monkeypatch
):
    from minivllm.bench import llamacpp_peer

    monkeypatch.setattr(llamacpp_peer, "llamacpp_available", lambda: False)
    model_dir = shutil.copytree(tiny_model_dirs["llama"], tmp_path / "model")
    (model_dir / "model.Q4_1.gguf").write_bytes(b"")
    ctx = BenchmarkContext.load(model_dir)
    with pytest.raises(ValueError, match="pip install llama-cpp-python"):
        run_benchmark(ctx, Workload("tiny", [[5, 6]], [2], "one"), ["llamacpp"], measure_peak=False)
