"""Chapter 12 — weight-only quantization: fewer bytes per weight, the same products.

A batch-1 decode step reads every weight of the model once to make one token, and does two
floating-point operations per weight read: on any CPU or GPU that is far below what the
arithmetic units could do, so the bytes, not the FLOPs, set the speed. Storing the weights in
fewer bits makes each step read fewer bytes. Weight-only quantization keeps the activations
(and the KV cache) in the model's dtype and stores only the weights as small integers with a
few floating-point numbers that say how to turn them back:

    int8, per output channel:   w[n, k] ~ q[n, k] * scale[n]                    q in -127..127
    int4, group-wise:           w[n, k] ~ q[n, k] * scale[n, g] + minimum[n, g]  q in 0..15,
                                                                   g = k // group_size

int8 gives each row of the weight one scale (its largest magnitude over 127); int4 has only 16
levels, so one range per row would be too coarse: each group of 32 (or 64) weights along a row
gets its own scale and minimum. That is llama.cpp's Q4_1 layout, the one the embedded model's
GGUF file ships in (`load_gguf_linear_weights`), so minivllm can run the file's own 4-bit
levels (minivllm's kernels read its scales and minimums exactly; PyTorch's int4 kernels, where
they serve, round each group's scale and zero to the activations' dtype; see `Int4Weight`).
These products are W4A16 and W8A16: the activations stay floats and
each weight is dequantized to a float before it multiplies. llama.cpp's CPU product of a Q4_1
file is W4A8 instead, the activations quantized to int8 per block of 32 and multiplied as
integers (`torch.ops.minivllm.int4_linear(..., int8_activations=True)` is that product, for
comparison).

The products dequantize inside the kernel: for a decode's few rows none of them writes a float
copy of the weight, and minivllm's own never write one of the whole weight. On a CPU
minivllm has its own (`cpu_quantized.py`, C++ built with chapter 06's kernel: a product that
reads the integers for a decode's few rows, a tiled one for many), fast in float32 and bfloat16:
they multiply every int8 and int4 weight there. PyTorch's
`_weight_int8pack_mm` and its int4 kernels (`_weight_int4pack_mm_for_cpu`; tinygemm's
`_weight_int4pack_mm` on CUDA) read the small integers and their scales; they are fast for some
activation dtypes only (`config.KERNEL_ACTIVATION_DTYPES`: bfloat16 on the CPU); they serve a CPU
where minivllm's could not be built, and CUDA, and an engine with no other kernel refuses the
other dtypes. Where they are used, int8 products of more than
INT8_FUSED_MAX_ROWS rows convert the weight once per call for the float product. Where no kernel
fits, the layers multiply by a dequantized copy made per call: correct and slow, the tests'
reference; `kernel` says which ran. The tinygemm kernels store a group as (scale, zero) with w =
(q - 8) * scale + zero, so zero = minimum + 8 * scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.config import (
    KERNEL_ACTIVATION_DTYPES,
    supported_activation_dtypes,
    uses_own_cpu_kernels,
)
from minivllm.models import cpu_quantized

INT4_GROUP_SIZE = 32  # weights per scale and minimum: Q4_1's block
SMALLEST_SCALE = torch.finfo(torch.float32).tiny  # the smallest normal float32, 1.2e-38
INT8_LEVELS = 127  # symmetric: -127..127 (-128 left out, so that q and -q both exist)
INT4_LEVELS = 15  # 0..15


# --- the schemes, as plain functions: what the kernels compute, written out -------------------


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel (row): q = round(w / scale), scale = max |w| of the row / 127.
    Returns q [N, K] int8 and scale [N] float32. A row whose scale would not be a normal
    float32 (every |w| below 127 x 1.2e-38, no trained weight's row) is stored as zeros with
    scale 1, like an all-zero row: a subnormal scale keeps too few bits to hold 127 levels."""
    weight = weight.detach().float()  # no autograd graph: it would keep the float weight alive
    scale = weight.abs().amax(dim=1) / INT8_LEVELS
    scale = torch.where(scale >= SMALLEST_SCALE, scale, 1.0)  # then every q is 0
    q = torch.round(weight / scale[:, None]).clamp(-INT8_LEVELS, INT8_LEVELS)
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def quantize_int4(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise, asymmetric: each run of `group_size` weights along a row is mapped onto
    0..15 between its own minimum and maximum, q = round((w - minimum) / scale) with
    scale = (maximum - minimum) / 15. Returns q [N, K] uint8, scale and minimum [N, K / group]
    float32. A group whose scale would not be a normal float32 (a constant group, or one whose
    range is below 15 x 1.2e-38) keeps only its minimum, with scale 1 and q = 0."""
    rows, columns = weight.shape
    if columns % group_size:
        raise ValueError(f"int4 groups of {group_size} do not divide a row of {columns} weights")
    groups = weight.detach().float().reshape(rows, columns // group_size, group_size)
    minimum, maximum = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (maximum - minimum) / INT4_LEVELS
    scale = torch.where(scale >= SMALLEST_SCALE, scale, 1.0)  # then q = 0, w = minimum
    q = torch.round((groups - minimum[..., None]) / scale[..., None]).clamp(0, INT4_LEVELS)
    return q.reshape(rows, columns).to(torch.uint8), scale, minimum


def dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int
) -> torch.Tensor:
    rows, columns = q.shape
    groups = q.float().reshape(rows, columns // group_size, group_size)
    weight = groups * scale.float()[..., None] + minimum.float()[..., None]
    return weight.reshape(rows, columns)


# --- the weights the layers hold ---------------------------------------------------------------


# Rows of activations up to which a product reads the int8 weight in the fused kernel. The
# kernel is a matrix-vector loop: for a decode step's few rows it reads 1 byte a weight where
# the float product reads 2; for more rows the float product's tiled kernel wins even after
# converting the weight for it, once per call. Measured on a 2-core x86 CPU in bfloat16
# (medians of 3 runs, fused against converted): a 3072 x 576 MLP weight 0.67 against 0.72 ms at
# 12 rows, 0.92 against 0.84 at 16, 1.37 against 0.97 at 24; the 49152 x 576 LM head, whose
# converted copy leaves the cache, 25 against 53 ms at 16 rows and even at 32. A decode step of
# all the embedded model's layers is faster fused at 16 rows and slower at 24.
INT8_FUSED_MAX_ROWS = 16


class Int8Weight:
    """An int8 weight [N, K] with one scale per row. On a CPU where chapter 12's own kernels
    built, `torch.ops.minivllm.int8_linear` multiplies it: a product that reads the int8 values for
    a few rows, a tiled one for many (see that module). Elsewhere `_weight_int8pack_mm` reads
    the int8 values and applies the row's scale to each output for a few rows, and for more
    rows (or a dtype that kernel is not fast for) the float product runs on the weight
    converted to the activations' dtype, the scales applied to its output: one float copy of
    the weight per call."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.q = q
        self.dtype = dtype
        self.own_kernel = uses_own_cpu_kernels(q.device)
        # minivllm's kernels read float32 scales (exactly the quantizer's); PyTorch's want the
        # activations' dtype.
        self.scale = scale.float() if self.own_kernel else scale.to(dtype)
        self.has_fused_kernel = dtype in supported_activation_dtypes("int8", q.device)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Weight:
        return cls(*quantize_int8(weight), dtype=weight.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    @property
    def kernel(self) -> str:
        """What multiplies a decode step's few rows."""
        if self.own_kernel:
            return "minivllm_cpu.int8_gemv"
        if self.has_fused_kernel:
            return "aten._weight_int8pack_mm"
        return "F.linear on the weight in the activations' dtype"

    def product_for(self, num_rows: int) -> str:
        """Which product multiplies `num_rows` rows of activations: "own" (minivllm's kernels,
        which choose by the row count themselves), "fused" (PyTorch's kernel reads the int8
        weight) or "dequantized" (the float product on the weight converted)."""
        if self.own_kernel:
            return "own"
        if self.has_fused_kernel and num_rows <= INT8_FUSED_MAX_ROWS:
            return "fused"
        return "dequantized"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T for x [..., K]."""
        flat = x.reshape(-1, x.shape[-1])
        product = self.product_for(flat.shape[0])
        if product == "own":
            out = torch.ops.minivllm.int8_linear(flat, self.q, self.scale)
        elif product == "fused":
            out = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scale)
        else:  # (x @ q.T) * scale is x @ (q * scale).T: the scales touch the output only
            out = F.linear(flat, self.q.to(x.dtype)) * self.scale
        return out.reshape(*x.shape[:-1], self.q.shape[0])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids`: an embedding lookup from the same table."""
        return (self.q[ids].to(self.scale.dtype) * self.scale[ids, None]).to(self.dtype)


@dataclass(frozen=True)
class Int4Layout:
    """Which kernel multiplies an int4 weight, and the packing it reads."""

    kernel: str  # "minivllm" (our own, CPU), "cpu" (PyTorch's), "cuda" (tinygemm) or "reference"
    inner_k_tiles: int = 0  # tinygemm's packing: K must be a multiple of inner_k_tiles * 16


def int4_layout(shape: torch.Size, group_size: int, dtype: torch.dtype, device) -> Int4Layout:
    """A kernel for a dtype `config.supported_activation_dtypes` names, where the shape fits
    it. On a CPU, minivllm's own products where they built (float32 and bfloat16, groups of
    whole 32-weight blocks): at a decode's one row they are the faster ones (the embedded
    model's int4 layers, two threads, bfloat16: 7.9 ms a step in all against 10.0 with PyTorch's
    kernel); else PyTorch's kernel for bfloat16 where N is a multiple of 16 (its packing tiles
    the rows by 16; any K that groups divide). tinygemm on CUDA needs N a multiple of 8, groups
    of 32-256 and K a multiple of 32 (its packing tiles K by 16 x inner_k_tiles). Anything
    else: the reference product."""
    rows, columns = shape
    device = torch.device(device)
    if dtype not in supported_activation_dtypes("int4", device):
        return Int4Layout("reference")
    if device.type == "cpu":
        own_fits = uses_own_cpu_kernels(device) and group_size % 32 == 0
        if not own_fits and dtype in KERNEL_ACTIVATION_DTYPES["cpu"]["int4"] and rows % 16 == 0:
            return Int4Layout("cpu")
        return Int4Layout("minivllm" if own_fits else "reference")
    if device.type == "cuda" and rows % 8 == 0 and group_size >= 32:
        for tiles in (8, 4, 2):
            if columns % (tiles * 16) == 0:
                return Int4Layout("cuda", tiles)
    return Int4Layout("reference")


def narrowest_exact_floats(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in float16 if every value of every one is a float16 number exactly (the
    round trip changes nothing), else in float32."""
    as_half = [t.half() for t in tensors]
    if all(torch.equal(h.float(), t.float()) for h, t in zip(as_half, tensors)):
        return tuple(as_half)
    return tuple(t.float() for t in tensors)


class Int4Weight:
    """A group-wise int4 weight [N, K], packed once for the device's kernel (two values a
    byte); only the packed values and each group's scale and zero are kept.

    minivllm's CPU kernel reads Q4_1's layout (`cpu_quantized.pack_int4_blocks`) with each
    group's scale and minimum as they are: in float16 where both are float16 numbers exactly (a
    GGUF file's, half the bytes), in float32 otherwise; nothing is rounded. PyTorch's kernels
    read a scale and zero in the activations' dtype, so those two numbers are rounded to it
    once, here: with bfloat16 activations a group's weights are
    (q - 8) * bf16(scale) + bf16(minimum + 8 * scale), the zero summed in float32 first. The
    levels q are kept exactly; the reference layout keeps scale and minimum as given."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor,
        group_size: int,
        dtype: torch.dtype,
    ):
        self.shape = q.shape
        self.group_size = group_size
        self.dtype = dtype
        self.layout = int4_layout(q.shape, group_size, dtype, q.device)
        if self.layout.kernel == "reference":
            self.q, self.scale, self.minimum = q, scale, minimum
            return
        if self.layout.kernel == "minivllm":
            self.packed = cpu_quantized.pack_int4_blocks(q)
            self.scale, self.minimum = narrowest_exact_floats(scale, minimum)
            return
        # tinygemm's (scale, zero) per group, [K / group, N, 2]: w = (q - 8) * scale + zero.
        zero = minimum + 8 * scale
        self.scale_and_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        if self.layout.kernel == "cpu":
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
        else:  # CUDA: two values a byte, the even column in the high nibble
            pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(
                pairs, self.layout.inner_k_tiles
            )

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Weight:
        return cls(*quantize_int4(weight, group_size), group_size=group_size, dtype=weight.dtype)

    @property
    def kernel(self) -> str:
        return {
            "minivllm": "minivllm_cpu.int4_gemv",
            "cpu": "aten._weight_int4pack_mm_for_cpu",
            "cuda": "aten._weight_int4pack_mm (tinygemm)",
            "reference": "dequantize + F.linear (reference)",
        }[self.layout.kernel]

    @property
    def nbytes(self) -> int:
        if self.layout.kernel == "reference":
            return self.q.nbytes + self.scale.nbytes + self.minimum.nbytes
        if self.layout.kernel == "minivllm":
            return self.packed.nbytes + self.scale.nbytes + self.minimum.nbytes
        return self.packed.nbytes + self.scale_and_zero.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T for x [..., K]."""
        flat = x.reshape(-1, x.shape[-1])
        if self.layout.kernel == "minivllm":
            out = torch.ops.minivllm.int4_linear(flat, self.packed, self.scale, self.minimum)
        elif self.layout.kernel == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.packed, self.group_size, self.scale_and_zero
            )
        elif self.layout.kernel == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(
                flat, self.packed, self.group_size, self.scale_and_zero
            )
        else:  # in float32, rounded once: a reference adds no error of its own (a bfloat16
            # CPU product of one row measured several percent off the exact one)
            weight = dequantize_int4(self.q, self.scale, self.minimum, self.group_size)
            out = F.linear(flat.float(), weight).to(x.dtype)
        return out.reshape(*x.shape[:-1], self.shape[0])


def quantize_weight(
    weight: torch.Tensor, method: str, group_size: int = INT4_GROUP_SIZE
) -> Int8Weight | Int4Weight:
    """A linear layer's weight [N, K] in `method`'s scheme ("int8" or "int4")."""
    if method == "int8":
        return Int8Weight.from_float(weight)
    if method == "int4":
        return Int4Weight.from_float(weight, group_size)
    raise ValueError(f"no weight quantization {method!r}: it is 'int8' or 'int4'")


# --- the shipped Q4_1 file, as it is ------------------------------------------------------------

# llama.cpp's Q4_1 block: 32 weights of a row in 20 bytes, a float16 scale d, a float16 minimum
# m, then 16 bytes of 4-bit values: byte j holds weight j in its low nibble and weight j + 16 in
# its high one. Weight = q * d + m: the int4 scheme above, with groups of 32.
Q4_1_BLOCK = 32
Q4_1_BLOCK_BYTES = 2 + 2 + Q4_1_BLOCK // 2

# GGUF's tensor names -> Hugging Face's (what our weight loaders are keyed by), per layer.
GGUF_LINEAR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpack_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's bytes [N, K / 32 * 20] -> q [N, K] uint8, scale and minimum [N, K / 32]
    float32 (every float16 is a float32 exactly: the file's d and m, bit for bit), without
    dequantizing a weight."""
    rows = blocks.shape[0]
    blocks = blocks.reshape(rows, -1, Q4_1_BLOCK_BYTES)
    scale = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    minimum = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    nibbles = blocks[..., 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # weights 0-15, then 16-31
    return q.reshape(rows, -1), scale, minimum


# general.architecture -> whether llama.cpp's converter permuted that architecture's q and k rows.
# Its LlamaModel does (Llama and Mistral checkpoints, both written as "llama"): llama.cpp's
# rotary embedding for them pairs neighbouring dimensions, Hugging Face's the two halves of a
# head. Qwen2 and Qwen3 rotate the halves in llama.cpp too (its NEOX rotation) and are written
# as they are. transformers' GGUF reader reverses the permutation for "llama" alone
# (`TENSOR_PROCESSORS` in modeling_gguf_pytorch_utils.py).
GGUF_QK_PERMUTED = {"llama": True, "qwen2": False, "qwen3": False}


def reverse_rope_permutation(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of q_proj's or k_proj's rows (see GGUF_QK_PERMUTED). Whole
    rows move, so quantized rows (and their scales) move with them unchanged."""
    half = rows.shape[0] // num_heads // 2
    shaped = rows.reshape(num_heads, half, 2, *rows.shape[1:])
    return shaped.transpose(1, 2).reshape(rows.shape)


def gguf_architecture(reader, gguf_path) -> str:
    """The file's `general.architecture`; a ValueError for one whose q/k layout is unknown."""
    field = reader.get_field("general.architecture")
    architecture = None if field is None else field.contents()
    if architecture not in GGUF_QK_PERMUTED:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {architecture!r} is not supported by "
            f"quantization='gguf'; supported: {', '.join(GGUF_QK_PERMUTED)}"
        )
    return architecture


def read_q4_1_linear_weights(gguf_path, num_heads: int, num_kv_heads: int):
    """Hugging Face name -> (q, scale, minimum) of every Q4_1 linear weight in a GGUF file, the
    q and k rows in Hugging Face's order."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(gguf_path))
    qk_permuted = GGUF_QK_PERMUTED[gguf_architecture(reader, gguf_path)]
    weights = {}
    for tensor in reader.tensors:
        block, _, kind = tensor.name.partition(".")[2].partition(".")
        kind = kind.removesuffix(".weight")
        if kind not in GGUF_LINEAR_NAMES or tensor.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        parts = unpack_q4_1(torch.from_numpy(tensor.data.copy()))
        if qk_permuted and kind in ("attn_q", "attn_k"):
            heads = num_heads if kind == "attn_q" else num_kv_heads
            parts = tuple(reverse_rope_permutation(part, heads) for part in parts)
        weights[f"model.layers.{block}.{GGUF_LINEAR_NAMES[kind]}.weight"] = parts
    return weights
