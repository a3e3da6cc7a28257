"""Chapter 11 — attention as one opaque operator, so that the compiler can take the rest.

`torch.compile` turns the model's forward into one graph of tensor operations and fuses the
cheap ones (norms, rotary, SiLU times up, residual adds) into a few loops. Attention does not
fit in such a graph: it writes the paged pool in place, its loops run over the step's
sequences (Python lists of lengths), and its backend object changes every step. So, as vLLM
does (`unified_attention`), the model's attention call becomes one custom operator
`minivllm::attention(q, k, v, layer_index)`: to the compiler a black box that maps q to a
tensor of q's shape; at run time it calls the step's backend, which the runner names before
the forward:

    with forward_context(backend):          # this step's PagedAttentionBackend
        hidden = compiled_model(input_ids, positions, OPAQUE_ATTENTION)

One compiled graph then serves every step: what changes from step to step (the batch's
sequences, the pool's blocks) lives outside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from minivllm.attention.backend import PagedAttentionBackend
from minivllm.utils import define_operator

_current_backend: PagedAttentionBackend | None = None


@contextmanager
def forward_context(backend: PagedAttentionBackend) -> Iterator[None]:
    """Every `minivllm::attention` call inside the block runs on `backend`."""
    global _current_backend
    previous, _current_backend = _current_backend, backend
    try:
        yield
    finally:
        _current_backend = previous


def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int
) -> torch.Tensor:
    """The current backend's attention for layer `layer_index` (it also stores k and v in the
    pool: the pool is not an argument, so the compiler neither sees nor reorders that write)."""
    if _current_backend is None:
        raise RuntimeError("minivllm::attention called outside forward_context(backend)")
    return _current_backend(layer_index, q, k, v)


def _attention_result(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int):
    """All the compiler needs: the result has q's shape and dtype."""
    return torch.empty_like(q)


define_operator(
    "minivllm::attention",
    "(Tensor q, Tensor k, Tensor v, int layer_index) -> Tensor",
    attention_op,
    _attention_result,
)


class OpaqueAttention:
    """What the compiled model is handed as its attention backend: every call goes through
    the custom operator, hence to the backend of the current forward context."""

    def __call__(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.minivllm.attention(q, k, v, layer_index)


OPAQUE_ATTENTION = OpaqueAttention()
