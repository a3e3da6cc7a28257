"""Chapter 11's step profile: every step of a run is timed, phase by phase, on the engine's own
methods, and the engine is left as it was."""

from __future__ import annotations

from conftest import ENGINE_TEST_FAMILY, assert_pool_is_empty

from minivllm import LLM, SamplingParams
from minivllm.bench.step_profile import PHASES, profile_steps


def steps_without_profiling(llm, prompts, params) -> int:
    engine = llm.llm_engine
    for request_id, (prompt, request_params) in enumerate(zip(prompts, params)):
        engine.add_request(f"plain-{request_id}", prompt, request_params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps


def test_every_step_is_timed_and_the_engine_is_left_as_it_was(tiny_model_dirs):
    # No prefix cache: the profiled run and the plain one take the same steps.
    llm = LLM(str(tiny_model_dirs[ENGINE_TEST_FAMILY]), enable_prefix_caching=False)
    engine = llm.llm_engine
    runner = engine.executor.driver_worker.model_runner
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 11, 20)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 7, 4)]
    times = profile_steps(llm, prompts, params)
    assert times.num_steps == steps_without_profiling(llm, prompts, params)
    assert set(times.seconds) == set(PHASES)
    assert all(seconds >= 0 for seconds in times.seconds.values())
    assert times.seconds["forward"] > 0 and times.seconds["sample"] > 0
    for obj, names in (
        (engine.scheduler, ["schedule"]),
        (runner, ["execute_model", "run_forward", "sampler"]),
        (runner.model, ["compute_logits"]),
    ):
        patched = [name for name in names if name in vars(obj) and name != "sampler"]
        assert not patched, patched
    assert type(runner.sampler).__name__ == "Sampler"
    assert_pool_is_empty(engine)
    again = llm.generate(prompts, params, use_tqdm=False)  # still a working engine
    assert [len(o.outputs[0].token_ids) for o in again] == [2, 7, 4]
