"""Chapter 12 — llama.cpp beside minivllm: batch-1 decode on the same GGUF file.

llama.cpp (through `llama-cpp-python`, `../shared/peers/README.md` style: an optional install,
`pip install llama-cpp-python`) runs the embedded model's Q4_1 file with its own hand-written
CPU kernels: the reference for what 4-bit weights can do at batch 1. It runs in a process of its
own, so that its OpenMP threads and PyTorch's never share one process.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

# Run in the child: load the file, warm up, then time `max_tokens` greedy tokens with the
# end-of-sequence token banned (so every run decodes all of them, like `ignore_eos`).
_CHILD = """
import json, sys, time
from llama_cpp import Llama
path, prompt, max_tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
# verbose=True: llama-cpp-python's quiet mode redirects file descriptors and crashes in some
# environments. n_batch=1: the prompt goes through the decode path one token at a time (some
# native builds crash on batched prompt kernels); only decode is timed, so it costs nothing.
llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_batch=1, n_ubatch=1, verbose=True)
no_eos = {llm.token_eos(): -100.0}


def seconds_for(tokens):
    llm.reset()
    start = time.perf_counter()
    out = llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, logit_bias=no_eos)
    assert out["usage"]["completion_tokens"] == tokens
    return time.perf_counter() - start


seconds_for(4)  # warm-up
one, many = seconds_for(1), seconds_for(max_tokens)
print(json.dumps({"tokens": max_tokens - 1, "seconds": many - one}))
"""


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llamacpp_decode_tokens_per_s(
    gguf_path: str | Path, prompt: str, max_tokens: int = 128, threads: int = 2
) -> float:
    """Decode tokens per second of one greedy request: the time of `max_tokens` tokens less the
    time of one (the prompt and the first token), over `max_tokens - 1`."""
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(gguf_path), prompt, str(max_tokens), str(threads)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"llama.cpp failed:\n{result.stderr[-2000:]}")
    timing = json.loads(result.stdout.strip().splitlines()[-1])
    return timing["tokens"] / timing["seconds"]
