"""The bench helpers that time for the notebooks and gpu_bench go through bench/measure.py: the
matmul peak is the fastest way's median, the memory bandwidth a median, the attention backends
interleaved within each case of a sweep. The harness is replaced by a fake that returns known
rounds, so every expected number is exact."""

from __future__ import annotations

import pytest
import torch

from minivllm.bench import attention, benchmark, roofline
from minivllm.bench.measure import Timings


def fake_rounds(seconds_of: dict[str, list[float]], calls: list[dict]):
    """An `interleaved` that records what it was asked to time and returns `seconds_of`'s
    rounds for each method (the methods themselves are not run)."""

    def interleaved(runs, repeats=5, warmups=1, prepare=None, synchronize=lambda: None):
        calls.append({"methods": list(runs), "repeats": repeats, "warmups": warmups})
        return Timings({name: list(seconds_of[name]) for name in runs})

    return interleaved


def test_the_matmul_peak_is_the_fastest_ways_median(monkeypatch):
    calls = []
    rounds = {
        "torch.mm": [1.0, 9.0, 2.0, 2.0, 2.0],  # median 2.0, best 1.0
        "linear": [1.5, 1.5, 1.5, 1.5, 1.5],  # median 1.5: the fastest way
        "linear, packed": [1.6, 1.6, 1.6, 1.6, 1.6],
    }
    monkeypatch.setattr(benchmark, "interleaved", fake_rounds(rounds, calls))
    monkeypatch.setattr(benchmark, "_MATMUL_PEAKS", {})
    size = 16
    peak = benchmark.measure_matmul_peak(torch.float32, "cpu", size)
    assert peak == pytest.approx(2 * size**3 / 1.5)
    assert len(calls) == 1 and calls[0]["repeats"] >= 5 and calls[0]["warmups"] >= 1
    assert calls[0]["methods"][:2] == ["torch.mm", "linear"]  # the ways, interleaved
    assert benchmark.measure_matmul_peak(torch.float32, "cpu", size) == peak
    assert len(calls) == 1  # measured once per process: every MFU divides by the same peak


def test_the_memory_bandwidth_is_the_median_of_its_rounds(monkeypatch):
    calls = []
    monkeypatch.setattr(roofline, "interleaved", fake_rounds({"copy": [4.0, 1.0, 2.0]}, calls))
    bandwidth = roofline.measure_memory_bandwidth(megabytes=1, repeats=3)
    assert bandwidth == pytest.approx(2 * 2**20 / 2.0)  # read + write, over the median
    assert calls == [{"methods": ["copy"], "repeats": 3, "warmups": 1}]


def test_a_sweep_interleaves_the_backends_within_each_case(monkeypatch, tiny_models):
    calls = []
    backends = ["torch", "flex"]
    rounds = {"torch": [3.0, 1.0, 2.0], "flex": [1.0, 1.0, 4.0]}
    monkeypatch.setattr(attention, "interleaved", fake_rounds(rounds, calls))
    config = tiny_models("llama")[0].config
    timings = attention.decode_attention_timings(
        config, backends, [1, 2], [16, 32], torch.float32, "cpu", repeats=3
    )
    assert [call["methods"] for call in calls] == [backends] * 4  # one call per case
    assert all(call["repeats"] == 3 and call["warmups"] == 1 for call in calls)
    assert list(timings) == [(1, 16), (1, 32), (2, 16), (2, 32)]
    assert timings[2, 32].spread("torch").median == 2.0
    assert timings[2, 32].speedup("flex", "torch").values == (3.0, 1.0, 0.5)  # round by round


def test_one_attention_step_really_runs_and_is_timed(tiny_models):
    """The harness for real, on the torch backend: a round per repeat, each a positive time."""
    config = tiny_models("llama")[0].config
    pool = attention.one_layer_pool(config, 2, 32, 16, torch.float32, "cpu")
    step = attention.random_decode_step(config, pool, 2, 32)
    timings = attention.attention_step_timings(["torch"], pool, step, 2, repeats=3, warmups=0)
    assert len(timings.seconds["torch"]) == 3 and min(timings.seconds["torch"]) > 0
