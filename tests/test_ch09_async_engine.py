"""Chapter 09: the async engine. Outputs stream while the engine thread steps, many requests
share the steps, a consumer that stops early aborts its request, and an overloaded or stopped
engine refuses work with a clear error."""

from __future__ import annotations

import asyncio

import pytest
from conftest import ENGINE_TEST_FAMILY, assert_pool_is_empty

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError

SETTINGS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs[ENGINE_TEST_FAMILY]


@pytest.fixture(scope="module")
def async_llm(model_dir):
    llm = AsyncLLM.from_config(EngineConfig(model=str(model_dir), **SETTINGS))
    yield llm
    llm.shutdown()


def settle(llm: AsyncLLM) -> None:
    """Wait for the aborts to land, then check every block is back."""

    async def wait():
        while llm.num_open_requests or llm.call_engine(lambda e: e.has_unfinished_requests()):
            await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(wait(), 30))
    llm.call_engine(assert_pool_is_empty)


def test_concurrent_streams_equal_llm_generate(async_llm, model_dir):
    """Eight requests at once: each stream grows one token at a time and ends with what
    LLM.generate returns for the same prompt."""
    prompts = [{"prompt_token_ids": list(range(10 + i, 20 + 2 * i))} for i in range(8)]
    expected = LLM(model=str(model_dir), **SETTINGS).generate(prompts, GREEDY, use_tqdm=False)

    async def collect(index: int) -> list:
        return [o async for o in async_llm.generate(prompts[index], GREEDY, f"r{index}")]

    async def run_all():
        return await asyncio.gather(*(collect(i) for i in range(8)))

    for outputs, reference in zip(asyncio.run(run_all()), expected):
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == list(range(1, 11))
        assert [o.finished for o in outputs] == [False] * 9 + [True]
        assert outputs[-1].outputs[0].token_ids == reference.outputs[0].token_ids
    settle(async_llm)


def test_a_consumer_that_stops_aborts_its_request(async_llm):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def take_two():
        stream = async_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, "early")
        outputs = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return outputs

    outputs = asyncio.run(take_two())
    assert not outputs[-1].finished
    settle(async_llm)


def test_bad_requests_and_overload_are_refused_up_front(async_llm):
    async def add(prompt, params=GREEDY, request_id="bad"):
        return async_llm.add_request(request_id, prompt, params)

    with pytest.raises(ValueError, match="context"):
        asyncio.run(add({"prompt_token_ids": list(range(10, 200))}))
    async_llm.max_waiting_requests = 0
    try:
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
            asyncio.run(add("Hello"))
    finally:
        async_llm.max_waiting_requests = 1024
    settle(async_llm)


def test_shutdown_ends_open_streams(model_dir):
    llm = AsyncLLM.from_config(EngineConfig(model=str(model_dir), **SETTINGS))
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def read_while_shutting_down():
        stream = llm.add_request("r", "Hello", params)
        await anext(stream)
        await asyncio.to_thread(llm.shutdown)
        return [output async for output in stream]

    with pytest.raises(EngineDeadError):
        asyncio.run(read_while_shutting_down())

    async def add_after_shutdown():
        return llm.add_request("s", "Hi", params)

    with pytest.raises(EngineDeadError):
        asyncio.run(add_after_shutdown())
