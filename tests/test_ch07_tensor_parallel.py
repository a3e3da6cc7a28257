"""Chapter 07 checks: a model split over N processes generates what the whole model generates.

The embedded model (9 query heads, 3 KV heads) runs at TP=3, one KV head per rank, and its
greedy tokens equal TP=1's and transformers'. Tiny models shaped for TP=2 (4 query heads with 2
KV heads, and with 1 KV head, copied onto both ranks; one with q/k/v biases) give TP=1's tokens
with prefix caching, chunked prefill, preemption and seeded sampling. Processes are the other
half of the lesson: nothing survives a shutdown, a dead worker is an error within seconds, a
Ctrl-C leaves no orphans, a bad size is refused before anything starts, and two "machines"
(two launches joined over loopback, as torchrun does) are one engine.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import assert_pool_is_empty

from minivllm import LLM, SamplingParams
from minivllm.executor.multiproc import free_port
from minivllm.models.tiny import make_tiny_model

TINY_PROMPTS = [
    {"prompt_token_ids": [5, 17, 300, 2048, 77, 9]},
    {"prompt_token_ids": list(range(40, 75))},  # several blocks: chunked, and a prefix below
    {"prompt_token_ids": list(range(40, 60)) + [900, 901]},  # shares 20 tokens with the one above
]


def token_ids(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def worker_pids(llm: LLM) -> list[int]:
    return [process.pid for process in llm.llm_engine.executor.state.processes]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, embedded_dir) -> dict:
    """Untied tiny models (their tokens depend on the whole context) shaped for TP=2."""

    def make(name, family, **overrides):
        out = tmp_path_factory.mktemp(name)
        return make_tiny_model(family, out, seed=1, tokenizer_dir=embedded_dir, **overrides)

    return {
        "2 KV heads": make("kv2", "mistral"),
        "1 KV head, copied": make("kv1", "mistral", num_key_value_heads=1),
        "q/k/v bias": make("bias", "qwen2"),
    }


def test_embedded_model_at_tp3_gives_transformers_greedy_tokens(chat_prompts, transformers_greedy):
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompts[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm = LLM(tensor_parallel_size=3)
    try:
        split = token_ids(llm.generate(prompts, params, use_tqdm=False))
        assert_pool_is_empty(llm.llm_engine)
    finally:
        pids = worker_pids(llm)
        del llm
        gc.collect()
    whole = token_ids(LLM().generate(prompts, params, use_tqdm=False))
    expected = [transformers_greedy(ids, 8) for ids in chat_prompts[:2]]
    assert split == whole == expected
    assert not any(alive(pid) for pid in pids), "a worker outlived its engine"


@pytest.mark.parametrize("shape", ["2 KV heads", "1 KV head, copied", "q/k/v bias"])
def test_tp2_equals_tp1_with_chunks_prefix_hits_and_seeds(tiny_dirs, shape):
    model = tiny_dirs[shape]
    # A 16-token budget chunks the long prompts over steps; the shared prefix hits the cache.
    settings = dict(block_size=4, max_num_batched_tokens=16, enable_prefix_caching=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = [SamplingParams(temperature=1.0, seed=seed, max_tokens=10) for seed in (1, 2, 3)]

    def run(tp_size: int):
        llm = LLM(model, tensor_parallel_size=tp_size, **settings)
        try:
            outputs = token_ids(llm.generate(TINY_PROMPTS, greedy, use_tqdm=False))
            sampled = token_ids(llm.generate(TINY_PROMPTS, seeded, use_tqdm=False))
            metrics = {m.name: m.value for m in llm.get_metrics()}
            assert_pool_is_empty(llm.llm_engine)
            return outputs, sampled, metrics
        finally:
            del llm
            gc.collect()

    whole, whole_sampled, _ = run(1)
    split, split_sampled, metrics = run(2)
    assert split == whole
    assert split_sampled == whole_sampled
    assert metrics["vllm:prefix_cache_hits"] > 0


def test_tp2_preempts_and_recomputes_like_tp1(tiny_dirs):
    """The same tiny pool on every rank: both engines preempt, and the tokens agree."""
    model = tiny_dirs["2 KV heads"]
    # 2 KV heads x 16 dims x 2 layers x K and V x float32 = 512 bytes a token at TP=1; a rank of
    # TP=2 holds one KV head, 256 bytes. 10 blocks of 4 tokens either way.
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 112 + 7 * i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    results = {}
    for tp_size, bytes_per_token in ((1, 512), (2, 256)):
        llm = LLM(
            model,
            tensor_parallel_size=tp_size,
            block_size=4,
            kv_cache_memory_bytes=10 * 4 * bytes_per_token,
            enable_prefix_caching=False,
        )
        try:
            outputs = token_ids(llm.generate(prompts, params, use_tqdm=False))
            preemptions = {m.name: m.value for m in llm.get_metrics()}["vllm:num_preemptions"]
            results[tp_size] = (outputs, preemptions)
            assert_pool_is_empty(llm.llm_engine)
        finally:
            del llm
            gc.collect()
    assert results[1][1] > 0 and results[2][1] > 0, "the pool was meant to be too small"
    assert results[2][0] == results[1][0]


def test_bad_sizes_are_refused_before_any_process_starts(tiny_dirs):
    import multiprocessing

    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not fit"):
        LLM(tensor_parallel_size=2)  # the embedded model: 9 query heads
    for bad in (0, -1):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            LLM(tiny_dirs["2 KV heads"], tensor_parallel_size=bad)
    assert multiprocessing.active_children() == before


def test_a_busy_rendezvous_port_is_a_clear_error(tiny_dirs, monkeypatch):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(RuntimeError, match="MASTER_PORT=.* is in use"):
            LLM(tiny_dirs["2 KV heads"], tensor_parallel_size=2)


def test_a_worker_that_dies_mid_generation_is_an_error_within_seconds(tiny_dirs):
    llm = LLM(tiny_dirs["2 KV heads"], tensor_parallel_size=2)
    pid = worker_pids(llm)[0]
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    outcome = {}
    engine_generate = llm.generate

    def generate():
        try:
            engine_generate([{"prompt_token_ids": [5, 6, 7]}] * 4, params, use_tqdm=False)
            outcome["error"] = None
        except RuntimeError as error:
            outcome["error"] = error

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=60)  # a watchdog, not a speed check: a hang fails here
    assert not thread.is_alive(), "the engine hung after its worker died"
    assert outcome["error"] is not None, "generation finished despite the dead worker"
    message = str(outcome["error"])
    assert "minivllm-tp-rank1" in message and "died" in message
    with pytest.raises(RuntimeError, match="create a new LLM"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    del llm
    gc.collect()
    assert not alive(pid)


def test_a_worker_that_dies_between_steps_is_seen_at_once_without_a_collective(
    tiny_dirs, monkeypatch
):
    """The watcher wakes on the dead process's sentinel, with no step running: the executor is
    marked broken and its collectives aborted (what unblocks a rank 0 waiting in NCCL; on gloo
    it is a no-op, so the call is recorded here), and the next generate fails before it sends
    anything to the dead rank."""
    from minivllm.executor import multiproc

    aborted = threading.Event()
    monkeypatch.setattr(multiproc, "abort_collectives", aborted.set)
    llm = LLM(tiny_dirs["2 KV heads"], tensor_parallel_size=2)
    state = llm.llm_engine.executor.state
    pid = worker_pids(llm)[0]
    os.kill(pid, signal.SIGKILL)
    assert aborted.wait(timeout=30), "the watcher did not notice the dead worker"
    assert [process.pid for process in state.dead_workers] == [pid] and state.broken
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(RuntimeError, match="minivllm-tp-rank1.*died"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert state.closed  # the other ranks were stopped


def test_a_normal_shutdown_does_not_trip_the_watcher(tiny_dirs, monkeypatch):
    from minivllm.executor import multiproc

    aborted = threading.Event()
    monkeypatch.setattr(multiproc, "abort_collectives", aborted.set)
    llm = LLM(tiny_dirs["2 KV heads"], tensor_parallel_size=2)
    state = llm.llm_engine.executor.state
    processes = list(state.processes)
    llm.llm_engine.executor.shutdown()
    for process in processes:
        process.join(timeout=10)
    time.sleep(0.5)  # the watcher thread wakes on the exits it has just seen
    assert not aborted.is_set() and not state.dead_workers


def test_rank_0_uses_its_share_of_the_cores_only_while_it_computes(tiny_dirs):
    """torch's thread count belongs to the whole process: rank 0 computes on its fair share of
    the cores, and any other engine of the process (TP=1 beside TP=2 in one benchmark) keeps the
    count it had, before, between and after the tensor-parallel engine's steps."""
    import torch

    from minivllm.executor.multiproc import fair_share_of_threads

    share = fair_share_of_threads(2)
    before = torch.get_num_threads()
    torch.set_num_threads(share + 1)  # a count rank 0 must not leave behind, on any machine
    try:
        llm = LLM(tiny_dirs["2 KV heads"], tensor_parallel_size=2)
        assert torch.get_num_threads() == share + 1
        driver = llm.llm_engine.executor.driver_worker
        seen = []
        execute_model = driver.execute_model

        def recording(*args):
            seen.append(torch.get_num_threads())
            return execute_model(*args)

        driver.execute_model = recording
        llm.generate(TINY_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3))
        assert seen and set(seen) == {share}
        assert torch.get_num_threads() == share + 1
        llm.llm_engine.executor.shutdown()
        assert torch.get_num_threads() == share + 1
    finally:
        torch.set_num_threads(before)


# A process a terminal starts has SIGINT at its default; one a test runner's process starts
# inherits that process's disposition, and a SIGINT some earlier test left ignored stays ignored
# across exec (Python then installs no KeyboardInterrupt handler: three Ctrl-Cs 10 s apart were
# seen to do nothing). The script starts as a terminal's would.
CTRL_C_SCRIPT = """
import signal
import sys
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
from minivllm import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2)
print(*[p.pid for p in llm.llm_engine.executor.state.processes], flush=True)
params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 16, params, use_tqdm=False)
print("finished", flush=True)  # too early: 16 x 1000 tokens take far longer than a second
"""


def test_ctrl_c_leaves_no_worker_behind(tiny_dirs):
    """Ctrl-C in a terminal sends SIGINT to every process of the foreground group; the engine
    stops, and its workers with it."""
    script = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_SCRIPT, str(tiny_dirs["2 KV heads"])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal would give it
    )
    pids = [int(pid) for pid in script.stdout.readline().split()]
    assert pids, script.stderr.read()
    time.sleep(1.0)  # mid-generation
    os.killpg(script.pid, signal.SIGINT)
    script.wait(timeout=60)
    stdout, stderr = script.stdout.read(), script.stderr.read()
    assert "KeyboardInterrupt" in stderr, (script.returncode, stdout, stderr)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids), "a worker outlived Ctrl-C"


def test_two_machines_over_loopback_are_one_engine(tiny_dirs):
    """What torchrun does across machines, on one: two launches of the same command, one per
    "node", meeting at MASTER_ADDR:MASTER_PORT. Rank 0 is the engine; rank 1 serves it."""
    model = tiny_dirs["2 KV heads"]
    prompt = "The capital of France is"
    command = [sys.executable, "-m", "minivllm", "generate", prompt, "--model", str(model)]
    command += ["--tensor-parallel-size", "2", "--max-tokens", "10"]
    port = str(free_port())
    nodes = []
    for rank in (0, 1):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0")
        nodes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
    outputs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0]
    expected = LLM(model).generate(prompt, SamplingParams(temperature=0.0, max_tokens=10))
    assert outputs[0].strip() == expected[0].outputs[0].text.strip()
    assert outputs[1] == ""  # a worker rank prints nothing: the engine's output is rank 0's


def test_ranks_count_gpus_on_from_the_engines_device():
    from minivllm.config import EngineConfig
    from minivllm.executor.multiproc import rank_config

    assert rank_config(EngineConfig(device="cuda"), 1).device == "cuda:1"
    assert rank_config(EngineConfig(device="cuda:2"), 1).device == "cuda:3"
    assert rank_config(EngineConfig(device="cpu"), 1).device == "cpu"


def test_a_worker_makes_its_gpu_current_before_loading_the_model(monkeypatch, tmp_path):
    """A rank on cuda:3 makes cuda:3 its process's current device first: Triton launches and
    NCCL bind to the current device, not to where tensors live. No GPU here, so the two CUDA
    calls are replaced by recorders: set_device, and the model load that would follow it."""
    import torch

    from minivllm.config import EngineConfig
    from minivllm.worker import worker as worker_module

    calls = []

    class Loaded(Exception):
        """Stops the worker where the real one would start filling the GPU."""

    def load_model(path, dtype, device, tp, quantization=None):
        calls.append(("load_model", device))
        raise Loaded

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(worker_module, "load_model", load_model)
    config = EngineConfig(device="cuda:3", dtype="float32", attention_backend="torch")
    with pytest.raises(Loaded):
        worker_module.Worker(config, tmp_path)
    cuda_3 = torch.device("cuda:3")
    assert calls == [("set_device", cuda_3), ("load_model", cuda_3)]
    calls.clear()
    with pytest.raises(Loaded):
        worker_module.Worker(EngineConfig(device="cpu"), tmp_path)
    assert calls == [("load_model", torch.device("cpu"))]  # nothing to bind on the CPU
