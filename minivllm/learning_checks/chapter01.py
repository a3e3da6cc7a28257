"""Chapter 01's learning check: greedy generation without a cache, against transformers."""

from __future__ import annotations

import functools
import tempfile

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check


@functools.cache
def tiny_model_pair():
    """A tiny random Llama as our model and as transformers' (same weights), made once."""
    from transformers import AutoModelForCausalLM

    from minivllm.models.loader import load_model
    from minivllm.models.tiny import make_tiny_model

    directory = make_tiny_model("llama", tempfile.mkdtemp(prefix="minivllm-tiny-"), seed=0)
    ours = load_model(directory)
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return ours, theirs


def _our_generate():
    from minivllm.baselines.naive import generate_without_cache

    return generate_without_cache


@learning_check(
    "ch01.generate_without_cache",
    signature="generate_without_cache(model: LlamaForCausalLM, prompt_token_ids: list[int], "
    "max_new_tokens: int, eos_token_id: int | None) -> list[int]  (greedy)",
    reference=_our_generate,
)
def check_generate_without_cache(generate_without_cache) -> None:
    """Greedy tokens equal transformers' `generate`, including stopping at EOS."""
    from minivllm.baselines.naive import generate_with_transformers

    model, hf_model = tiny_model_pair()
    vocab_size = model.config.vocab_size

    @check_settings(max_examples=15)
    # Always tried first: EOS is the first greedy token, so a loop must stop after one token
    # of eight (random cases reach such an early EOS only some of the time).
    @example(prompt=[1, 2, 3], max_new_tokens=8, stop_at_eos=True, eos_step=0)
    @given(
        prompt=st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=12),
        max_new_tokens=st.integers(1, 8),
        stop_at_eos=st.booleans(),
        eos_step=st.integers(0, 7),
    )
    def property_(prompt, max_new_tokens, stop_at_eos, eos_step):
        # An EOS the model produces: its greedy token at step eos_step (often after a few
        # tokens, so the loop must stop mid-answer, not only before it starts).
        eos = None
        if stop_at_eos:
            eos = generate_with_transformers(hf_model, prompt, eos_step + 1)[eos_step]
        expected = generate_with_transformers(hf_model, prompt, max_new_tokens, eos)
        got = generate_without_cache(model, prompt, max_new_tokens, eos)
        assert list(got) == expected, (
            f"got {list(got)}, transformers generated {expected} (prompt_token_ids={prompt}, "
            f"max_new_tokens={max_new_tokens}, eos_token_id={eos}: the tokens up to and "
            "including the first EOS, at most max_new_tokens of them)"
        )

    property_()
