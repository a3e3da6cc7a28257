"""Chapter 04 (measurement) — float32 matrix products on the CPU go through oneDNN.

The step profile of chapter 04 puts two thirds of a CPU decode step inside `aten::mm`. The
question every profile raises next: is that product as fast as the chip allows? Measuring
says no. PyTorch hands float32 products to its BLAS library (Intel MKL in the standard x86
builds); on the AMD EPYC this book measures on, MKL multiplies two 2048 x 2048 float32
matrices at about 215 GFLOP/s, while oneDNN, the deep-learning library PyTorch also ships
(and already uses for bfloat16), reaches about 480 GFLOP/s on the same product: the chip's
AVX-512 units, fully used. The gap is as large for the skinny products of a decode step
(64 tokens x 576 features): 150 against 300 GFLOP/s.

So every linear layer of our model calls oneDNN's inner-product primitive directly for float32
CPU tensors, the way vLLM's CPU backend routes its linear layers through oneDNN. Both libraries
compute in IEEE float32; only the order of the additions differs, so results differ in the
last bits (about 1e-6 relative), like any two BLAS libraries. bfloat16 already takes this path
inside `F.linear`, float16 has no fast CPU path in oneDNN here, and GPUs use cuBLAS: all of
those keep `F.linear`.

How large the gap is depends on the CPU and the PyTorch build; `measure_matmul_peak` in the
benchmark measures both libraries and reports the better one as the machine's peak.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def uses_onednn(x: torch.Tensor) -> bool:
    """Whether `linear` sends this input to oneDNN rather than to `F.linear`."""
    return (
        x.device.type == "cpu" and x.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, like `F.linear`, on the fastest library for x's device and dtype."""
    if uses_onednn(x):
        # "none": no activation fused after the product; PyTorch's compiler (inductor) calls
        # the same operator for the linear layers it lowers to oneDNN.
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same names) whose product goes through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
