"""Chapter 12 — llama.cpp beside minivllm: the same GGUF file, one more method of the benchmark.

llama.cpp (through `llama-cpp-python`, an optional install: `pip install llama-cpp-python`,
which builds llama.cpp for this CPU) runs the embedded model's Q4_1 file with its own
hand-written CPU kernels: the reference for what 4-bit weights can do at batch 1. Like vLLM
(`vllm_peer.py`) it runs in a process of its own, so that its OpenMP threads and PyTorch's never
share one process, and it is a method of `minivllm bench` (`--methods engine:int4@bfloat16,
llamacpp`): it loads the file once (untimed), then answers each request with the token ids of
a greedy decode of exactly the asked length, the benchmark's clock running around it, prompt
included, as for every other method. llama.cpp decodes one sequence at a time here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from minivllm.bench.vllm_peer import MARK, PeerProcess

# Run by our own interpreter (llama-cpp-python installs beside minivllm). Greedy: top-k 1,
# nothing else reshaping the distribution; the end-of-sequence token banned, so that every
# request decodes its whole length (our engines' `ignore_eos`).
PEER_SCRIPT = f"""
import json, sys
MARK = {MARK!r}


def answer(**fields):
    print(MARK + json.dumps(fields), flush=True)


from llama_cpp import Llama

settings = json.loads(sys.stdin.readline())
llm = Llama(**settings)
eos = llm.token_eos()


def without_eos(input_ids, scores):
    scores[eos] = -float("inf")
    return scores


def greedy(prompt, length):
    llm.reset()
    tokens = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                              repeat_penalty=1.0, logits_processor=[without_eos]):
        tokens.append(token)
        if len(tokens) == length:
            return tokens


greedy([1, 2, 3, 4], 2)  # warm-up
answer(ready=True)
for line in sys.stdin:
    command = json.loads(line)
    answer(token_ids=[greedy(p, n) for p, n in zip(command["prompts"], command["output_lengths"])])
"""


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppPeer(PeerProcess):
    """llama.cpp's `Llama` on a GGUF file in its own process, loaded and warmed up."""

    name = "llama.cpp"

    def __init__(self, gguf_path: str | Path, context_tokens: int, threads: int):
        if not llamacpp_available():
            raise ValueError(
                "the llamacpp benchmark method needs llama-cpp-python: "
                "CMAKE_ARGS='-DGGML_NATIVE=ON' pip install llama-cpp-python"
            )
        # verbose: llama-cpp-python's quiet mode redirects file descriptors, which fails in
        # some environments; what it prints goes to the peer's log.
        settings = dict(
            model_path=str(gguf_path), n_ctx=context_tokens, n_threads=threads, verbose=True
        )
        super().__init__(Path(sys.executable), PEER_SCRIPT, dict(os.environ), settings)

    def generate(self, prompts: list[list[int]], output_lengths: list[int]) -> list[list[int]]:
        """Greedy tokens of each prompt, exactly its output length (EOS banned)."""
        self._send(dict(prompts=prompts, output_lengths=output_lengths))
        return self._receive()["token_ids"]
