"""Engine checks across chapters 06, 09 and 11: a request id used again right after an abort,
the Triton kernels that warm-up compiles, the flex backend's start-up probe, many compiled
models in one process, and the width of the CUDA-graph inputs."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ENGINE_TEST_FAMILY
from engine_core_calls import engine_is_idle, pool_is_empty
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from minivllm import LLM, SamplingParams
from minivllm.attention import flex_paged
from minivllm.attention.backend import AttentionMetadata
from minivllm.compilation.compiled_model import CompiledModel
from minivllm.compilation.cuda_graphs import CUDAGraphRunner, GraphInputs, bucket_for
from minivllm.config import EngineConfig, ModelConfig, resolve_dtype
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.core_client import MPClient
from minivllm.engine.processor import Processor
from minivllm.models.llama import LlamaForCausalLM
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.utils import cdiv
from minivllm.worker.worker import Worker

HANG_GUARD_S = 60  # a wait that ends long before this, unless something hangs

# --- chapter 09: a request id used again while the core still runs the old request ----------


class SteppedEngine:
    """A fake engine: request number k emits 100 k, 100 k + 1, ... one token a step, three in
    all; its second step waits, once `hold_step_2` is set, until `release` is."""

    def __init__(self) -> None:
        self.processor = Processor(tokenizer=None, vocab_size=1000, max_model_len=1000)
        self.tokenizer = None
        self.max_model_len = 1000
        self.model_path = "fake"
        self.requests: dict[str, tuple[int, list[int]]] = {}  # id -> (first token, tokens)
        self.num_added = 0
        self.num_steps = 0
        self.in_step_2, self.release = threading.Event(), threading.Event()

    def add_request(self, request_id, prompt, params, priority=0) -> None:
        self.num_added += 1
        self.requests[request_id] = (100 * self.num_added, [])

    def abort_request(self, request_ids) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.num_steps == 2:
            self.in_step_2.set()
            self.release.wait(HANG_GUARD_S)
        outputs = []
        for request_id, (first, tokens) in list(self.requests.items()):
            tokens.append(first + len(tokens))
            done = len(tokens) == 3
            reason = "length" if done else None
            completion = CompletionOutput(0, "", list(tokens), finish_reason=reason)
            outputs.append(RequestOutput(request_id, None, [1], [completion], done))
            if done:
                del self.requests[request_id]
        return outputs

    def shutdown(self) -> None:
        pass


def test_a_reused_request_id_gets_none_of_the_aborted_requests_tokens_in_process():
    """The old request is aborted and its id used again while the engine thread is inside a
    step that still holds the old request: the new stream gets its own three tokens only, not
    the old request's token from that step."""
    engine = SteppedEngine()
    llm = AsyncLLM(engine, max_waiting_requests=None)
    params = SamplingParams(max_tokens=3, detokenize=False)

    async def main() -> list[int]:
        old = llm.add_request("r", {"prompt_token_ids": [1]}, params)
        assert (await anext(old)).outputs[0].token_ids == [100]
        await asyncio.to_thread(engine.in_step_2.wait, HANG_GUARD_S)
        old.close()
        new = llm.add_request("r", {"prompt_token_ids": [1]}, params)
        engine.release.set()
        outputs = [output async for output in new]
        assert outputs[-1].finished and outputs[-1].request_id == "r"
        return outputs[-1].outputs[0].token_ids

    try:
        assert asyncio.run(main()) == [200, 201, 202]
    finally:
        engine.release.set()
        llm.shutdown()


# The same over a real engine-core process, which runs the tiny model.
SETTINGS = dict(
    device="cpu", dtype="float32", block_size=4, max_model_len=128, kv_cache_memory_bytes=32 << 20
)


class LateReportClient(MPClient):
    """The engine core in its own process, whose output thread can be told to hold the next
    report that finishes a request, as if it came late, until the test lets it through."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.hold_next = False
        self.holding, self.release, self.taken = (threading.Event() for _ in range(3))

    def hold_next_finishing_report(self) -> None:
        for event in (self.holding, self.release, self.taken):
            event.clear()
        self.hold_next = True

    def _take_report(self, core, report) -> None:
        held = self.hold_next and any(output.finished for output in report.outputs)
        if held:
            self.hold_next = False
            self.holding.set()
            self.release.wait(HANG_GUARD_S)
        super()._take_report(core, report)
        if held:
            self.taken.set()


@pytest.fixture(scope="module")
def late_report_llm(tiny_model_dirs):
    model = str(tiny_model_dirs[ENGINE_TEST_FAMILY])
    llm = AsyncLLM(LateReportClient(EngineConfig(model=model, **SETTINGS)))
    yield llm
    llm.shutdown()


def nothing_runs_or_waits(engine) -> bool:
    """No request is scheduled (an aborted one may still be forgotten in the next step, which
    `engine_is_idle` waits for)."""
    return engine.get_num_unfinished_requests() == 0


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def abort_while_the_last_output_is_late(llm: AsyncLLM, request_id: str) -> None:
    """A one-token request whose only (finishing) report is held on its way to the front end
    while the request is aborted, as a client that leaves at that moment does."""
    llm.client.hold_next_finishing_report()
    old = llm.add_request(request_id, {"prompt_token_ids": [5, 6, 7]}, greedy(1))
    await asyncio.to_thread(llm.client.holding.wait, HANG_GUARD_S)
    old.close()


def test_a_reused_request_id_gets_none_of_the_aborted_requests_tokens_over_processes(
    late_report_llm,
):
    """The old request's last report reaches the front end after its id was used again: the
    new stream gets its own tokens, as many as it asked for, the same as a run of its own."""
    llm = late_report_llm
    prompt = {"prompt_token_ids": [40, 41, 42, 43]}

    async def main() -> tuple[list[int], list[int]]:
        await abort_while_the_last_output_is_late(llm, "r")
        new = llm.add_request("r", prompt, greedy(5))
        llm.client.release.set()
        outputs = [output async for output in new]
        alone = [output async for output in llm.add_request("alone", prompt, greedy(5))]
        return outputs[-1].outputs[0].token_ids, alone[-1].outputs[0].token_ids

    tokens, alone = asyncio.run(main())
    assert len(tokens) == 5 and tokens == alone
    settle(llm)


def test_the_abort_of_a_reused_request_id_reaches_the_core(late_report_llm):
    """The old request's last report reaches MPClient after its id was used again; it must
    not take the new request's route with it: an abort of the new request still reaches its
    core, which then runs nothing."""
    llm = late_report_llm

    async def main() -> None:
        await abort_while_the_last_output_is_late(llm, "s")
        llm.add_request("s", {"prompt_token_ids": [50, 51, 52]}, greedy(100))
        llm.client.release.set()
        # The late report has been taken in; nothing of it has reached the loop yet.
        assert llm.client.taken.wait(HANG_GUARD_S)
        llm.abort("s")

    asyncio.run(main())
    # Calls reach the core after the messages sent before them: the abort, if it was sent.
    assert llm.call_engine(nothing_runs_or_waits)
    settle(llm)


def settle(llm: AsyncLLM) -> None:
    """Once nothing runs, every block of the core's pool is free."""
    deadline = time.monotonic() + HANG_GUARD_S
    while llm.num_open_requests or not llm.call_engine(engine_is_idle):
        assert time.monotonic() < deadline, "requests never finished"
        time.sleep(0.01)
    llm.call_engine(pool_is_empty)


# --- chapter 06: the Triton kernels warm-up compiles are the ones steps launch --------------


def test_warm_up_compiles_every_triton_kernel_a_step_launches():
    """Specializations as Triton's own binder for an sm_90 GPU names them (in a child process
    with Triton's compiler, not its interpreter; nothing runs): every kernel of a real step,
    decodes of tables 1, 3, 16 and 17 blocks wide, prompt chunks cut into odd and even numbers
    of query tiles, is one `warm_up` compiled, so no step stops for a compile."""
    script = Path(__file__).with_name("triton_specializations.py")
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(script)], env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    warmed_up = {(name, tuple(key)) for name, key in report["warm_up"]}
    launched = set()
    for label, keys in report["steps"].items():
        missing = [name for name, key in keys if (name, tuple(key)) not in warmed_up]
        assert not missing, f"{label}: {missing} compiled mid-serving"
        launched |= {name for name, _ in keys}
    assert launched == {
        "_store_kv_kernel",
        "_decode_kernel",
        "_combine_splits_kernel",
        "_prefill_kernel",
    }


# --- chapter 06: the flex backend's start-up probe runs what the engine would ----------------


def test_the_flex_probe_uses_a_block_size_the_engine_takes_on_a_gpu(monkeypatch):
    """The probe's KV blocks are ones the engine accepts on CUDA (a block of 4 tokens is a
    kernel tile no GPU compiles, so a probe with them would always fall back to the torch
    backend there), in the dtype the engine runs in by default. The calls are recorded, not run."""
    probed = []

    def record(q, kv, calls):
        probed.append((q.dtype, kv.dtype, kv.shape[2]))
        return torch.zeros_like(q)

    monkeypatch.setattr(flex_paged, "flex_paged_attention", record)
    assert flex_paged.flex_compiles.__wrapped__("cpu")  # the probe itself, not its cached answer
    assert len(probed) == 2  # a decode and a prompt chunk
    engine_dtype = resolve_dtype("auto", torch.device("cpu"))
    for q_dtype, kv_dtype, block_size in probed:
        flex_paged.check_block_size(block_size, torch.device("cuda"))  # raises if refused
        assert q_dtype == kv_dtype == engine_dtype


def per_step_flex_shapes(num_pool_blocks: int) -> dict[str, tuple[int, ...]]:
    """The shapes of what a decode step of 64 sequences (64 blocks each) makes on the GPU path
    of the flex backend ("meta" tensors: shapes only, and anything but "cpu" takes that path)."""
    meta = torch.device("meta")
    tables = [[(97 * i + j) % num_pool_blocks for j in range(64)] for i in range(64)]
    slots = [16 * table[-1] for table in tables]
    metadata = AttentionMetadata.build([1] * 64, [1024] * 64, tables, slots, device=meta)
    owners = flex_paged.BlockOwnerTable(num_pool_blocks, max_num_seqs=64, device=meta)
    table = owners.update(metadata, 16)  # made once, at warm-up, and kept
    call = flex_paged.build_call(metadata, list(range(64)), num_pool_blocks, 16, 3, table)
    mask = call.block_mask
    made = {
        "rows": call.rows,
        "valid": call.valid,
        "kv_num_blocks": mask.kv_num_blocks,
        "kv_indices": mask.kv_indices,
        "full_kv_num_blocks": mask.full_kv_num_blocks,
        "full_kv_indices": mask.full_kv_indices,
    }
    return {name: tuple(tensor.shape) for name, tensor in made.items()}


def test_a_flex_step_on_a_gpu_makes_nothing_as_large_as_the_pool():
    """On the GPU path a step's block mask lists each sequence's blocks as wide as its widest
    block table, whatever the pool's size (a GPU pool has hundreds of thousands of blocks): the
    same step over pools of 1,000 and 440,000 blocks makes tensors of the same shapes."""
    small, large = per_step_flex_shapes(1_000), per_step_flex_shapes(440_000)
    assert small == large
    assert large["kv_indices"] == (64, 1, 1, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_flex_backend_is_chosen_on_a_gpu():
    """On CUDA the probe compiles, so attention_backend="flex" runs flex, not the fallback."""
    assert flex_paged.flex_compiles.__wrapped__("cuda")  # the probe itself, not a cached answer
    assert (
        flex_paged.FlexPagedAttention.for_device(torch.device("cuda"))
        is flex_paged.FlexPagedAttention
    )


# --- chapter 11: every compiled model has its own graphs ------------------------------------


class EchoAttention:
    """Attention that returns the queries (only the graphs matter here)."""

    def __call__(self, layer_index, q, k, v):
        return q.clone()  # a custom op may not return its input


def tiny_llama(width: int) -> LlamaForCausalLM:
    """A one-layer Llama whose hidden states are 16 x `width` wide, random weights."""
    config = ModelConfig(
        model_type="llama", vocab_size=256, hidden_size=16 * width, intermediate_size=32,
        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8 * width, rms_norm_eps=1e-5,
        max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(width)
    model = LlamaForCausalLM(config)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter.data, std=0.02)
    return model.requires_grad_(False).eval()


def test_ten_compiled_models_of_different_shapes_compile_in_one_process(monkeypatch):
    """Ten models of different widths, each compiled (two graphs apiece: twenty, more than
    the recompile limit of 16) in one process, all compile (dynamo's "eager" backend: its
    tracing and guards, no code generation) and each gives its eager model's hidden states.
    One layer each: tracing costs about a second a graph, whatever the model's size."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    input_ids, positions = torch.tensor([3, 1, 4, 1, 5]), torch.arange(5)
    for width in range(1, 11):
        model = tiny_llama(width)
        compiled = CompiledModel(model)
        compiled.compile(lambda num_tokens: EchoAttention())
        with torch.inference_mode():
            expected = model(input_ids, positions, EchoAttention())
            actual = compiled(input_ids, positions, EchoAttention())
        torch.testing.assert_close(actual, expected)


# --- chapter 11: the CUDA-graph inputs are as wide as the engine's context, filled in part ---


def test_the_graph_block_tables_are_as_wide_as_the_engines_longest_sequence(
    tiny_model_dirs, monkeypatch
):
    """The graphs' block-table buffer holds the engine's longest sequence (here its
    max_model_len of 100 tokens, 7 blocks), not the model's whole context (1024 tokens). The
    path runs on the CPU with the recording left out (it needs a GPU)."""
    monkeypatch.setattr(Worker, "uses_cuda_graphs", property(lambda worker: True))
    monkeypatch.setattr(CUDAGraphRunner, "capture", lambda runner: None)
    llm = LLM(
        model=str(tiny_model_dirs[ENGINE_TEST_FAMILY]),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_model_len=100,
        kv_cache_memory_bytes=8 << 20,
    )
    engine = llm.llm_engine
    inputs = engine.executor.driver_worker.model_runner.cuda_graphs.inputs
    assert engine.model_config.max_model_len == 1024 and engine.max_model_len == 100
    assert inputs.block_tables.shape[1] == cdiv(engine.max_model_len, 16)


class CountElements(TorchDispatchMode):
    """Counts the elements that tensor operations make or write (views are free)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and isinstance(out, torch.Tensor):
            self.count += out.numel()
        return out


def decode_step(tables: list[list[int]]) -> tuple[list[int], ...]:
    """`GraphInputs.fill`'s lists for decodes with these block tables (block size 16)."""
    num_tokens = [16 * len(table) - 3 for table in tables]
    slots = [16 * table[-1] + 12 for table in tables]
    return [1] * len(tables), [n - 1 for n in num_tokens], slots, num_tokens, tables


def elements_a_fill_handles(width: int) -> int:
    inputs = GraphInputs.allocate(16, width, padding_block=999, device="cpu")
    tables = [list(range(10 * i, 10 * i + 5)) for i in range(6)]
    inputs.fill(*decode_step(tables), size=8, block_size=16)
    tables[2] = tables[2] + [500]  # the next step: one table grew by a block
    with CountElements() as counted:
        inputs.fill(*decode_step(tables), size=8, block_size=16)
    return counted.count


def test_a_graph_step_fill_handles_the_columns_in_use_not_the_whole_width():
    """A decode step's fill does the same work whether the buffer holds 64 or 4096 blocks a
    row: what it makes and writes is the step's rows up to its widest table (six blocks) and
    the block that is new, never a row as wide as the model's context."""
    narrow, wide = elements_a_fill_handles(64), elements_a_fill_handles(4096)
    assert narrow == wide
    assert wide < 8 * 64  # less than one copy of the step's rows at the narrow width


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=12), min_size=1, max_size=8),
        min_size=1,
        max_size=6,
    )
)
def test_what_a_graph_step_reads_of_the_block_tables_is_its_own(steps):
    """Steps one after another (tables that grow, shrink, change rows, buckets of 1 to 8): in
    the buffer, each real row begins with its table and each padding row with the padding
    block, which is all the decode kernel reads of them."""
    inputs = GraphInputs.allocate(8, 12, padding_block=99, device="cpu")
    for tables in steps:
        size = bucket_for(len(tables), [1, 2, 4, 8])
        inputs.fill(*decode_step(tables), size=size, block_size=16)
        for row, table in enumerate(tables):
            assert inputs.block_tables[row, : len(table)].tolist() == table
        assert inputs.block_tables[len(tables) : size, 0].tolist() == [99] * (size - len(tables))
