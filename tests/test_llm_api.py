"""The offline API (`LLM`, `SamplingParams`, outputs) behaves like vLLM's, and bad input gets a
clear error that leaves the `LLM` usable."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CHAT_MESSAGES, EOS_TOKEN_ID

from minivllm import LLM, CompletionOutput, RequestOutput, SamplingParams
from minivllm.baselines.naive import generate_with_transformers
from minivllm.config import resolve_device

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def llm(embedded_dir):
    """The embedded model behind the offline API, with a small context so length errors are cheap."""
    return LLM(max_model_len=512)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dirs):
    return LLM(model=str(tiny_model_dirs["llama"]), max_num_seqs=3)


def test_greedy_chat_equals_transformers(llm, hf_embedded_model, chat_prompts):
    """LLM.generate's greedy tokens equal transformers' generate for chat prompts in one call."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outputs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params, use_tqdm=False)
    for prompt, output in zip(chat_prompts, outputs):
        expected = generate_with_transformers(hf_embedded_model, prompt, 24, EOS_TOKEN_ID)
        assert output.outputs[0].token_ids == expected


def test_chat_answers_with_text(llm):
    """A chat turn returns text, finished at EOS or by length, with vLLM's output types."""
    output = llm.chat([{"role": "user", "content": CHAT_MESSAGES[1]}], GREEDY, use_tqdm=False)[0]
    assert isinstance(output, RequestOutput) and isinstance(output.outputs[0], CompletionOutput)
    assert output.finished and output.outputs[0].finish_reason in ("stop", "length")
    assert "Paris" in output.outputs[0].text


def test_outputs_come_back_in_input_order(tiny_llm):
    """Results follow the order of the prompts, whatever batch each ran in."""
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (7, 1, 30, 4, 12)]
    together = tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, together):
        alone = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert output.prompt_token_ids == prompt["prompt_token_ids"]
        assert output.outputs[0].token_ids == alone.outputs[0].token_ids


def test_prompt_forms_and_per_prompt_params(tiny_llm):
    """Strings, {'prompt'} and {'prompt_token_ids'} are accepted; one SamplingParams per prompt."""
    ids = tiny_llm.get_tokenizer().encode("Hello there")
    outputs = tiny_llm.generate(
        ["Hello there", {"prompt": "Hello there"}, {"prompt_token_ids": ids}],
        [SamplingParams(temperature=0.0, max_tokens=n) for n in (1, 2, 3)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3]
    assert outputs[0].prompt == "Hello there" and outputs[0].prompt_token_ids == ids
    assert outputs[1].outputs[0].token_ids == outputs[2].outputs[0].token_ids[:2]


def test_n_completions_and_seeds(tiny_llm):
    """n=3 gives three completions; a seeded request is reproducible in any batch."""
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    alone = tiny_llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1
    crowd = tiny_llm.generate(
        ["Other prompt", "Once upon a time", "Third"],
        [SamplingParams(temperature=1.0, max_tokens=8), params, SamplingParams(temperature=0.5)],
        use_tqdm=False,
    )[1]
    assert [c.token_ids for c in crowd.outputs] == [c.token_ids for c in alone.outputs]


def test_stop_conditions(llm, tokenizer):
    """max_tokens ends with "length"; a stop string is cut from the text; a stop token id ends
    with that token as stop_reason; ignore_eos runs to max_tokens."""
    prompt = [{"role": "user", "content": CHAT_MESSAGES[1]}]
    by_length = llm.chat(prompt, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert by_length.outputs[0].finish_reason == "length"
    assert len(by_length.outputs[0].token_ids) == 3

    full = llm.chat(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    assert full.text.startswith("The capital of France is")
    cut = llm.chat(prompt, SamplingParams(temperature=0.0, stop=[" of"]), use_tqdm=False)[0]
    assert cut.outputs[0].text == "The capital"
    assert (cut.outputs[0].finish_reason, cut.outputs[0].stop_reason) == ("stop", " of")

    stop_id = full.token_ids[2]
    by_id = llm.chat(
        prompt, SamplingParams(temperature=0.0, stop_token_ids=[stop_id]), use_tqdm=False
    )
    assert by_id[0].outputs[0].token_ids == full.token_ids[:3]
    assert by_id[0].outputs[0].stop_reason == stop_id

    eos_ignored = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    long = llm.chat(prompt, eos_ignored, use_tqdm=False)[0].outputs[0]
    assert len(long.token_ids) == 20 and long.finish_reason == "length"


def test_min_tokens_delays_eos(llm):
    """With min_tokens, EOS cannot end the answer early."""
    prompt = [{"role": "user", "content": CHAT_MESSAGES[1]}]
    plain = llm.chat(prompt, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    assert plain.outputs[0].token_ids[-1] == EOS_TOKEN_ID
    at_least = len(plain.outputs[0].token_ids) + 5
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=at_least)
    longer = llm.chat(prompt, params, use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= at_least


def test_logprobs(llm):
    """logprobs=k gives, per token, the k best candidates plus the sampled one, and the
    cumulative logprob is the sum of the sampled tokens' logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    completion = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert len(completion.logprobs) == 5
    total = 0.0
    for token_id, candidates in zip(completion.token_ids, completion.logprobs):
        assert token_id in candidates and candidates[token_id].rank == 1  # greedy picks rank 1
        assert 3 <= len(candidates) <= 4
        total += candidates[token_id].logprob
    assert completion.cumulative_logprob == pytest.approx(total)


# --- bad input: a clear error naming what was wrong, and the LLM still works afterwards ---

BAD_PROMPTS = [
    ("", ValueError, "empty"),
    ({"prompt_token_ids": []}, ValueError, "empty"),
    ({"prompt_token_ids": [1, 10**9]}, ValueError, "vocabulary"),
    ({"prompt_token_ids": [1, -3]}, ValueError, "vocabulary"),
    ({"prompt_token_ids": "1 2 3"}, TypeError, "list of ints"),
    ({"prompt_token_ids": [1.5]}, TypeError, "list of ints"),
    (42, TypeError, "prompt"),
    ({"text": "hi"}, TypeError, "prompt"),
    ({"prompt_token_ids": [5] * 600}, ValueError, "context"),
]


@pytest.mark.parametrize("prompt, error, words", BAD_PROMPTS)
def test_bad_prompt_raises_and_llm_stays_usable(llm, prompt, error, words):
    """Each malformed prompt raises a clear error, and the next call works."""
    with pytest.raises(error, match=words):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.generate(["Hi"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_bad_prompt_in_a_list_runs_nothing(llm):
    """One bad prompt among good ones fails the whole call before anything runs."""
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["Hello", ""], GREEDY, use_tqdm=False)


def test_max_tokens_that_cannot_fit(llm):
    """A max_tokens beyond what the context leaves is refused, naming the limit."""
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["Hello"], SamplingParams(max_tokens=1000), use_tqdm=False)


def test_wrong_sampling_params_argument(llm):
    """sampling_params of the wrong type or count are refused."""
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate(["Hi"], {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate(["Hi", "there"], [GREEDY] * 3, use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 1}, "max_model_len"),
    ],
)
def test_bad_engine_arguments(embedded_dir, kwargs, words):
    """Invalid LLM arguments raise ValueError naming the argument."""
    with pytest.raises(ValueError, match=words):
        LLM(**kwargs)


def test_unknown_model_path_and_architecture(tmp_path, tiny_model_dirs):
    """A missing model directory and an unsupported architecture say what to do."""
    with pytest.raises(ValueError, match="not a local directory"):
        LLM(model=str(tmp_path / "nowhere"))
    config = json.loads((tiny_model_dirs["llama"] / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(
        (tiny_model_dirs["llama"] / "model.safetensors").read_bytes()
    )
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(model=str(tmp_path))


def test_cli_generate(capsys, tiny_model_dirs):
    """`minivllm generate` prints a completion; a bad flag value prints an error, exit code 2."""
    from minivllm.entrypoints.cli import main

    main(["generate", "Hello", "--model", str(tiny_model_dirs["llama"]), "--max-tokens", "4"])
    assert capsys.readouterr().out.strip()
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "Hello", "--model", str(tiny_model_dirs["llama"]), "--temperature", "-1"])
    assert exit_info.value.code == 2
    assert "temperature" in capsys.readouterr().err


def test_tour_runs_every_chapter_and_they_agree(capsys, tiny_model_dirs):
    """`minivllm tour` end to end on a tiny model: the question and an answer are printed, then
    one row per chapter's method, all with transformers' tokens (the first method)."""
    from minivllm.bench.tour import TOUR_METHODS, TOUR_QUESTION, run_tour

    results = run_tour(quick=True, model=tiny_model_dirs["mistral"])
    printed = capsys.readouterr().out
    assert f"Q: {TOUR_QUESTION}" in printed and "\nA: " in printed
    assert [r.method for r in results] == TOUR_METHODS
    for result in results:
        assert result.label in printed
        assert result.same_tokens_as_first == 1.0
        assert result.output_tokens == 4 * 16


def test_a_cuda_device_resolves_to_an_indexed_one(monkeypatch):
    """`device="cuda"` (and "auto" on a GPU machine) names the current CUDA device by its index:
    the worker binds its process with `torch.cuda.set_device`, which refuses an unindexed
    device. An explicit index is kept; the CPU stays the CPU."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("auto") == torch.device("cuda", 3)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("gpu")
