"""Chapter 02's cost model: the FLOPs and bytes of one decode step, and the roofline they meet.

A decode step of a batch of B sequences multiplies every weight with B rows and reads every
weight once, whatever B is. Its **arithmetic intensity**, FLOPs per byte moved, therefore grows
with B:

    FLOPs(B)  ≈ 2 · weights · B  +  4 · q_size · layers · context · B      (products, attention)
    bytes(B)  ≈ weights · bytes_per_weight  +  B · context · kv_bytes_per_token   (reads)

A machine does at most `peak` FLOP/s and moves at most `bandwidth` bytes/s, so a step takes at
least max(FLOPs / peak, bytes / bandwidth): the **roofline**. While FLOPs/bytes is below
peak / bandwidth (the machine's *ridge point*) the step is memory-bound and adding rows is
nearly free; above it, compute-bound. `ridge_batch_size` predicts where decode crosses over.

The CPU's numbers are measured (`measure_matmul_peak`, `measure_memory_bandwidth`); a GPU's can
be taken from its spec sheet (`DATACENTER_GPU`), labelled as such.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.bench.measure import interleaved, synchronize
from minivllm.config import ModelConfig
from minivllm.models.quantization import INT4_GROUP_SIZE


@dataclass
class Machine:
    """The two numbers a roofline needs."""

    name: str
    peak_flops: float  # FLOP/s of the best matrix product
    bandwidth: float  # bytes/s of main memory (HBM on a GPU)

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte at which compute and memory take equally long."""
        return self.peak_flops / self.bandwidth


# NVIDIA H100 SXM, from its spec sheet (dense bfloat16 tensor-core peak, HBM3 bandwidth).
DATACENTER_GPU = Machine("H100 SXM (spec sheet, bf16)", peak_flops=989e12, bandwidth=3.35e12)


@dataclass
class StepCost:
    """FLOPs and bytes of one decode step."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    def seconds_on(self, machine: Machine) -> float:
        """The roofline's prediction: whichever of compute and memory takes longer."""
        return max(self.flops / machine.peak_flops, self.bytes / machine.bandwidth)


def weight_count(config: ModelConfig) -> tuple[int, int]:
    """(weights of the linear layers, weights of the LM head): what a decode step multiplies."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    hidden = config.hidden_size
    per_layer = (
        hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * config.intermediate_size
    )
    return config.num_layers * per_layer, hidden * config.vocab_size


def weight_bytes(config: ModelConfig, dtype: torch.dtype, quantization: str | None = None) -> float:
    """Bytes a decode step reads for the weights it multiplies, stored as `quantization` stores
    them (chapter 12; None: in `dtype`). int8: 1 byte a weight (the one scale per row, under
    0.2% more, left out); int4 and gguf: half a byte a weight plus each group's scale and zero
    in `dtype`; the LM head in int8 whenever the layers are quantized."""
    layer_weights, head_weights = weight_count(config)
    element = torch.empty((), dtype=dtype).element_size()
    if quantization is None:
        return float((layer_weights + head_weights) * element)
    per_layer_weight = {"int8": 1.0, "int4": 0.5 + 2 * element / INT4_GROUP_SIZE}
    per_layer_weight["gguf"] = per_layer_weight["int4"]  # Q4_1's blocks of 32, the same layout
    return layer_weights * per_layer_weight[quantization] + head_weights * 1.0


def decode_step_cost(
    config: ModelConfig,
    dtype: torch.dtype,
    batch_size: int,
    context_length: int,
    quantization: str | None = None,
) -> StepCost:
    """One decode step of `batch_size` sequences whose new token attends over `context_length`
    keys each (the cached tokens and its own), with the weights stored as `quantization` stores
    them (`weight_bytes`).

    FLOPs: 2 per weight per row (layers and LM head), and attention's 4 per head dimension per
    cached token (QK^T and PV). Bytes: every weight read once, and every sequence's cached K and
    V read once; activations are small next to both and are left out.
    """
    layer_weights, head_weights = weight_count(config)
    q_size = config.num_heads * config.head_dim
    flops = 2 * (layer_weights + head_weights) * batch_size
    flops += 4 * q_size * config.num_layers * context_length * batch_size
    weight_bytes_read = weight_bytes(config, dtype, quantization)
    kv_bytes = batch_size * context_length * config.kv_bytes_per_token(dtype)
    return StepCost(flops=float(flops), bytes=float(weight_bytes_read + kv_bytes))


def _per_row_and_fixed(
    config: ModelConfig, dtype: torch.dtype, context_length: int
) -> tuple[float, float, float]:
    """(FLOPs per row, bytes per row, bytes that do not depend on the rows): costs are linear
    in the batch size, so two batch sizes give all three."""
    one, two = (decode_step_cost(config, dtype, b, context_length) for b in (1, 2))
    flops_per_row, bytes_per_row = two.flops - one.flops, two.bytes - one.bytes
    return flops_per_row, bytes_per_row, one.bytes - bytes_per_row


def intensity_limit(config: ModelConfig, dtype: torch.dtype, context_length: int) -> float:
    """The intensity a decode step approaches as the batch grows: the weights' bytes are shared
    by ever more rows, but each row still reads its own K/V, so FLOPs per byte level off at
    (FLOPs per row) / (K/V bytes per row)."""
    flops_per_row, bytes_per_row, _ = _per_row_and_fixed(config, dtype, context_length)
    return flops_per_row / bytes_per_row


def ridge_batch_size(
    config: ModelConfig, dtype: torch.dtype, context_length: int, machine: Machine
) -> float | None:
    """The batch size at which a decode step stops being memory-bound on `machine` (where its
    intensity reaches the ridge point); None if it never does: when `intensity_limit` is below
    the ridge, no batch is large enough."""
    flops_per_row, bytes_per_row, fixed_bytes = _per_row_and_fixed(config, dtype, context_length)
    # flops_per_row * B = ridge * (fixed_bytes + bytes_per_row * B), solved for B.
    room = flops_per_row - machine.ridge_intensity * bytes_per_row
    if room <= 0:
        return None
    return machine.ridge_intensity * fixed_bytes / room


def measure_memory_bandwidth(
    device: torch.device | str = "cpu", megabytes: int = 512, repeats: int = 5
) -> float:
    """Bytes per second of a large copy (read + write), the median of `repeats` rounds after
    one warm-up (`bench/measure.py`): the bandwidth a decode step's weight reads can hope for."""
    source = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    timings = interleaved(
        {"copy": lambda: target.copy_(source)}, repeats, synchronize=lambda: synchronize(device)
    )
    seconds = timings.spread("copy").median
    return 2 * source.numel() * source.element_size() / seconds
