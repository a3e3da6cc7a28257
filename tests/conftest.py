"""Shared fixtures for the chapter checks: the embedded model (ours and transformers'), its
tokenizer, tiny random models of every family, and chat prompts of very different lengths.

Everything expensive is loaded once per test session. The reference for every numeric check is
transformers (the oracle): the same checkpoint loaded with `AutoModelForCausalLM`, in float32.
"""

from __future__ import annotations

import os

# Tests never touch the network: the embedded model is converted from a locally installed
# package and tiny models are written to temporary directories.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Engines run eagerly unless a test asks for the compiled model (chapter 11's tests do):
# compiling costs each new process ten seconds or more, in every test server and notebook.
os.environ.setdefault("MINIVLLM_ENFORCE_EAGER", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# On every machine, every hypothesis test draws the same examples on every run (derandomize),
# so a red `make test` means a real failure that the next run reproduces, never an unlucky
# draw; print_blob prints, with a failure, the line that replays it (@reproduce_failure).
# `make explore` (MINIVLLM_HYPOTHESIS=explore) draws new random examples, and keeps the ones
# that failed in hypothesis' example database to try first next time: looking for new
# failures is a choice, not a lottery in everyone's test run. The profile is loaded before any
# test module is imported, so every settings(...) made there starts from it.
settings.register_profile("deterministic", derandomize=True, print_blob=True, database=None)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("MINIVLLM_HYPOTHESIS", "deterministic"))

# Without a GPU, chapter 06's Triton kernels run in Triton's interpreter. Triton reads the
# setting when a kernel is defined, so it is made before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minivllm.models.loader import embedded_model_dir, load_model, load_tokenizer  # noqa: E402
from minivllm.models.tiny import TINY_FAMILIES, make_tiny_model  # noqa: E402

# <|im_end|> of SmolLM2-Instruct, and of the tiny models, which share its tokenizer.
EOS_TOKEN_ID = 2

# User messages of very different lengths. The last two are long but ask for a short answer,
# so a greedy reply ends at EOS after a few tokens while the short ones run to their limit.
CHAT_MESSAGES = (
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Here is a paragraph about the planets. Mercury is the smallest planet and the closest to "
    "the Sun. Venus is the hottest, because its thick atmosphere traps heat. Earth is the only "
    "planet known to host life. Mars is red because of the iron oxide on its surface, and it has "
    "the tallest volcano in the solar system. Jupiter is the largest planet, a gas giant with a "
    "storm bigger than Earth. Which planet is the largest? Answer with one word.",
)


def chat_prompt_ids(tokenizer, message: str) -> list[int]:
    """Token ids of `message` as a user turn of the chat template, ready for the reply."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True
    )
    # transformers 5 returns a BatchEncoding; older versions a plain list of ids.
    if not isinstance(encoded, list):
        encoded = encoded["input_ids"]
    return list(encoded)


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded SmolLM2-135M-Instruct as a Hugging Face directory (converted once, cached)."""
    return embedded_model_dir()


@pytest.fixture(scope="session")
def embedded_model(embedded_dir):
    """Our model, float32 on the CPU."""
    return load_model(embedded_dir)


@pytest.fixture(scope="session")
def hf_embedded_model(embedded_dir):
    """transformers' model of the same checkpoint, float32: the oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(embedded_dir):
    return load_tokenizer(embedded_dir)


@pytest.fixture(scope="session")
def chat_prompts(tokenizer) -> list[list[int]]:
    """Chat prompts as token ids, from a few dozen tokens to over a hundred."""
    return [chat_prompt_ids(tokenizer, message) for message in CHAT_MESSAGES]


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, embedded_dir) -> dict:
    """family -> directory of a random two-layer model of that family (embedded tokenizer)."""
    return {
        family: make_tiny_model(
            family, tmp_path_factory.mktemp(family), seed=0, tokenizer_dir=embedded_dir
        )
        for family in TINY_FAMILIES
    }


@pytest.fixture(scope="session")
def tiny_models(tiny_model_dirs):
    """family -> (our model, transformers' model), loaded on first use and kept."""
    from transformers import AutoModelForCausalLM

    loaded: dict = {}

    def get(family: str):
        if family not in loaded:
            path = tiny_model_dirs[family]
            hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            loaded[family] = (load_model(path), hf_model)
        return loaded[family]

    return get


@pytest.fixture(scope="session")
def transformers_greedy(hf_embedded_model):
    """Greedy tokens of `model.generate` on the embedded model, one prompt alone (memoized:
    several chapters compare against the same runs)."""
    results: dict = {}

    def run(prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = EOS_TOKEN_ID):
        key = (tuple(prompt_ids), max_new_tokens, eos_token_id)
        if key not in results:
            results[key] = hf_generate(hf_embedded_model, prompt_ids, max_new_tokens, eos_token_id)
        return list(results[key])

    return run


@torch.inference_mode()
def hf_generate(hf_model, prompt_ids, max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """transformers' greedy `generate` for one prompt; the new tokens (EOS included if reached)."""
    input_ids = torch.tensor([prompt_ids])
    output = hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=EOS_TOKEN_ID,
    )
    return output[0, len(prompt_ids) :].tolist()


# The tiny family the engine tests compare against: its greedy tokens depend on the whole
# context, so a wrong KV cache shows up as different tokens.
ENGINE_TEST_FAMILY = "mistral"


@pytest.fixture(scope="session")
def tiny_greedy(tiny_models):
    """transformers' greedy tokens on a tiny model, one prompt alone (memoized)."""
    results: dict = {}

    def run(prompt_ids, max_new_tokens: int, family: str = ENGINE_TEST_FAMILY) -> list[int]:
        key = (family, tuple(prompt_ids), max_new_tokens)
        if key not in results:
            hf_model = tiny_models(family)[1]
            results[key] = hf_generate(hf_model, list(prompt_ids), max_new_tokens, EOS_TOKEN_ID)
        return list(results[key])

    return run


def assert_pool_is_empty(engine) -> None:
    """Nothing left running or waiting, no block table, every block free (blocks that keep a
    cached prefix count as free: nobody holds them)."""
    manager = engine.kv_cache_manager
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert manager.block_tables == {}
    assert manager.prefix_cache is None or manager.prefix_cache.request_hashes == {}
    assert manager.num_free_blocks == manager.num_blocks
    assert all(count == 0 for count in manager.pool.ref_counts)
    manager.check_integrity()


@pytest.fixture(autouse=True, scope="module")
def release_memory_after_each_module():
    """Engines hold hundreds of megabytes to gigabytes (weights, KV pool). The CPU allocator
    setting of appendix A keeps freed memory in the process, per thread (servers step their
    engine on a thread of its own), so a long test session would grow until the machine runs
    out. After each module: collect what is unreachable, then hand the freed memory back."""
    yield
    import gc

    from minivllm.worker.cpu_allocator import release_freed_memory

    gc.collect()
    release_freed_memory()
