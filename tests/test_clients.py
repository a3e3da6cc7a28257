"""Chapter 09: real clients against the server, used the way their users use them.

lm-eval scores a multiple-choice task by asking the completions endpoint for the log-probability
of each answer after the question (`echo` with `logprobs`, one token generated); a server that
drops `echo` still answers 200, and every score silently becomes 0. So the check is numeric: the
log-likelihood lm-eval reports for every (question, answer) pair equals transformers' sum of the
answer tokens' log-probabilities on the same weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import ENGINE_TEST_FAMILY

from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import BackgroundServer, ServerSettings

TASK_DIR = Path(__file__).parent / "data" / "lm_eval"
MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs[ENGINE_TEST_FAMILY]


def start_server(model_dir: Path, max_model_len: int) -> BackgroundServer:
    config = EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", max_model_len=max_model_len
    )
    return BackgroundServer(
        AsyncLLM.from_config(config), ServerSettings(served_model_name=MODEL_NAME)
    )


@pytest.fixture(scope="module")
def server(model_dir):
    server = start_server(model_dir, max_model_len=256)
    yield server
    server.stop()


@pytest.fixture
def fuzzed_server(model_dir):
    """A server of its own: its random draws (requests without a seed) start from the engine's
    seed, whatever ran before. A short context bounds the work of any request the fuzzer makes
    up: 128 completions of a chat request without max_tokens run to the context's end."""
    server = start_server(model_dir, max_model_len=64)
    yield server
    server.stop()


def task_dir_with_data(tmp_path: Path) -> Path:
    """The task's YAML with the absolute path of its data file (lm-eval reads it offline)."""
    yaml = (TASK_DIR / "mini_mc.yaml").read_text()
    (tmp_path / "mini_mc.yaml").write_text(
        yaml.replace("DATA_FILE", str(TASK_DIR / "capitals.jsonl"))
    )
    return tmp_path


@torch.inference_mode()
def transformers_loglikelihood(hf_model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context), split into tokens as lm-eval splits a pair: the context's
    trailing spaces go to the continuation, the continuation's ids are what the whole adds to
    the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    logprobs = hf_model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(len(context_ids), len(whole)))


@pytest.mark.slow
def test_lm_eval_loglikelihoods_equal_transformers(
    server, model_dir, tiny_models, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    results = simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={MODEL_NAME},base_url={server.base_url}/v1/completions,"
            f"tokenizer={model_dir},num_concurrent=1,max_retries=1,tokenized_requests=True"
        ),
        tasks=["mini_mc"],
        task_manager=TaskManager(include_path=str(task_dir_with_data(tmp_path))),
        log_samples=True,
    )
    hf_model = tiny_models(ENGINE_TEST_FAMILY)[1]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = results["samples"]["mini_mc"]
    assert len(samples) == 5
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            loglikelihood = float(response[0][0])
            expected = transformers_loglikelihood(hf_model, tokenizer, context, continuation)
            assert expected < 0
            assert math.isclose(loglikelihood, expected, rel_tol=1e-4, abs_tol=1e-3), (
                context,
                continuation,
            )


def served_gauges(base_url: str) -> dict[str, float]:
    """The engine gauges of /metrics that say whether anything is still held."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=10).text
    wanted = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in wanted
    }


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(fuzzed_server, tmp_path):
    """schemathesis reads the served /openapi.json as it is and sends what it documents, and
    what it does not (wrong types, out-of-range values, missing fields): no answer is a 5xx or
    undocumented, and afterwards nothing runs, waits or holds a KV block. Seeded and
    deterministic, bounded in examples only (about 200 cases): a time limit would make the cases
    sent depend on the machine's speed. The request timeout is far above the slowest case, so
    only a hang fails on it."""
    import subprocess
    import sys
    import time

    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run",
        fuzzed_server.base_url + "/openapi.json",
        "--checks",
        "not_a_server_error,status_code_conformance,content_type_conformance",
        "--phases",
        "examples,fuzzing",
        "--max-examples",
        "50",
        "--seed",
        "0",
        "--generation-deterministic",
        "--request-timeout",
        "120",
        "--workers",
        "1",
        "--no-color",
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    deadline = time.monotonic() + 30
    while (gauges := served_gauges(fuzzed_server.base_url)) and any(gauges.values()):
        assert time.monotonic() < deadline, gauges
        time.sleep(0.2)
    assert set(gauges) == {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    }
