"""Chapter 02's cost model: the FLOPs and bytes of a decode step, and where it stops being
memory-bound."""

from __future__ import annotations

import pytest
import torch

from minivllm.bench.benchmark import model_flops
from minivllm.bench.roofline import (
    Machine,
    StepCost,
    decode_step_cost,
    intensity_limit,
    measure_memory_bandwidth,
    ridge_batch_size,
    weight_count,
)


def test_decode_flops_agree_with_the_workload_count(tiny_models):
    """A decode step's FLOPs are what `model_flops` adds for the next token of each sequence:
    one more token fed (its position is `context`, it meets context + 1 keys, counting itself)
    and one more token sampled."""
    config = tiny_models("llama")[0].config
    context, batch = 9, 3
    before = model_flops(config, [context] * batch, [1] * batch)
    after = model_flops(config, [context] * batch, [2] * batch)
    step = decode_step_cost(config, torch.float32, batch, context + 1)
    assert step.flops == after - before


def test_decode_bytes_are_weights_once_plus_each_rows_cache(tiny_models):
    config = tiny_models("llama")[0].config
    layer_weights, head_weights = weight_count(config)
    one = decode_step_cost(config, torch.float32, 1, 100)
    eight = decode_step_cost(config, torch.float32, 8, 100)
    assert one.bytes == 4 * (layer_weights + head_weights) + 100 * config.kv_bytes_per_token(
        torch.float32
    )
    assert eight.bytes - one.bytes == 7 * 100 * config.kv_bytes_per_token(torch.float32)
    assert eight.intensity > one.intensity  # the weights are shared by more rows
    bf16 = decode_step_cost(config, torch.bfloat16, 1, 100)
    assert bf16.bytes == one.bytes / 2 and bf16.flops == one.flops


def test_roofline_takes_the_slower_of_compute_and_memory():
    machine = Machine("toy", peak_flops=100.0, bandwidth=10.0)
    assert machine.ridge_intensity == 10.0
    assert StepCost(flops=50.0, bytes=20.0).seconds_on(machine) == 2.0  # memory-bound
    assert StepCost(flops=500.0, bytes=20.0).seconds_on(machine) == 5.0  # compute-bound


def test_at_the_ridge_batch_size_compute_and_memory_take_equally_long(tiny_models):
    config = tiny_models("llama")[0].config
    machine = Machine("toy", peak_flops=1e12, bandwidth=1e10)
    batch = ridge_batch_size(config, torch.float32, 16, machine)
    assert batch is not None and batch > 1
    # Costs are linear in the batch size, so evaluate them at the fractional ridge by parts.
    low, high = (decode_step_cost(config, torch.float32, b, 16) for b in (1, 2))
    flops = low.flops + (batch - 1) * (high.flops - low.flops)
    moved = low.bytes + (batch - 1) * (high.bytes - low.bytes)
    assert flops / machine.peak_flops == pytest.approx(moved / machine.bandwidth)


def test_no_ridge_when_the_cache_grows_as_fast_as_the_flops(tiny_models):
    """A batch's intensity levels off at FLOPs per row over K/V bytes per row; a machine whose
    ridge lies above that limit is never reached, however many rows."""
    config = tiny_models("llama")[0].config
    limit = intensity_limit(config, torch.float32, 10_000)
    assert decode_step_cost(config, torch.float32, 10**6, 10_000).intensity == pytest.approx(
        limit, rel=1e-3
    )
    starved = Machine("toy", peak_flops=limit * 2e9, bandwidth=1e9)  # ridge at twice the limit
    assert ridge_batch_size(config, torch.float32, 10_000, starved) is None
    reachable = Machine("toy", peak_flops=limit * 0.5e9, bandwidth=1e9)
    assert ridge_batch_size(config, torch.float32, 10_000, reachable) is not None


def test_memory_bandwidth_is_measured_positive_and_finite():
    bandwidth = measure_memory_bandwidth(megabytes=16, repeats=2)
    assert 1e8 < bandwidth < 1e13  # between 0.1 GB/s and 10 TB/s
