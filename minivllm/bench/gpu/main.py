"""The run: every chapter's measurement in turn (the smoke first), each in isolation, and the
command line of `python -m minivllm.bench.gpu` (and of scripts/gpu_bench.py, `make gpu-bench`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import minivllm.bench.gpu
from minivllm.bench.benchmark import device_label
from minivllm.bench.gpu.ch00_logits import measure_logits
from minivllm.bench.gpu.ch01_naive_cost import measure_naive_cost
from minivllm.bench.gpu.ch01b_sampler_cost import measure_sampler_cost
from minivllm.bench.gpu.ch02_kv_cache import measure_kv_cache
from minivllm.bench.gpu.ch03_memory_waste import measure_memory_waste
from minivllm.bench.gpu.ch04_throughput import measure_throughput
from minivllm.bench.gpu.ch05_prefix_cache import measure_prefix_cache
from minivllm.bench.gpu.ch06_attention_kernels import measure_attention_kernels
from minivllm.bench.gpu.ch07_parallelism import measure_parallelism
from minivllm.bench.gpu.ch08_speculative_decoding import measure_speculative_decoding
from minivllm.bench.gpu.ch09_serving import measure_serving
from minivllm.bench.gpu.ch10_structured_outputs import measure_structured_outputs
from minivllm.bench.gpu.ch11_compiled_step import measure_compiled_step
from minivllm.bench.gpu.ch12_quantization import measure_quantization
from minivllm.bench.gpu.common import Run, chapter_number, device_slug, free_memory, load_run, save
from minivllm.bench.gpu.smoke import measure_smoke
from minivllm.bench.gpu_results import GPU_RESULTS_DIR
from minivllm.bench.measure import stopwatch

# Chapter number -> its measurement, in the order they run: the smoke first, so that a branch
# broken on this machine is named before the chapters that use it.
CHAPTERS = {
    "smoke": measure_smoke,
    "00": measure_logits,
    "01": measure_naive_cost,
    "01b": measure_sampler_cost,
    "02": measure_kv_cache,
    "03": measure_memory_waste,
    "04": measure_throughput,
    "05": measure_prefix_cache,
    "06": measure_attention_kernels,
    "07": measure_parallelism,
    "08": measure_speculative_decoding,
    "09": measure_serving,
    "10": measure_structured_outputs,
    "11": measure_compiled_step,
    "12": measure_quantization,
}


def run_chapter(run: Run, number: str, out_dir: Path) -> bool:
    """Measure one chapter and save it; on any error, write NN.error.json (the error and its
    traceback) instead, free what the chapter held, and go on: one chapter's failure must not
    cost the others' measurements. A chapter that saved its record with failures in it (the
    smoke's failing branches) fails too. Returns whether it succeeded."""
    try:
        # A chapter's duration is a one-off: its stopwatch stops, error or not, when it ends.
        with stopwatch() as watch:
            chapter = CHAPTERS[number](run)
        save(run, chapter, out_dir, watch.seconds)
    except Exception as error:  # noqa: BLE001 -- recorded, and the run goes on
        record = dict(
            chapter=chapter_number(number),
            device=device_label(),
            error=f"{type(error).__name__}: {error}",
            traceback=traceback.format_exc(),
            seconds=watch.seconds,
        )
        (out_dir / f"{number}.error.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"== chapter {number} FAILED: {record['error']}\n", file=sys.stderr)
        plt.close("all")
        free_memory()
        return False
    print(f"== {chapter.stem}: {watch.seconds:.1f} s\n")
    for failure in chapter.failures:
        print(f"== {chapter.stem} FAILED: {failure}", file=sys.stderr)
    return not chapter.failures


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=minivllm.bench.gpu.__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny model and sizes, any device (a check, not a measurement)",
    )
    parser.add_argument(
        "--chapters",
        default=",".join(CHAPTERS),
        help="comma-separated chapter numbers to measure, smoke included (default: all)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"where results go, in a folder per device (default: {GPU_RESULTS_DIR}; "
        "with --quick, a temporary directory)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Measure every chapter (or those of --chapters), each in isolation; returns the folder
    the files went to, or exits with status 1 naming the chapters that failed."""
    args = parse_args(argv)
    numbers = args.chapters.split(",")
    unknown = [number for number in numbers if number not in CHAPTERS]
    if unknown:
        raise SystemExit(f"no chapter {unknown} in the GPU bench; it measures {list(CHAPTERS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        raise SystemExit(
            "the GPU bench measures on a CUDA GPU and found none. On a CPU the notebooks' full "
            "mode is the measurement (make notebooks); --quick checks the bench at tiny sizes."
        )
    out = args.out or (
        Path(tempfile.mkdtemp(prefix="gpu-bench-")) if args.quick else GPU_RESULTS_DIR
    )
    out_dir = out / device_slug()
    out_dir.mkdir(parents=True, exist_ok=True)
    plt.switch_backend("agg")  # figures go to files only
    torch.manual_seed(0)
    # The tiny model's directory must outlive the run: every engine loads the model from it.
    with stopwatch() as watch, tempfile.TemporaryDirectory(prefix="minivllm-tiny-") as scratch:
        run = load_run(args.quick, device, Path(scratch))
        print(f"{device_label()}, {run.model_name}, {run.model.dtype}; results in {out_dir}")
        failed = [number for number in numbers if not run_chapter(run, number, out_dir)]
    print(f"{len(numbers)} chapters in {watch.seconds:.0f} s: {out_dir}")
    if failed:
        raise SystemExit(
            f"chapters {failed} failed: see their NN.error.json, or the failing branches in "
            f"smoke.json, in {out_dir}"
        )
    return out_dir
