"""The command line: `minivllm generate | chat | serve | bench | bench serve | tour` (also
`python -m minivllm`).

The engine flags are derived from `EngineConfig` (config.py), in vLLM's spelling
(`--max-num-seqs`, `--no-enable-prefix-caching`, ...), so a vLLM user feels at home.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing

from minivllm.bench.workloads import WORKLOAD_NAMES
from minivllm.config import EngineConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # minivllm never reads the network


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per field of EngineConfig, spelled as vLLM's command line spells it:
    `max_num_seqs` -> `--max-num-seqs`; a bool gets `--X` and `--no-X`."""
    types = typing.get_type_hints(EngineConfig)
    for item in dataclasses.fields(EngineConfig):
        flag = "--" + item.name.replace("_", "-")
        kind = types[item.name]
        options = {"default": item.default, "help": item.metadata["help"]}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = next(t for t in (int, float, str) if _admits(kind, t))
            options["choices"] = item.metadata["choices"]
        parser.add_argument(flag, **options)


def _admits(annotation, python_type: type) -> bool:
    """Whether a field's type (e.g. `int | None`) takes values of `python_type`."""
    return annotation is python_type or python_type in typing.get_args(annotation)


def engine_settings(args: argparse.Namespace) -> dict:
    """The EngineConfig fields out of parsed arguments."""
    return {item.name: getattr(args, item.name) for item in dataclasses.fields(EngineConfig)}


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=128)


def _make_llm(args):
    from minivllm import LLM

    return LLM(**engine_settings(args))


def _sampling_params(args):
    from minivllm import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens
    )


def cmd_generate(args) -> None:
    llm = _make_llm(args)
    for output in llm.generate(args.prompt, _sampling_params(args), use_tqdm=False):
        print(output.outputs[0].text)


def cmd_chat(args) -> None:
    """An interactive conversation; the whole history is sent every turn."""
    llm = _make_llm(args)
    params = _sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Chat with the model; an empty line or Ctrl-D quits.")
    while True:
        try:
            user = input("you> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        answer = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(f"model> {answer}")
        messages.append({"role": "assistant", "content": answer})


def cmd_bench(args) -> None:
    from minivllm.bench.benchmark import (
        BenchmarkContext,
        device_label,
        format_table,
        run_benchmark,
        write_json,
    )
    from minivllm.bench.workloads import make_workload
    from minivllm.config import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    ctx = BenchmarkContext.load(args.model, dtype, batch_size=args.batch_size, device=device)
    settings = engine_settings(args)
    ctx.engine_args = {
        name: value for name, value in settings.items() if name not in ("model", "dtype", "device")
    }
    workload = make_workload(args.workload, ctx.tokenizer, args.num_requests, args.output_len)
    print(f"workload: {workload.description}; {device_label()}; dtype: {dtype}")
    results = run_benchmark(
        ctx, workload, args.methods.split(","), repeats=args.repeats, warmups=args.warmups
    )
    print(format_table(results, baseline=args.baseline))
    if args.json:
        write_json(args.json, workload, results, dtype=str(dtype))


def cmd_serve(args) -> None:
    from minivllm.engine.async_llm import EngineDeadError
    from minivllm.entrypoints.openai.api_server import ServerSettings, run_server

    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_request_bytes=args.max_request_bytes,
        max_waiting_requests=args.max_waiting_requests,
        generation_config=args.generation_config,
        engine_core_process=args.engine_core_process,
    )
    try:
        run_server(EngineConfig.from_kwargs(**engine_settings(args)), settings)
    except EngineDeadError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


def cmd_bench_serve(args) -> None:
    import json

    from minivllm.bench.serve import bench_serve, format_results, split_per_rate
    from minivllm.bench.workloads import throughput_workload
    from minivllm.models.loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(args.model))
    rates, n = args.request_rate, args.num_prompts
    # Prompts of its own for every rate: none finds an earlier rate's in the prefix cache.
    workload = throughput_workload(tokenizer, n * len(rates), output_length=args.max_tokens)
    print(f"workload: {workload.description}, {n} per rate; server: {args.base_url}")
    results = bench_serve(
        args.base_url,
        split_per_rate(workload.prompts, len(rates)),
        rates,
        max_tokens=args.max_tokens,
        max_seconds=args.max_seconds,
        model=args.served_model_name,
        api_key=args.api_key,
    )
    print(format_results(results))
    if args.json:
        with open(args.json, "w") as file:
            json.dump([result.as_dict() for result in results], file, indent=2)


def cmd_tour(args) -> None:
    from minivllm.bench.tour import run_tour

    run_tour(quick=args.quick)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete prompts")
    generate.add_argument("prompt", nargs="+")
    add_engine_args(generate)
    _add_sampling_args(generate)
    generate.set_defaults(func=cmd_generate)

    chat = commands.add_parser("chat", help="talk to the model")
    chat.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept remote clients")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: its dir)"
    )
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20)
    serve.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="requests that may wait for their first token; more are refused with 503",
    )
    serve.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for fields a request leaves out: 'auto' reads the model's "
        "generation_config.json, 'vllm' ignores it, or a folder holding one",
    )
    serve.add_argument(
        "--engine-core-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in a process of its own (vLLM's default); "
        "--no-engine-core-process steps it in a thread of the server's process",
    )
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    bench = commands.add_parser("bench", help="compare generation methods side by side")
    add_engine_args(bench)
    bench.add_argument(
        "--workload",
        default="throughput",
        choices=WORKLOAD_NAMES,
    )
    bench.add_argument(
        "--num-requests", type=int, default=None, help="requests (default 64, long-context 8)"
    )
    bench.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="new tokens per request (throughput, long-context: 64; shared-prefix, multi-turn: 16)",
    )
    bench.add_argument(
        "--methods",
        default="hf,hf-static,static,engine",
        help="comma-separated, from: hf, hf-static, hf-cb, naive, kv-cache, static, "
        "engine-no-prefix-cache, engine; ':N' sets a batch size (hf-cb: a token budget), "
        "'@bfloat16' a dtype, e.g. hf-static:64,engine,engine@bfloat16",
    )
    bench.add_argument("--baseline", default=None, help="method the speedups are relative to")
    bench.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed rounds, every method once a round, interleaved (5 to judge a difference)",
    )
    bench.add_argument("--warmups", type=int, default=0, help="untimed rounds before them")
    bench.add_argument("--batch-size", type=int, default=16, help="rows per static batch")
    bench.add_argument("--json", default=None, help="also write the results here")
    bench.set_defaults(func=cmd_bench)
    bench_commands = bench.add_subparsers(dest="bench_command", required=False)
    bench_serve = bench_commands.add_parser(
        "serve", help="latency and throughput of a running server under Poisson arrivals"
    )
    bench_serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    bench_serve.add_argument(
        "--request-rate", type=float, nargs="+", default=[1.0, 4.0], help="requests/s (inf: all)"
    )
    bench_serve.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    bench_serve.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    bench_serve.add_argument("--max-seconds", type=float, default=60.0, help="per request rate")
    bench_serve.add_argument(
        "--model", default=None, help="the model directory whose tokenizer builds the prompts"
    )
    bench_serve.add_argument("--served-model-name", default=None)
    bench_serve.add_argument("--api-key", default=None)
    bench_serve.add_argument("--json", default=None, help="also write the results here")
    bench_serve.set_defaults(func=cmd_bench_serve)

    tour = commands.add_parser("tour", help="a chat answer, then each chapter's speedup")
    tour.add_argument("--quick", action="store_true", help="a smaller workload")
    tour.set_defaults(func=cmd_tour)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
