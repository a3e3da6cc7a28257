"""The seams the engine is built around: a step crosses from the scheduler to the model runner
as plain data, settings are declared once, attention backends come from a registry, and modules
depend downward. These are the properties that let the runner move to another process.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import pickle
import re
from pathlib import Path

import pytest
import torch
from conftest import ENGINE_TEST_FAMILY

from minivllm.attention.backend import ATTENTION_BACKENDS, get_attention_backend
from minivllm.config import ATTENTION_BACKEND_NAMES, EngineConfig
from minivllm.core.scheduler_output import SchedulerOutput
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.cli import build_parser
from minivllm.outputs import ModelRunnerOutput
from minivllm.sample.sampling_params import SamplingParams
from minivllm.worker.worker import Worker

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "minivllm"


# --- the step as plain data -----------------------------------------------------------------


def recording_engine(model_dir, **settings) -> tuple[LLMEngine, list[tuple[bytes, bytes]]]:
    """An engine whose every step is pickled on its way to the runner and back."""
    config = EngineConfig(
        model=str(model_dir), dtype="float32", device="cpu", block_size=4, **settings
    )
    engine = LLMEngine(config)
    pickles: list[tuple[bytes, bytes]] = []
    execute = engine.executor.execute_model

    def execute_through_pickles(scheduler_output):
        sent = pickle.dumps(scheduler_output)
        runner_output = execute(pickle.loads(sent))
        pickles.append((sent, pickle.dumps(runner_output)))
        return pickle.loads(pickles[-1][1])

    engine.executor.execute_model = execute_through_pickles
    return engine, pickles


def mixed_requests(engine: LLMEngine) -> None:
    """Greedy and seeded requests, logprobs, n > 1, a shared prefix and a long prompt."""
    shared = list(range(100, 124))
    prompts = [shared + [7, 8, 9], shared + [3], list(range(200, 260)), [5, 6]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=10, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=5, n=2, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    ]
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, param)


def run_to_end(engine: LLMEngine) -> dict[str, list[list[int]]]:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = [c.token_ids for c in output.outputs]
    return finished


def contains_live_objects(value) -> bool:
    """Whether plain data hides a tensor, a generator or a scheduler-side object."""
    if isinstance(value, (torch.Tensor, torch.Generator)):
        return True
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if type(value).__module__.startswith("minivllm.core.request"):
            return True
        return any(contains_live_objects(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, dict):
        return any(contains_live_objects(k) or contains_live_objects(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return any(contains_live_objects(item) for item in value)
    return False


@pytest.fixture(scope="module")
def recorded_run(tiny_model_dirs):
    """One engine run with preemptions (a pool of 24 blocks of 4 tokens) and prefix caching."""
    model_dir = tiny_model_dirs[ENGINE_TEST_FAMILY]
    num_blocks, block_size = 24, 4
    bytes_per_block = block_size * 2 * 2 * 2 * 16 * 4  # 2 layers, K+V, 2 KV heads, head_dim 16
    engine, pickles = recording_engine(
        model_dir,
        kv_cache_memory_bytes=num_blocks * bytes_per_block,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
    )
    assert engine.kv_cache_manager.num_blocks == num_blocks
    mixed_requests(engine)
    tokens = run_to_end(engine)
    return model_dir, engine, pickles, tokens


def test_every_step_crosses_as_plain_data(recorded_run):
    """Each scheduler output and runner output pickles round-trip to an equal object and
    carries no tensor, generator or Request; the run covered preemption, resumption,
    finished requests and prefix-cache hits."""
    _, engine, pickles, tokens = recorded_run
    assert sorted(tokens) == ["0", "1", "2", "3"]
    outputs = [(pickle.loads(sent), pickle.loads(back)) for sent, back in pickles]
    for scheduler_output, runner_output in outputs:
        assert isinstance(scheduler_output, SchedulerOutput)
        assert isinstance(runner_output, ModelRunnerOutput)
        assert pickle.loads(pickle.dumps(scheduler_output)) == scheduler_output
        assert not contains_live_objects(scheduler_output)
        assert not contains_live_objects(runner_output)
    cached = [c for s, _ in outputs for c in s.scheduled_cached_reqs]
    assert engine.scheduler.num_preemptions > 0
    assert any(c.resumed_from_preemption for c in cached)
    assert any(s.finished_req_ids for s, _ in outputs)
    assert any(n.num_computed_tokens > 0 for s, _ in outputs for n in s.scheduled_new_reqs)
    assert engine.executor.driver_worker.model_runner.requests == {}, "the runner forgot none"


def test_a_runner_driven_only_by_the_pickles_gives_the_same_tokens(recorded_run):
    """A fresh worker (same model, same pool size) fed nothing but the recorded scheduler
    outputs samples exactly the recorded tokens, seeded random ones included: the plain data
    is all a runner in another process would need."""
    model_dir, engine, pickles, _ = recorded_run
    worker = Worker(engine.config, Path(model_dir))
    worker.initialize_kv_cache(engine.kv_cache_manager.num_blocks)
    for sent, back in pickles:
        replayed = worker.execute_model(pickle.loads(sent))
        recorded = pickle.loads(back)
        assert replayed.sampled_token_ids == recorded.sampled_token_ids
        assert replayed.logprobs.keys() == recorded.logprobs.keys()
    assert worker.model_runner.requests == {}


# --- settings declared once -------------------------------------------------------------------


def engine_actions(parser: argparse.ArgumentParser, command: str) -> dict[str, argparse.Action]:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in subparsers.choices[command]._actions if a.dest != "help"}


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_cli_flags_are_the_config_fields(command):
    """Every EngineConfig field is a flag in vLLM's spelling with the field's default; bools
    get --X and --no-X."""
    actions = engine_actions(build_parser(), command)
    for item in dataclasses.fields(EngineConfig):
        flag = "--" + item.name.replace("_", "-")
        assert item.name in actions, f"no {flag} on `minivllm {command}`"
        action = actions[item.name]
        assert flag in action.option_strings
        assert action.default == item.default
        assert action.help == item.metadata["help"]
        if item.type in (bool, "bool"):
            assert "--no-" + flag[2:] in action.option_strings


def test_cli_values_reach_the_config():
    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--max-num-seqs",
            "3",
            "--no-enable-prefix-caching",
            "--dtype",
            "float32",
        ]
    )
    from minivllm.entrypoints.cli import engine_settings

    config = EngineConfig(**engine_settings(args))
    assert config.max_num_seqs == 3 and config.enable_prefix_caching is False
    assert config.dtype == "float32" and config.max_model_len is None


def test_an_unknown_llm_argument_is_a_type_error_naming_it():
    from minivllm import LLM

    with pytest.raises(TypeError, match=r"max_num_seq\b.*valid: .*max_num_seqs"):
        LLM(max_num_seq=4)  # fails before any model is loaded


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 2.5}, "max_num_seqs"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"attention_backend": "nope"}, "attention_backend"),
        ({"dtype": "int8"}, "dtype"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ],
)
def test_invalid_settings_are_value_errors_naming_the_field(settings, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**settings)


def test_attention_backend_names_match_the_registry():
    assert set(ATTENTION_BACKEND_NAMES) == {"auto", *ATTENTION_BACKENDS}
    for name in ATTENTION_BACKENDS:
        assert get_attention_backend(name).name == name


# --- modules depend downward -------------------------------------------------------------------


def minivllm_imports(path: Path) -> set[str]:
    """The minivllm modules a file imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minivllm"):
            for alias in node.names:  # `from minivllm import cpu_kernels` imports a module
                submodule = f"{node.module}.{alias.name}"
                is_module = (ROOT / submodule.replace(".", "/")).with_suffix(".py").is_file()
                names.add(submodule if is_module else node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("minivllm"))
    return names


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


# Lower layers never import higher ones: the model knows nothing of caches, attention nothing
# of scheduling, the worker nothing of requests, and nothing below the entry points knows them.
# The tensor-parallel group (collectives only) sits under the model that communicates with it.
LAYERS = [
    ["minivllm.utils", "minivllm.config", "minivllm.cpu_kernels"],
    ["minivllm.distributed"],
    [
        "minivllm.sample",
        "minivllm.models",
        "minivllm.outputs",
        "minivllm.tokenizer",
        "minivllm.sequence",
    ],
    ["minivllm.attention", "minivllm.spec_decode", "minivllm.structured_output"],
    ["minivllm.baselines", "minivllm.core", "minivllm.compilation"],
    ["minivllm.worker"],
    ["minivllm.executor"],
    ["minivllm.engine"],
    ["minivllm.entrypoints", "minivllm.bench", "minivllm.learning_checks", "minivllm"],
]


def layer_of(module: str) -> int:
    best = None
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[1]
            ):
                best = (level, len(prefix))
    return best[0]


def test_modules_depend_downward():
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        for imported in minivllm_imports(path):
            if imported == "minivllm" and module.startswith("minivllm.learning_checks"):
                continue
            assert layer_of(imported) <= layer_of(module), f"{module} imports {imported}"


def test_the_runner_never_imports_the_scheduler_side():
    """The worker reads the scheduler output's plain data and nothing else of the core."""
    for path in (PACKAGE / "worker").glob("*.py"):
        for imported in minivllm_imports(path):
            if imported.startswith("minivllm.core"):
                assert imported == "minivllm.core.scheduler_output", f"{path.name}: {imported}"


def test_the_scheduler_never_imports_torch():
    for name in ("scheduler.py", "scheduler_output.py", "kv_cache_manager.py", "prefix_cache.py"):
        tree = ast.parse((PACKAGE / "core" / name).read_text())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any(m and m.split(".")[0] == "torch" for m in imported), name


# --- the book points at modules that exist -----------------------------------------------------


BOOK_FILES = sorted((ROOT / "chapters").glob("*.md")) + [ROOT / "README.md"]


@pytest.mark.parametrize("path", BOOK_FILES, ids=[p.name for p in BOOK_FILES])
def test_every_module_the_book_names_exists(path):
    text = path.read_text()
    named = set(re.findall(r"minivllm/[\w/]+\.py", text))
    if path.name == "README.md":
        # The book table names modules relative to the package: `core/scheduler.py`.
        named |= {
            "minivllm/" + m
            for m in re.findall(r"`((?:\w+/)*\w+\.py)`", text)
            if not m.startswith(("minivllm/", "scripts/", "tests/"))
        }
    assert named or path.name == "glossary.md", f"{path.name} names no module"
    for module in named:
        assert (ROOT / module).is_file(), f"{path.name} names {module}, which does not exist"


CHAPTERS = sorted((ROOT / "chapters").glob("[0-9A-Z]*-*.md"))


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_each_chapter_home_module_opens_with_its_chapter(path):
    """The first module on a chapter's '> Module:' line is its home: it says so first."""
    number = path.name.split("-")[0]
    title = f"Chapter {number}" if number[0].isdigit() else f"Appendix {number}"
    module_line = next(
        line for line in path.read_text().splitlines() if line.startswith("> Module")
    )
    home = re.search(r"`(minivllm/[\w/]+\.py)`", module_line).group(1)
    docstring = ast.get_docstring(ast.parse((ROOT / home).read_text()))
    assert docstring.startswith(title), f"{home} opens with {docstring[:40]!r}"
