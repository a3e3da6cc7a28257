"""Tiny random models of each supported family, for fast tests and exercises.

A two-layer model with a 64-wide hidden state runs a forward pass in milliseconds, yet it
exercises every code path of a real checkpoint: grouped-query attention, RoPE, tied or untied
heads, Qwen2's q/k/v bias, Qwen3's q/k norm. transformers builds and saves it from a config with
a fixed seed, so our model and the reference read exactly the same weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def tiny_hf_config(family: str, vocab_size: int, **overrides):
    """A transformers config of the family with small shapes (override any field)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    config_class = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
    }.get(family)
    if config_class is None:
        raise ValueError(f"family must be one of {TINY_FAMILIES}, got {family!r}")
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=family in ("llama", "qwen3"),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # Larger random weights than the default 0.02: with tiny weights a tied-embedding model
        # just repeats its last input token, and a test could not tell a broken cache from a
        # working one.
        initializer_range=0.2,
    )
    if family == "mistral":
        fields["sliding_window"] = None
    fields.update(overrides)
    return config_class(**fields)


def make_tiny_model(
    family: str,
    out_dir: str | Path,
    seed: int = 0,
    tokenizer_dir: str | Path | None = None,
    **overrides,
) -> Path:
    """Write a random model of `family` to `out_dir` as a Hugging Face directory.

    With `tokenizer_dir` (e.g. the embedded model's directory) its tokenizer is copied in and the
    vocabulary sized to match, so the tiny model can run end to end through `LLM`.
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = 512
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
        from transformers import AutoTokenizer

        vocab_size = len(AutoTokenizer.from_pretrained(out_dir))
    config = tiny_hf_config(family, vocab_size, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves norms at exactly 1 and biases at 0; perturb them so a bug that ignores
    # a norm weight or a bias cannot hide.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    model.save_pretrained(out_dir)
    return out_dir
