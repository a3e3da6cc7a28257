"""Chapter 00's learning checks: RMSNorm and rotary position embeddings."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm.learning_checks import (
    check_settings,
    first_mismatch,
    learning_check,
    num_mismatches,
    show_values,
)


def _our_rms_norm():
    from minivllm.models.llama import RMSNorm

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        norm = RMSNorm(weight.shape[0], eps)
        norm.weight.data = weight
        return norm(x)

    return rms_norm


@learning_check(
    "ch00.rms_norm",
    signature="rms_norm(x: Tensor[..., hidden], weight: Tensor[hidden], eps: float) -> Tensor",
    reference=_our_rms_norm,
)
def check_rms_norm(rms_norm) -> None:
    """Equals the definition x / sqrt(mean(x^2) + eps) * weight, computed in float64."""

    @check_settings(max_examples=40)
    @given(
        rows=st.integers(1, 4),
        hidden=st.integers(1, 64),
        scale=st.sampled_from([1e-3, 1.0, 100.0]),
        eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
        seed=st.integers(0, 2**16),
    )
    def property_(rows, hidden, scale, eps, seed):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, hidden, generator=generator) * scale
        weight = torch.randn(hidden, generator=generator)
        x64 = x.double()
        expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
        got = rms_norm(x, weight, eps)
        assert got.shape == x.shape, (
            f"shape {tuple(got.shape)}, expected {tuple(x.shape)}, the shape of x "
            f"(x = {show_values(x)}, weight = {show_values(weight)}, eps={eps})"
        )
        where = first_mismatch(got, expected, atol=1e-5, rtol=1e-4)
        if where is not None:
            row = where[0]
            raise AssertionError(
                f"row {row}: expected {show_values(expected[row])}, got {show_values(got[row])} "
                f"for x[{row}] = {show_values(x[row])}, eps={eps}; "
                f"{num_mismatches(got, expected, 1e-5, 1e-4, dims=1)} of {rows} rows wrong, "
                f"max difference {(got.double() - expected).abs().max().item():.3g}"
            )

    property_()


def _our_rope():
    from minivllm.config import ModelConfig
    from minivllm.models.llama import RotaryEmbedding, apply_rope

    def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
        head_dim = x.shape[-1]
        config = ModelConfig(
            model_type="llama", vocab_size=1, hidden_size=head_dim, intermediate_size=1,
            num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim, rms_norm_eps=1e-6,
            max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=theta,
        )  # fmt: skip
        cos, sin = RotaryEmbedding(config).cos_sin(positions, x.dtype)
        return apply_rope(x, cos, sin)

    return rope


@learning_check(
    "ch00.rope",
    signature="rope(x: Tensor[tokens, heads, head_dim], positions: Tensor[tokens], theta: float)"
    " -> Tensor",
    reference=_our_rope,
)
def check_rope(rope) -> None:
    """Equals transformers' Llama rotary embedding for random positions, heads and theta."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    @check_settings(max_examples=40)
    @given(
        tokens=st.integers(1, 8),
        heads=st.integers(1, 3),
        half_head_dim=st.integers(1, 16),
        theta=st.sampled_from([10_000.0, 100_000.0, 500.0]),
        positions=st.lists(st.integers(0, 4000), min_size=8, max_size=8),
        seed=st.integers(0, 2**16),
    )
    def property_(tokens, heads, half_head_dim, theta, positions, seed):
        head_dim = 2 * half_head_dim
        x = torch.randn(tokens, heads, head_dim, generator=torch.Generator().manual_seed(seed))
        position_ids = torch.tensor(positions[:tokens])
        config = LlamaConfig(
            hidden_size=head_dim * heads, num_attention_heads=heads, head_dim=head_dim,
            rope_parameters={"rope_type": "default", "rope_theta": theta},
        )  # fmt: skip
        cos, sin = LlamaRotaryEmbedding(config)(x, position_ids[None])
        # transformers wants [batch, heads, tokens, head_dim]
        x_hf = x.transpose(0, 1)[None]
        expected, _ = apply_rotary_pos_emb(x_hf, x_hf, cos, sin)
        expected = expected[0].transpose(0, 1)
        got = rope(x, position_ids, theta)
        assert got.shape == x.shape, (
            f"shape {tuple(got.shape)}, expected {tuple(x.shape)}, the shape of x "
            f"[tokens, heads, head_dim] (positions={position_ids.tolist()}, theta={theta})"
        )
        # float32 angles of large positions carry rounding errors of ~1e-4 whichever way the
        # frequencies are written; a wrong rotation is off by O(1).
        where = first_mismatch(got, expected, atol=1e-3)
        if where is not None:
            token, head = where[:2]
            raise AssertionError(
                f"token {token} (position {positions[token]}), head {head}: expected "
                f"{show_values(expected[token, head])}, got {show_values(got[token, head])} "
                f"for x = {show_values(x[token, head])}; "
                f"{num_mismatches(got, expected, 1e-3, dims=2)} of {tokens * heads} "
                f"(token, head) pairs wrong, max difference "
                f"{(got - expected).abs().max().item():.3g} (theta={theta}, head_dim={head_dim}; "
                "features i and i + head_dim/2, for i < head_dim/2, turn together by the "
                "angle position * theta^(-2i/head_dim))"
            )

    property_()
