"""Chapter 00 checks: the model, written out in plain PyTorch, computes what transformers computes.

The oracle is transformers' own implementation of each family loaded from the same directory.
The smaller pieces (RoPE, RMSNorm) are checked against their mathematical definitions, and the
loader against the errors a learner will actually hit.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import chat_prompt_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.baselines.naive import CausalAttention
from minivllm.config import ModelConfig
from minivllm.models.llama import RMSNorm, RotaryEmbedding, apply_rope
from minivllm.models.loader import load_model, resolve_model_path
from minivllm.models.tiny import TINY_FAMILIES, make_tiny_model


@torch.inference_mode()
def our_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, through our flat-batch forward."""
    n = len(token_ids)
    hidden = model(torch.tensor(token_ids), torch.arange(n), CausalAttention([0, n]))
    return model.compute_logits(hidden)


@torch.inference_mode()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_logits_close(
    ours: torch.Tensor, reference: torch.Tensor, atol: float, rtol: float = 1e-5
):
    """|ours - reference| <= atol + rtol * |reference| everywhere, and the same argmax."""
    assert ours.shape == reference.shape
    excess = (ours - reference).abs() - (atol + rtol * reference.abs())
    worst = (ours - reference).abs().max().item()
    assert excess.max().item() <= 0, f"logits differ by up to {worst:.2e} (atol {atol:.0e})"
    # Same argmax everywhere: the property greedy decoding relies on.
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


# --- the model against transformers ---------------------------------------------------------


def test_embedded_model_logits_match_transformers(embedded_model, hf_embedded_model, chat_prompts):
    """Our SmolLM2 gives transformers' logits at every position (float32): the model is right.

    On CPU our products run on oneDNN and transformers' on the BLAS library (models/linear.py):
    both exact float32, summed in different orders, which after 30 layers moves logits of size
    ~30 by up to ~2e-4. The bugs this test is for (a wrong rotary pairing, a missing norm weight)
    move them by whole units.
    """
    prompt = chat_prompts[1]
    assert_logits_close(
        our_logits(embedded_model, prompt), hf_logits(hf_embedded_model, prompt), atol=3e-4
    )


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_logits_match_transformers(family, tiny_models, chat_prompts):
    """Every supported family (GQA, tied/untied head, Qwen2 bias, Qwen3 q/k norm) matches transformers."""
    ours, hf_model = tiny_models(family)
    prompt = chat_prompts[-1]
    assert_logits_close(our_logits(ours, prompt), hf_logits(hf_model, prompt), atol=5e-5)


@torch.inference_mode()
def test_flat_batch_equals_each_sequence_alone(embedded_model, chat_prompts):
    """Two sequences side by side in one flat batch get the logits each gets alone: no padding,
    and no attention across sequences."""
    first, second = chat_prompts[0], chat_prompts[2]
    n1, n2 = len(first), len(second)
    input_ids = torch.tensor(first + second)
    positions = torch.cat([torch.arange(n1), torch.arange(n2)])  # each restarts at 0
    hidden = embedded_model(input_ids, positions, CausalAttention([0, n1, n1 + n2]))
    together = embedded_model.compute_logits(hidden)
    assert_logits_close(together[:n1], our_logits(embedded_model, first), atol=1e-5)
    assert_logits_close(together[n1:], our_logits(embedded_model, second), atol=1e-5)


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_SCALINGS))
def test_rope_scaling_variant_matches_transformers(rope_type, tmp_path, embedded_dir, tokenizer):
    """A context-extended model (linear, llama3, yarn RoPE scaling) still matches transformers."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(
        "llama",
        tmp_path,
        seed=1,
        tokenizer_dir=embedded_dir,
        rope_parameters=ROPE_SCALINGS[rope_type],
    )
    assert (
        json.loads((path / "config.json").read_text())["rope_parameters"]["rope_type"] == rope_type
    )
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = chat_prompt_ids(tokenizer, "Scaled rotary embeddings stretch the context window.")
    assert_logits_close(
        our_logits(load_model(path), prompt), hf_logits(hf_model, prompt), atol=5e-5
    )


# --- RoPE and RMSNorm against their definitions ---------------------------------------------


def rope_config(head_dim: int, theta: float) -> ModelConfig:
    """The fields RoPE reads, for a plain (unscaled) rotary embedding."""
    return ModelConfig(
        model_type="llama",
        vocab_size=16,
        hidden_size=head_dim,
        intermediate_size=head_dim,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=theta,
    )


def rotate(x: torch.Tensor, positions: list[int], theta: float) -> torch.Tensor:
    """apply_rope on x [tokens, heads, head_dim] at the given positions."""
    rope = RotaryEmbedding(rope_config(x.shape[-1], theta))
    cos, sin = rope.cos_sin(torch.tensor(positions), torch.float32)
    return apply_rope(x, cos, sin)


head_dims = st.sampled_from([2, 8, 16, 64])
thetas = st.sampled_from([10000.0, 100000.0, 1e6])
positions = st.integers(0, 2048)
seeds = st.integers(0, 2**31 - 1)


@settings(max_examples=25, deadline=None)
@given(head_dim=head_dims, theta=thetas, seed=seeds)
def test_rope_frequencies_follow_the_formula(head_dim, theta, seed):
    """inv_freq[i] = theta^(-2i/head_dim): pair i turns by angle position * inv_freq[i]."""
    rope = RotaryEmbedding(rope_config(head_dim, theta))
    expected = [theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    torch.testing.assert_close(rope.inv_freq.double(), torch.tensor(expected, dtype=torch.float64))
    # Position 0 is the identity rotation.
    x = torch.randn(3, 2, head_dim, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(rotate(x, [0, 0, 0], theta), x)


@settings(max_examples=40, deadline=None)
@given(head_dim=head_dims, theta=thetas, position=positions, seed=seeds)
def test_rope_preserves_norms(head_dim, theta, position, seed):
    """RoPE is a rotation: it changes a vector's direction, never its length."""
    x = torch.randn(1, 3, head_dim, generator=torch.Generator().manual_seed(seed)) * 5
    rotated = rotate(x, [position], theta)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(head_dim=head_dims, theta=thetas, m=positions, n=positions, shift=positions, seed=seeds)
def test_rope_dot_product_depends_only_on_relative_position(head_dim, theta, m, n, shift, seed):
    """q at m and k at n score the same as q at m+s and k at n+s: attention sees only m - n."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, head_dim, generator=generator)
    k = torch.randn(1, 1, head_dim, generator=generator)
    score = (rotate(q, [m], theta) * rotate(k, [n], theta)).sum()
    shifted = (rotate(q, [m + shift], theta) * rotate(k, [n + shift], theta)).sum()
    # float32 angles at positions ~4000 are accurate to ~1e-4 rad, so allow that much.
    tolerance = 2e-3 * q.norm() * k.norm()
    assert abs(score - shifted) <= tolerance


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    size=st.integers(1, 96),
    scale=st.floats(1e-2, 1e2),
    eps=st.sampled_from([1e-6, 1e-5]),
    seed=seeds,
)
def test_rmsnorm_matches_its_definition(rows, size, scale, eps, seed):
    """RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight, per row (checked in float64)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, size, generator=generator) * scale
    weight = torch.randn(size, generator=generator)
    norm = RMSNorm(size, eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
        out = norm(x)
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


# --- the loader's errors --------------------------------------------------------------------


def load(path):
    """Load the way `LLM` does: resolve the path, then build the model from it."""
    return load_model(resolve_model_path(path))


@pytest.fixture(scope="module")
def tiny_llama_copy(tiny_model_dirs, tmp_path_factory):
    """A fresh copy of the tiny llama directory for each broken variant to start from."""

    def copy(name: str):
        target = tmp_path_factory.mktemp(name) / "model"
        shutil.copytree(tiny_model_dirs["llama"], target)
        return target

    return copy


def test_loader_rejects_a_missing_directory(tmp_path):
    """A path that does not exist is named in a clear error, not a hub download attempt."""
    with pytest.raises(ValueError, match="not a local directory"):
        load(tmp_path / "no-such-model")


def test_loader_rejects_a_directory_without_config(tmp_path):
    """A directory without config.json says so."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="config.json"):
        load(tmp_path)


def test_loader_rejects_corrupt_weights(tiny_llama_copy):
    """A damaged safetensors file is reported as damaged weights, with the file's name."""
    path = tiny_llama_copy("corrupt")
    (path / "model.safetensors").write_bytes(b"\x00garbage, not a safetensors header" * 10)
    with pytest.raises(ValueError, match="could not read weights from .*model.safetensors"):
        load(path)


def test_loader_rejects_an_unsupported_architecture(tiny_llama_copy):
    """A model outside the Llama family (here GPT-2) is refused by name, not loaded wrongly."""
    path = tiny_llama_copy("gpt2")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "gpt2"
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*gpt2"):
        load(path)


def test_loader_rejects_weights_of_another_shape_of_model(tiny_llama_copy):
    """Weights missing for some layer (config says 3 layers, file has 2) are named, not ignored."""
    path = tiny_llama_copy("layers")
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing .*layers.2"):
        load(path)
