"""Chapter 02's learning checks: KV-cache memory math and batched decode attention."""

from __future__ import annotations

from types import SimpleNamespace

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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _our_kv_bytes_per_token():
    from minivllm.config import ModelConfig

    def kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype):
        config = ModelConfig(
            model_type="llama", vocab_size=1, hidden_size=1, intermediate_size=1,
            num_layers=num_layers, num_heads=num_kv_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, rms_norm_eps=1e-6, max_position_embeddings=1,
            tie_word_embeddings=True,
        )  # fmt: skip
        return config.kv_bytes_per_token(dtype)

    return kv_bytes_per_token


@learning_check(
    "ch02.kv_bytes_per_token",
    signature="kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, "
    "dtype: torch.dtype) -> int",
    reference=_our_kv_bytes_per_token,
)
def check_kv_bytes_per_token(kv_bytes_per_token) -> None:
    """Equals the bytes transformers' own KV cache grows by per token, for random shapes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    @check_settings(max_examples=10)
    @given(
        num_layers=st.integers(1, 3),
        num_kv_heads=st.integers(1, 3),
        group=st.integers(1, 2),
        head_dim=st.sampled_from([2, 4, 8]),
        dtype_name=st.sampled_from(list(DTYPES)),
        num_tokens=st.integers(1, 5),
    )
    def property_(num_layers, num_kv_heads, group, head_dim, dtype_name, num_tokens):
        dtype = DTYPES[dtype_name]
        config = LlamaConfig(
            vocab_size=16, hidden_size=4 * num_kv_heads * group, intermediate_size=8, num_hidden_layers=num_layers,
            num_attention_heads=num_kv_heads * group, num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
        )  # fmt: skip
        model = LlamaForCausalLM(config).to(dtype)
        with torch.no_grad():
            cache = model(torch.zeros(1, num_tokens, dtype=torch.long), use_cache=True)
        # transformers 5 names the returned cache `cache`; earlier versions `past_key_values`.
        cache = cache.cache if "cache" in cache else cache.past_key_values
        measured = sum(
            layer.keys.numel() * layer.keys.element_size()
            + layer.values.numel() * layer.values.element_size()
            for layer in cache.layers
        )
        got = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        assert got * num_tokens == measured, (
            f"got {got} bytes per token, expected {measured // num_tokens}: transformers' "
            f"cache holds {measured} bytes after {num_tokens} token(s) (num_layers={num_layers}, "
            f"num_kv_heads={num_kv_heads}, head_dim={head_dim}, dtype={dtype}, "
            f"{num_kv_heads * group} query head(s))"
        )

    property_()


def _our_decode_attention():
    from minivllm.baselines.kv_cache import DecodeAttention

    def decode_attention(q, keys, values, seq_lens):
        cache = SimpleNamespace(keys=keys[None].clone(), values=values[None].clone())
        rows = torch.arange(len(seq_lens))
        # The newest token's K/V are already in the cache; writing them again changes nothing.
        new_k, new_v = keys[rows, seq_lens - 1], values[rows, seq_lens - 1]
        return DecodeAttention(cache, seq_lens)(0, q, new_k, new_v)

    return decode_attention


@learning_check(
    "ch02.decode_attention",
    signature="decode_attention(q: Tensor[batch, heads, head_dim], keys: Tensor[batch, max_len, "
    "kv_heads, head_dim], values: (same), seq_lens: Tensor[batch]) -> Tensor[batch, heads, "
    "head_dim]; row b attends to slots 0..seq_lens[b]-1; query head h uses kv head "
    "h // (heads // kv_heads)",
    reference=_our_decode_attention,
)
def check_decode_attention(decode_attention) -> None:
    """Equals softmax(q.k / sqrt(d)) v over each row's own slots, one row and head at a time."""

    @check_settings(max_examples=30)
    @given(
        batch=st.integers(1, 4),
        kv_heads=st.integers(1, 2),
        group=st.integers(1, 3),
        head_dim=st.sampled_from([1, 4, 8]),
        max_len=st.integers(1, 10),
        data=st.data(),
    )
    def property_(batch, kv_heads, group, head_dim, max_len, data):
        seq_lens = torch.tensor(
            data.draw(st.lists(st.integers(1, max_len), min_size=batch, max_size=batch))
        )
        seed = data.draw(st.integers(0, 2**16))
        generator = torch.Generator().manual_seed(seed)
        heads = kv_heads * group
        q = torch.randn(batch, heads, head_dim, generator=generator)
        keys = torch.randn(batch, max_len, kv_heads, head_dim, generator=generator)
        values = torch.randn(batch, max_len, kv_heads, head_dim, generator=generator)
        expected = torch.empty(batch, heads, head_dim, dtype=torch.float64)
        for b in range(batch):
            n = int(seq_lens[b])
            for h in range(heads):
                k = keys[b, :n, h // group].double()
                v = values[b, :n, h // group].double()
                weights = torch.softmax(k @ q[b, h].double() / head_dim**0.5, dim=0)
                expected[b, h] = weights @ v
        got = decode_attention(q, keys, values, seq_lens)
        assert got.shape == expected.shape, (
            f"shape {tuple(got.shape)}, expected {tuple(expected.shape)} [batch, heads, "
            f"head_dim] (q {tuple(q.shape)}, keys and values {tuple(keys.shape)}, "
            f"seq_lens={seq_lens.tolist()})"
        )
        where = first_mismatch(got, expected, atol=1e-5)
        if where is not None:
            b, h = where[:2]
            n = int(seq_lens[b])
            raise AssertionError(
                f"row {b} (seq_len {n}), head {h} (reads kv head {h // group}): "
                f"expected {show_values(expected[b, h])}, got {show_values(got[b, h])} "
                f"for q[{b}, {h}] = {show_values(q[b, h])}, keys[{b}, :{n}, {h // group}] = "
                f"{show_values(keys[b, :n, h // group])}, values[{b}, :{n}, {h // group}] = "
                f"{show_values(values[b, :n, h // group])}; "
                f"{num_mismatches(got, expected, 1e-5, dims=2)} of {batch * heads} (row, head) "
                f"pairs wrong, max difference {(got.double() - expected).abs().max().item():.3g} "
                f"(seq_lens={seq_lens.tolist()}, max_len={max_len}, heads={heads}, "
                f"kv_heads={kv_heads})"
            )

    property_()
