"""Appendix A — matrix products on the CPU go through oneDNN, on packed weights.

The step profile of appendix A puts half of a CPU decode step inside the model's matrix
products. The question every profile raises next: is that product as fast as the chip allows?
The answer depends on the chip, and measuring it found two things.

1. The library. PyTorch hands float32 products to its BLAS library (Intel MKL in the standard
   x86 builds). On the AMD EPYC (Zen 5) where the engine was first tuned, MKL multiplied two
   2048 x 2048 float32 matrices at about 220 GFLOP/s and oneDNN, the deep-learning library
   PyTorch also ships (and already uses for bfloat16), at about 500, with as large a gap on
   the skinny products of a decode step. On an Intel Xeon the two are close on large products
   (MKL a little ahead) and differ at decode sizes (figure A-matmul-libraries).
2. The weight layout. A matrix-multiply kernel reads the weight in tiles of its own blocked
   layout; given a plain row-major matrix, oneDNN rearranges it on every call, a full pass
   over the weights each step. `pack_weight` does that rearrangement once, at load time, as
   vLLM's CPU backend does. On the Intel Xeon, packed oneDNN is 1.4-1.6x MKL for the products
   of an 8- to 16-token decode step, and within a few percent of it from 64 tokens up.

So every linear layer of our model calls oneDNN's inner-product operator directly, on a packed
copy of its weight, for float32 and bfloat16 CPU tensors. Both libraries compute in IEEE
float32 (for bfloat16, float32 accumulation); only the order of the additions differs, so
float32 results differ from MKL's in the last bits (about 1e-6 relative), as any two BLAS
libraries do; packed and plain weights give the same results to that same rounding. float16
(no fast CPU path here) and GPUs (cuBLAS) keep `F.linear`.

The packed copy is the only copy (chapter 12 counts the bytes): once a layer has packed its
weight, its `weight` parameter keeps the shape and dtype and holds no numbers
(`weight_placeholder`). The embedding table is the exception when it also serves as the LM head:
a lookup reads plain rows, so the table is kept both ways. How large the gains are depends on
the CPU and the PyTorch build; `measure_matmul_peak` in the benchmark times every way of
multiplying (MKL, oneDNN, oneDNN on a packed weight) and reports the fastest as the machine's
peak.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.models.quantization import Int4Weight, Int8Weight
from minivllm.utils import define_operator


@functools.cache
def _onednn_dtypes() -> frozenset[torch.dtype]:
    """The dtypes oneDNN multiplies on this machine (bfloat16 needs the CPU's support); asked
    once, not on each of the hundred products of a step."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return frozenset({torch.float32, torch.bfloat16})
    return frozenset({torch.float32})


def uses_onednn(x: torch.Tensor) -> bool:
    """Whether `linear` sends a product with this input (or weight) to oneDNN."""
    return x.device.type == "cpu" and x.dtype in _onednn_dtypes()


# Chapter 11: the compiler traces tensors it can describe by shape, dtype and strides; a packed
# weight is an opaque oneDNN object, which it cannot. So compiled code calls the product as a
# custom operator (`packed_linear`) on the plain weight, and the operator finds the packed twin
# by the plain weight's address (vLLM's CPU backend likewise hands its oneDNN matmul a handle).
# The registry holds the packed tensors weakly: the layer that packed a weight owns the copy.
_PACKED_WEIGHTS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] rearranged once into oneDNN's blocked layout (an opaque tensor that
    only `linear` reads); None where the product does not run on oneDNN."""
    if not uses_onednn(weight):
        return None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    register_packed(weight, packed)
    return packed


def register_packed(weight: torch.Tensor, packed: torch.Tensor) -> None:
    """Let compiled code find `packed` from the tensor it is handed in its place, `weight`."""
    _PACKED_WEIGHTS[weight.data_ptr()] = packed


def weight_placeholder(weight: torch.Tensor, packed: torch.Tensor) -> nn.Parameter:
    """What stays of a weight once its packed copy `packed` serves every product: a tensor of
    the same shape and dtype over a single NaN (stride 0, so 4 bytes instead of the whole
    matrix), registered as the tensor compiled code finds `packed` by. Shape-reading code
    (parameter counts, the compiled graph's inputs) still works, and any product that read it
    by mistake would come out NaN rather than silently stale."""
    nan = torch.full((1,), float("nan"), dtype=weight.dtype, device=weight.device)
    placeholder = nn.Parameter(nan.expand(weight.shape), requires_grad=False)
    register_packed(placeholder, packed)
    return placeholder


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    # "none": no activation fused after the product. PyTorch's compiler (inductor) calls the
    # same operator, on weights packed the same way, for the linear layers it lowers to oneDNN.
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias, read from the packed copy `pack_weight` made of `weight`."""
    return _onednn_linear(x, _PACKED_WEIGHTS[weight.data_ptr()], bias)


def _packed_linear_result(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """What the compiler needs to know of the result: its shape and dtype."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


define_operator(
    "minivllm::packed_linear",
    "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    packed_linear,
    _packed_linear_result,
)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias, like `F.linear`, on the fastest library for x's device and dtype;
    `packed_weight`, when given, is `pack_weight(weight)` and is read instead of `weight`."""
    compiling = torch.compiler.is_compiling()
    if packed_weight is not None:
        if compiling:
            return torch.ops.minivllm.packed_linear(x, weight, bias)
        return _onednn_linear(x, packed_weight, bias)
    # Compiled code multiplies a plain weight as inductor chooses (its lowering of oneDNN's
    # operator expects a packed weight).
    if compiling or not uses_onednn(x):
        return F.linear(x, weight, bias)
    return _onednn_linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same names) whose product goes through `linear`, on a
    packed copy of the weight once `pack` has run, or on a quantized weight (chapter 12) once
    `quantize` has."""

    packed_weight: torch.Tensor | None = None
    quantized: Int8Weight | Int4Weight | None = None

    def reset_parameters(self) -> None:
        """No random initialisation: every weight is read from a checkpoint (models/loader.py),
        so building a model only allocates memory."""

    def pack(self) -> None:
        """Make the packed copy and drop the plain one; call once the weight is final (loaded,
        in its dtype). A second call changes nothing."""
        if self.quantized is not None or self.packed_weight is not None:
            return
        self.packed_weight = pack_weight(self.weight)
        if self.packed_weight is not None:
            self.weight = weight_placeholder(self.weight, self.packed_weight)

    def quantize(self, weight: Int8Weight | Int4Weight) -> None:
        """Multiply by `weight` from now on; the float weight is dropped (one copy only)."""
        self.quantized = weight
        self.weight = None
        self.packed_weight = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T, without the bias."""
        if self.quantized is not None:
            return self.quantized.matmul(x)
        return linear(x, self.weight, None, self.packed_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:  # oneDNN adds the bias inside its product
            return linear(x, self.weight, self.bias, self.packed_weight)
        out = self.quantized.matmul(x)
        return out if self.bias is None else out + self.bias
