"""Chapter 00 — the model: a Llama-family decoder written out in plain PyTorch.

Every model minivllm runs (Llama, Mistral, Qwen2, Qwen3, SmolLM) is this one stack:

    token ids -> embedding -> N x [RMSNorm -> attention -> +residual -> RMSNorm -> SwiGLU MLP
    -> +residual] -> RMSNorm -> LM head -> logits

Two choices make the rest of the book possible:

1. The forward pass takes a *flat* batch: all tokens of all sequences side by side in one
   1-D tensor, with a position per token. No padding, no [batch, seq] rectangle. A prompt of
   300 tokens and a decode step of 1 token sit in the same batch as 301 rows.
2. The model does not know how attention reads the past. Each attention layer computes its
   q, k, v and hands them to an `AttentionBackend` passed in with the batch. Chapter 01's
   backend recomputes everything, chapter 02's keeps a contiguous KV cache, chapter 03's a
   paged one; the model code never changes.

Parameter names mirror Hugging Face's (`model.layers.0.self_attn.o_proj.weight`, ...) with one
exception that is also vLLM's: projections that read the same input are fused into one matrix.
q, k and v become `qkv_proj`, gate and up become `gate_up_proj`: one large matrix product
instead of three or two small ones, which keeps the CPU's (or GPU's) arithmetic units busier.
The loader copies each checkpoint matrix into its rows of the fused one (`loader.load_model`).

The linear layers carry vLLM's names for how they split across devices (`QKVParallelLinear`,
`RowParallelLinear`, ...: chapter 07, `models/parallel_layers.py`). On one device nothing is
split, and each is an ordinary linear layer.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.config import ModelConfig
from minivllm.distributed.parallel_state import SINGLE_PROCESS, TensorParallelGroup
from minivllm.models.linear import Linear
from minivllm.models.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minivllm.models.quantization import INT4_GROUP_SIZE, Int8Weight, quantize_weight


class AttentionBackend(Protocol):
    """What the model needs from an attention implementation.

    Called once per layer with the new tokens' projections, shapes
    q: [num_tokens, num_heads, head_dim], k and v: [num_tokens, num_kv_heads, head_dim];
    returns [num_tokens, num_heads, head_dim]. The backend decides where K/V are stored and
    which earlier tokens each query sees (its own sequence's, causally).
    """

    def __call__(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 like the reference models."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE): rotate pairs of q/k features by position-dependent angles.

    Feature i of the first half is paired with feature i of the second half and rotated by
    angle position * inv_freq[i]. Because a rotation by a then by -b is a rotation by a-b, the
    dot product q_m . k_n depends only on m - n: attention sees relative positions.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq, self.attention_scaling = _rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin of every angle, [num_tokens, head_dim], shared by all layers."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def _rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """inv_freq[i] = theta^(-2i/head_dim), or a scaled variant of it.

    The plain formula is the lesson and is written out; the scaled variants (linear, llama3,
    yarn: ways to stretch a model to longer contexts) reuse transformers' well-tested formulas.
    """
    # Frequencies are a few dozen numbers computed on the CPU, even when the model is being
    # built on the "meta" device (shapes only) before its weights are loaded.
    with torch.device("cpu"):
        if config.rope_type == "default":
            exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
            return 1.0 / (config.rope_theta**exponents), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[config.rope_type](config.hf_config, "cpu")
        return inv_freq.float(), float(scaling)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, heads, head_dim] by the angles whose cos/sin are [num_tokens, head_dim]."""
    first_half, second_half = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-second_half, first_half), dim=-1)
    return x * cos[:, None, :] + rotated_half * sin[:, None, :]


class Attention(nn.Module):
    """Grouped-query attention: num_heads query heads share num_kv_heads K/V heads.

    Split over tensor-parallel ranks (chapter 07), each rank holds its share of the heads
    (`ModelConfig.per_rank`) and attends over them alone; o_proj sums the ranks' parts.
    """

    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup):
        super().__init__()
        self.layer_index = layer_index
        rank_config = config.per_rank(tp.size)
        self.num_heads = rank_config.num_heads
        self.num_kv_heads = rank_config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=config.attention_bias,
            tp=tp,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, bias=False, tp=tp
        )
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(self.layer_index, q, k, v)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup):
        super().__init__()
        width = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [width, width], tp=tp)
        self.down_proj = RowParallelLinear(width, config.hidden_size, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, hidden, cos, sin, attention: AttentionBackend) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attention)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    """Embedding, the decoder layers and the final norm: token ids -> hidden states."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self, input_ids, positions, attention: AttentionBackend, num_layers: int | None = None
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        for layer in self.layers[:num_layers]:
            hidden = layer(hidden, cos, sin, attention)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head that turns a hidden state into one logit per vocabulary entry.

    `tp` is the tensor-parallel group this copy of the model is one rank of (chapter 07); by
    default a group of one, and the model is whole.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_PROCESS):
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, tp)
        # Tied models (SmolLM2, small Qwens) reuse the embedding matrix as the LM head.
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] of a flat batch of tokens. `num_layers`
        stops after the first layers (chapter 08's layer-skip draft: the final norm and the LM
        head then read an early layer's output); None runs them all."""
        return self.model(input_ids, positions, attention, num_layers)

    @property
    def device(self) -> torch.device:
        """Where the model is (read from the final norm: a quantized model, chapter 12, has no
        float embedding table)."""
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (norms stay in it, whatever the linear layers store)."""
        return self.model.norm.weight.dtype

    @property
    def logits_layer(self) -> VocabParallelEmbedding:
        """The matrix that turns hidden states into logits: the LM head, or the embedding."""
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [n, vocab] for the hidden states we sample from (on rank 0 of a
        tensor-parallel group; None on the others, which do not sample).

        Kept apart from `forward` because only the last token of each sequence needs logits.
        Projecting every prompt token onto a 49k vocabulary would add about a quarter to a
        small model's arithmetic (576 x 49,152 multiply-adds per token against 30 layers of
        3.5 M) and hold a [tokens, 49152] float tensor, 56 MiB for a 300-token prompt, for the
        one row that is used.
        """
        return self.logits_layer.compute_logits(hidden)

    def quantize_weights(self, method: str, group_size: int = INT4_GROUP_SIZE) -> None:
        """Chapter 12: every linear layer's weight in `method`'s scheme ("int8" per output
        channel, "int4" in groups of `group_size`), the embedding table (the LM head when
        tied) and an untied LM head in int8; the float copies are dropped."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize(quantize_weight(module.weight, method, group_size))
        self.quantize_tables()

    def quantize_tables(self) -> None:
        """The embedding table and the LM head (one matrix when tied) in int8 per row."""
        for table in {id(t): t for t in (self.model.embed_tokens, self.logits_layer)}.values():
            table.quantize(Int8Weight.from_float(table.weight))

    def pack_weights(self) -> None:
        """Rearrange every weight matrix once into the layout the CPU product reads
        (models/linear.py); a no-op where the products do not run on oneDNN."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self.logits_layer.pack()
