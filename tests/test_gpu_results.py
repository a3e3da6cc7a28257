"""The notebooks' GPU sections: `load_gpu_results` finds the records `make gpu-bench` writes,
leaves out quick runs, and finds nothing where nothing was measured; the throughput and latency
plots are drawn with labelled axes. The records here are fakes written by `write_json`, as the
GPU bench writes them."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from minivllm.bench.benchmark import MethodResult, write_json
from minivllm.bench.gpu_results import (
    load_gpu_results,
    plot_gpu_throughput,
    plot_latency_against_throughput,
    plot_throughput,
    record_title,
)
from minivllm.bench.workloads import Workload

WORKLOAD = Workload(
    name="varied-output",
    prompts=[[1, 2, 3], [4, 5]],
    output_lengths=[4, 8],
    description="2 chat requests, prompts 2-3 tokens, outputs 4-8 tokens",
)


def result(method: str, label: str, seconds: float) -> MethodResult:
    return MethodResult(
        method=method,
        label=label,
        chapter=4,
        seconds=seconds,
        num_requests=2,
        prompt_tokens=5,
        output_tokens=12,
        same_tokens_as_first=1.0,
    )


RESULTS = [
    result("static:16", "static batching (ch02) [16]", 2.0),
    result("engine-no-prefix-cache", "continuous batching, no prefix cache (ch04)", 1.0),
    result("engine-no-prefix-cache@bfloat16", "continuous batching bf16", 0.5),
]


def write_record(root: Path, device: str, stem: str, quick: bool) -> Path:
    """A record as the GPU bench's `save` writes it: write_json's and the common extra keys."""
    path = root / device / f"{stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(
        path,
        WORKLOAD,
        RESULTS,
        chapter=int(stem[:2]),
        model="SmolLM2-135M-Instruct",
        dtype="float32",
        quick=quick,
        seconds=12.5,
        seats=16,
    )
    return path


def test_finds_the_chapter_records_and_skips_quick_ones(tmp_path):
    written = write_record(tmp_path, "nvidia-h200", "04-throughput", quick=False)
    write_record(tmp_path, "nvidia-a100", "04-throughput", quick=True)  # a plumbing check
    write_record(tmp_path, "nvidia-h200", "05-prefix-cache", quick=False)  # another chapter

    records = load_gpu_results("04", tmp_path)

    assert len(records) == 1
    record = records[0]
    assert record["path"] == str(written)
    assert record["chapter"] == 4 and record["quick"] is False and record["seats"] == 16
    assert [r["method"] for r in record["results"]] == [r.method for r in RESULTS]
    assert record["results"][0]["output_tokens_per_s"] == 6.0


def test_records_of_several_devices_come_sorted_by_device(tmp_path):
    for device in ("nvidia-h200", "nvidia-a100"):
        write_record(tmp_path, device, "04-throughput", quick=False)
    paths = [Path(r["path"]).parent.name for r in load_gpu_results("04", tmp_path)]
    assert paths == ["nvidia-a100", "nvidia-h200"]


def test_nothing_measured_is_an_empty_list(tmp_path):
    assert load_gpu_results("04", tmp_path) == []  # an empty folder
    assert load_gpu_results("04", tmp_path / "absent") == []  # no folder at all
    write_record(tmp_path, "nvidia-h200", "01-cost-vs-length", quick=False)
    assert load_gpu_results("01b", tmp_path) == []  # 01b is not chapter 01


def test_the_throughput_plot_has_labelled_axes_and_a_descriptive_title(tmp_path):
    write_record(tmp_path, "nvidia-h200", "04-throughput", quick=False)
    (record,) = load_gpu_results("04", tmp_path)

    figure = plot_gpu_throughput(record, baseline="static:16")

    (ax,) = figure.axes
    assert ax.get_xlabel() == "output tokens per second"
    assert ax.get_ylabel() == "method"
    title = ax.get_title()
    for part in ("float32", "varied-output", WORKLOAD.description, record["device"]):
        assert part in title
    assert title == record_title(record)
    assert len(ax.patches) == len(RESULTS)
    labels = [text.get_text() for text in ax.texts]
    assert labels[0].strip() == "6 tok/s, 1.00x" and labels[-1].strip() == "24 tok/s, 4.00x"
    plt.close(figure)


def test_results_measured_here_draw_on_a_given_axis():
    """A notebook's own `MethodResult`s, next to a GPU record's, on axes it made."""
    figure, (here, gpu) = plt.subplots(1, 2)
    assert plot_throughput(RESULTS, "this machine", ax=here) is figure
    assert here.get_title() == "this machine" and here.get_xlabel() == "output tokens per second"
    assert not gpu.patches  # the other axis is left alone
    plt.close(figure)


def serving_rate(rate: float, throughput: float, ttft_p50: float) -> dict:
    """One request rate of a chapter 09 record, as `ServeBenchResult.as_dict()` gives it."""
    latencies = {"p50": ttft_p50, "p90": 2 * ttft_p50, "p99": 3 * ttft_p50}
    return dict(request_rate=rate, output_throughput=throughput, ttft_ms=latencies)


def test_the_latency_plot_draws_p50_and_p99_against_throughput_with_labelled_axes():
    rates = [serving_rate(4.0, 100.0, 20.0), serving_rate(float("inf"), 300.0, 200.0)]
    figure, ax = plt.subplots()

    plot_latency_against_throughput(ax, rates, "ttft_ms", "a GPU")

    p50, p99 = ax.lines
    assert list(p50.get_xdata()) == list(p99.get_xdata()) == [100.0, 300.0]
    assert list(p50.get_ydata()) == [20.0, 200.0] and list(p99.get_ydata()) == [60.0, 600.0]
    assert p50.get_label() == "a GPU" and p50.get_color() == p99.get_color()
    assert ax.get_xlabel() == "output throughput achieved (tokens/s)"
    assert ax.get_ylabel().startswith("TTFT (ms)")
    assert [text.get_text() for text in ax.texts] == ["4/s", "all at once"]
    plt.close(figure)
