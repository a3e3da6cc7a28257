"""Chapter 07 checks, part 3: data parallelism changes where requests run, never what comes out.

- end to end, one engine (data_parallel_size=1) is the oracle for two replicas: greedy and
  seeded tokens are equal, outputs come back in input order, and both replicas did some work;
- the router is a pure function, checked directly: lowest `4 * waiting + running` wins, ties go
  to the replica that has the prompt's prefix cached, then to the lowest index;
- the processes: a bad setting or an over-long prompt fails in the front end, an error in a
  replica comes back as the same exception, a replica killed mid-generation is a RuntimeError
  (not a hang), and nothing outlives the `LLM` (del, Ctrl-C, interpreter exit).

End-to-end checks run the tiny *mistral* model (conftest's ENGINE_TEST_FAMILY): its untied
output head makes greedy tokens depend on the whole context. Each replica is a fresh Python
process (a few seconds to start), so the tests share one two-replica `LLM` where they can.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import ENGINE_TEST_FAMILY
from hypothesis import given
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.core.prefix_cache import hash_blocks
from minivllm.engine.data_parallel import (
    DataParallelEngine,
    PrefixAffinity,
    aggregate_metrics,
    choose_replica,
    load_score,
    picklable_error,
)
from minivllm.engine.llm_engine import Metric

# Small pools start fast; 4 MiB holds 8192 tokens of the tiny model.
SETTINGS = dict(kv_cache_memory_bytes=1 << 22, max_num_seqs=4, seed=0)
PROMPTS = [{"prompt_token_ids": list(range(10 + n, 10 + 2 * n))} for n in (7, 1, 30, 4, 12, 40)]
GREEDY = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 9, 3, 12)]
GREEDY = [GREEDY[i % len(GREEDY)] for i in range(len(PROMPTS))]
SEEDED = [
    SamplingParams(temperature=1.0, seed=100 + i, max_tokens=8, ignore_eos=True)
    for i in range(len(PROMPTS))
]
WATCHDOG_S = 30  # a hang fails the test after this long (a guard, not a speed requirement)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def is_gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for a parent that is not us to reap it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.split() == ["State:", "Z", "(zombie)"] for line in status)
    except FileNotFoundError:
        return True


def wait_until_gone(pids: list[int], timeout: float = WATCHDOG_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(is_gone(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def replica_pids(llm: LLM) -> list[int]:
    return [replica.process.pid for replica in llm.llm_engine.replicas]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return str(tiny_model_dirs[ENGINE_TEST_FAMILY])


@pytest.fixture(scope="module")
def one(model_dir):
    return LLM(model=model_dir, **SETTINGS)


@pytest.fixture(scope="module")
def two(model_dir):
    llm = LLM(model=model_dir, data_parallel_size=2, **SETTINGS)
    yield llm
    llm.llm_engine.shutdown()


# --- the router -------------------------------------------------------------------------------


def test_the_lowest_score_wins_and_waiting_counts_four_times():
    assert load_score(waiting=1, running=0) == 4 and load_score(waiting=0, running=3) == 3
    assert choose_replica([(1, 0), (0, 3)]) == 1  # 4 > 3: three running beat one waiting
    assert choose_replica([(1, 0), (0, 5)]) == 0
    assert choose_replica([(2, 2), (1, 1), (3, 0)]) == 1


def test_ties_go_to_the_prefix_owner_then_to_the_lowest_index():
    assert choose_replica([(0, 4), (1, 0), (0, 4)], preferred=2) == 2
    assert choose_replica([(0, 4), (1, 0), (0, 4)], preferred=None) == 0
    # Affinity never beats load: the preferred replica must be among the least loaded.
    assert choose_replica([(0, 1), (0, 2)], preferred=1) == 0


@given(
    loads=st.lists(
        st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=8
    ).flatmap(lambda loads: st.tuples(st.just(loads), st.none() | st.integers(0, len(loads) - 1)))
)
def test_the_router_picks_a_least_loaded_replica(loads):
    loads, preferred = loads
    chosen = choose_replica(loads, preferred)
    scores = [4 * waiting + running for waiting, running in loads]
    assert scores[chosen] == min(scores)
    if preferred is not None and scores[preferred] == min(scores):
        assert chosen == preferred
    else:
        assert chosen == scores.index(min(scores))


def test_affinity_prefers_the_replica_with_the_longest_known_prefix():
    affinity = PrefixAffinity(block_size=4)
    system, question = [1, 2, 3, 4], [5, 6, 7, 8]
    assert affinity.preferred_replica(hash_blocks(system + question, 4)) is None
    affinity.remember(hash_blocks(system + question, 4), replica=1)
    affinity.remember(hash_blocks(system + [9, 9, 9, 9], 4), replica=0)
    # Both replicas saw the system block (replica 0 last), only replica 1 saw the question.
    assert affinity.preferred_replica(hash_blocks(system + question + [0, 0, 0, 0], 4)) == 1
    assert affinity.preferred_replica(hash_blocks(system + [7, 7, 7, 7], 4)) == 0
    assert affinity.preferred_replica(hash_blocks([1, 2, 3], 4)) is None  # no full block
    salted = hash_blocks(system + question, 4, cache_salt="other user")
    assert affinity.preferred_replica(salted) is None


def test_affinity_forgets_the_least_recent_blocks_first():
    affinity = PrefixAffinity(block_size=1, capacity=2)
    affinity.remember(hash_blocks([1], 1), replica=0)
    affinity.remember(hash_blocks([2], 1), replica=1)
    affinity.remember(hash_blocks([1], 1), replica=0)  # [1] is recent again
    affinity.remember(hash_blocks([3], 1), replica=1)  # evicts [2]
    assert affinity.preferred_replica(hash_blocks([2], 1)) is None
    assert affinity.preferred_replica(hash_blocks([1], 1)) == 0


def test_metrics_add_counts_and_average_rates():
    def replica(usage, running, tokens):
        return [
            Metric("vllm:kv_cache_usage_perc", "gauge", usage, ""),
            Metric("vllm:num_requests_running", "gauge", running, ""),
            Metric("vllm:prompt_tokens", "counter", tokens, ""),
        ]

    combined = aggregate_metrics([replica(0.2, 3, 100), replica(0.4, 1, 50)])
    assert [(m.name, m.value) for m in combined] == [
        ("vllm:kv_cache_usage_perc", pytest.approx(0.3)),
        ("vllm:num_requests_running", 4),
        ("vllm:prompt_tokens", 150),
    ]


@pytest.mark.parametrize(
    "name",
    [
        "vllm:num_requests_waiting",
        "minivllm:kv_cache_bytes",
        "minivllm:kv_cache_touched_bytes",
    ],
)
def test_request_counts_and_pool_bytes_are_summed_over_replicas(name):
    """Gauges that count things (requests, bytes) add up; each metric keeps its kind and
    description, and one that only some replicas report is combined from those."""
    combined = aggregate_metrics(
        [
            [Metric(name, "gauge", 3, "what it counts")],
            [Metric(name, "gauge", 5, "what it counts"), Metric("only_here", "counter", 2, "x")],
        ]
    )
    assert combined == [
        Metric(name, "gauge", 8, "what it counts"),
        Metric("only_here", "counter", 2, "x"),
    ]


class UnpicklableError(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.lock = threading.Lock()  # pickling refuses a lock


def test_an_error_that_cannot_travel_becomes_its_text():
    """A replica's (or the engine core's) exception crosses a pipe pickled: one that pickles
    travels as itself; one that does not becomes a RuntimeError naming its type and message."""
    travels = ValueError("bad prompt")
    assert picklable_error(travels) is travels
    replaced = picklable_error(UnpicklableError("a lock inside"))
    assert type(replaced) is RuntimeError
    assert str(replaced) == "UnpicklableError: a lock inside"


# --- the same tokens as one engine ------------------------------------------------------------


def test_two_replicas_give_one_engines_greedy_tokens_in_input_order(one, two):
    expected = one.generate(PROMPTS, GREEDY, use_tqdm=False)
    outputs = two.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert isinstance(two.llm_engine, DataParallelEngine)
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in PROMPTS]
    assert token_ids(outputs) == token_ids(expected)
    assert all(o.finished for o in outputs)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(PROMPTS)


def test_seeded_sampling_is_the_same_on_any_replica(one, two):
    expected = one.generate(PROMPTS, SEEDED, use_tqdm=False)
    assert token_ids(two.generate(PROMPTS, SEEDED, use_tqdm=False)) == token_ids(expected)
    n_params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    alone = one.generate("Once upon a time", n_params, use_tqdm=False)
    assert token_ids(two.generate("Once upon a time", n_params, use_tqdm=False)) == token_ids(alone)


def test_the_embedded_model_gives_the_same_text_on_two_replicas(embedded_dir):
    settings = dict(max_model_len=256, kv_cache_memory_bytes=1 << 26)
    prompts = ["Hi!", "What is the capital of France?", "Write a haiku about the sea.", "2+2="]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = LLM(**settings).generate(prompts, params, use_tqdm=False)
    llm = LLM(data_parallel_size=2, **settings)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.shutdown()
    assert token_ids(outputs) == token_ids(expected)
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in expected]


def test_both_replicas_serve_and_metrics_add_up(two):
    two.generate(PROMPTS, GREEDY, use_tqdm=False)
    per_replica = two.llm_engine.get_replica_metrics()
    prompt_tokens = [
        next(m.value for m in metrics if m.name == "vllm:prompt_tokens") for metrics in per_replica
    ]
    assert len(prompt_tokens) == 2 and all(tokens > 0 for tokens in prompt_tokens)
    total = next(m.value for m in two.get_metrics() if m.name == "vllm:prompt_tokens")
    assert total == sum(prompt_tokens)
    assert two.llm_engine.get_num_unfinished_requests() == 0


def test_a_new_engine_sends_a_shared_prefix_where_it_is_cached(model_dir):
    """Between equally idle replicas, a prompt goes where its prefix was last served, so it
    finds it cached (the lowest index would have missed it). An engine of its own: what its
    constructor sets up (the replicas' processes, the router's affinity) is what is checked.
    Each replica is a fresh interpreter (spawned), not a daemon (it may start tensor-parallel
    workers, which a daemon may not), named by its index."""
    llm = LLM(model=model_dir, data_parallel_size=2, **SETTINGS)
    try:
        for replica in llm.llm_engine.replicas:
            assert replica.process.name == f"minivllm-dp-replica-{replica.index}"
            assert replica.process.daemon is False
            assert isinstance(replica.process, multiprocessing.context.SpawnProcess)
        system = list(range(500, 532))  # two full blocks of 16
        params = SamplingParams(temperature=0.0, max_tokens=2)
        llm.generate(
            [{"prompt_token_ids": list(range(700, 740))}, {"prompt_token_ids": system + [1, 2]}],
            params,
            use_tqdm=False,
        )  # the first prompt took replica 0, so the system prompt went to replica 1
        follow_up = llm.generate({"prompt_token_ids": system + [3, 4]}, params, use_tqdm=False)[0]
        assert follow_up.num_cached_tokens == 32
    finally:
        llm.llm_engine.shutdown()


def test_an_overlong_prompt_is_refused_in_the_front_end_and_the_engine_goes_on(two):
    too_long = {"prompt_token_ids": [5] * two.max_model_len}
    with pytest.raises(ValueError, match="context"):
        two.generate([PROMPTS[0], too_long], GREEDY[0], use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        two.generate(PROMPTS[0], SamplingParams(max_tokens=two.max_model_len), use_tqdm=False)
    assert not two.llm_engine.has_unfinished_requests()
    assert len(two.generate(PROMPTS[:3], GREEDY[:3], use_tqdm=False)) == 3


# --- processes: errors, crashes, cleanup ------------------------------------------------------


def test_a_bad_setting_fails_before_any_process_starts(model_dir):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(model=model_dir, data_parallel_size=0)
    assert set(multiprocessing.active_children()) == before


def test_a_replica_startup_error_is_raised_as_itself_and_leaves_no_process(model_dir):
    """A pool too small for one block fails inside each replica's worker; the front end
    raises the same ValueError as a single engine would."""
    with pytest.raises(ValueError) as single:
        LLM(model=model_dir, kv_cache_memory_bytes=1)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError) as replicated:
        LLM(model=model_dir, kv_cache_memory_bytes=1, data_parallel_size=2)
    assert str(replicated.value) == str(single.value)
    assert set(multiprocessing.active_children()) == before


def run_with_watchdog(function):
    """Run `function` in a thread; (finished, its exception). A hang reports finished=False
    instead of hanging the test session."""
    result = {}

    def target():
        try:
            function()
        except BaseException as error:
            result["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(WATCHDOG_S)
    return not thread.is_alive(), result.get("error")


def step_hook(llm: LLM, on_call: int, action) -> None:
    """Make the engine run `action` just before its `on_call`-th step (mid-generation)."""
    engine = llm.llm_engine
    step, calls = engine.step, [0]

    def hooked_step():
        calls[0] += 1
        if calls[0] == on_call:
            action()
        return step()

    engine.step = hooked_step


def test_after_ctrl_c_and_a_replica_error_del_leaves_no_process(model_dir):
    """Ctrl-C mid-generation aborts what is left and the engine goes on; an exception in a
    replica is a RuntimeError naming it; `del llm` then stops every replica."""
    llm = LLM(model=model_dir, data_parallel_size=2, **SETTINGS)
    pids = replica_pids(llm)
    long_params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

    def interrupt():
        raise KeyboardInterrupt

    step_hook(llm, on_call=3, action=interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, long_params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    del llm.llm_engine.step  # the hook; the engine keeps working after the interrupt
    assert len(llm.generate(PROMPTS[:2], GREEDY[:2], use_tqdm=False)) == 2
    # An exception inside a replica ends it, and comes back as a RuntimeError naming it.
    with pytest.raises(RuntimeError, match="replica 0 failed: AttributeError"):
        llm.llm_engine.call_all("no_such_method")

    del llm
    gc.collect()
    assert wait_until_gone(pids)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]


def test_a_dead_replica_is_a_runtime_error_and_a_lost_front_end_stops_a_replica(model_dir):
    """A replica killed mid-generation makes generate raise (it does not hang). A replica whose
    pipe to the front end closes, as it does when the front end's process dies, exits alone."""
    llm = LLM(model=model_dir, data_parallel_size=2, **SETTINGS)
    first, second = (replica.process for replica in llm.llm_engine.replicas)
    step_hook(llm, on_call=3, action=lambda: os.kill(second.pid, signal.SIGKILL))
    long_params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    finished, error = run_with_watchdog(lambda: llm.generate(PROMPTS, long_params, use_tqdm=False))
    assert finished, f"generate did not notice the dead replica within {WATCHDOG_S} s"
    assert isinstance(error, RuntimeError)
    assert "replica 1" in str(error) and str(-signal.SIGKILL) in str(error)

    llm.llm_engine.replicas[0].conn.close()
    first.join(WATCHDOG_S)
    assert first.exitcode == 0, "the replica did not stop when its front end went away"
    llm.llm_engine.shutdown()
    assert wait_until_gone([first.pid, second.pid])


EXITING_SCRIPT = """
import sys
from minivllm import LLM

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], data_parallel_size=2, kv_cache_memory_bytes=1 << 22)
    print(*[r.process.pid for r in llm.llm_engine.replicas], flush=True)
"""


def test_no_replica_outlives_the_interpreter(model_dir, tmp_path):
    """A script that ends without shutting its LLM down exits promptly (the replicas are not
    daemons: multiprocessing would wait for them forever) and leaves no replica behind."""
    script = tmp_path / "front_end.py"
    script.write_text(textwrap.dedent(EXITING_SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script), model_dir], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2
    assert wait_until_gone(pids)


def test_replicas_get_gpus_of_their_own_and_share_the_cpu():
    from minivllm.config import EngineConfig
    from minivllm.engine.data_parallel import replica_device

    gpus = EngineConfig(device="cuda", tensor_parallel_size=2, data_parallel_size=2)
    assert [replica_device(gpus, i).device for i in range(2)] == ["cuda:0", "cuda:2"]
    assert replica_device(EngineConfig(device="cuda:1"), 1).device == "cuda:2"
    assert replica_device(EngineConfig(device="cpu"), 1).device == "cpu"
