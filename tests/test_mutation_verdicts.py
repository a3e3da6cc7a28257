"""The mutation-testing script's record of verdicts (scripts/mutate.py): mutmut's files of a run
survive a fresh checkout through mutation-verdicts.jsonl, and the committed score file is the
one those verdicts give."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_mutate_script():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def mutate(tmp_path, monkeypatch):
    """The script with its work folder and verdict file under tmp_path."""
    module = load_mutate_script()
    monkeypatch.setattr(module, "WORK", tmp_path / "work")
    monkeypatch.setattr(module, "VERDICTS", tmp_path / "verdicts.jsonl")
    return module


def write_meta(path: Path, exit_codes: dict, hashes: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        exit_code_by_key=exit_codes,
        hash_by_function_name=hashes,
        type_check_error_by_key={},
        durations_by_key={},
        estimated_durations_by_key={},
    )
    path.write_text(json.dumps(meta, ensure_ascii=False))


def test_a_runs_verdicts_are_saved_and_restored_in_a_fresh_work_folder(mutate):
    """Killed, survived and not-run verdicts of two functions (one a method, as mutmut names
    it) and of a package's __init__.py come back into mutmut's own files unchanged."""
    codes = {
        "minivllm.engine.core.x_step__mutmut_1": 1,
        "minivllm.engine.core.x_step__mutmut_2": 0,
        "minivllm.engine.core.x_step__mutmut_3": None,
        "minivllm.engine.core.xǁEngineCoreǁabort__mutmut_1": -9,
    }
    hashes = {"x_step": "aaa", "xǁEngineCoreǁabort": "bbb", "x_no_mutants": "ccc"}
    init_codes = {"minivllm.engine.x_make_engine__mutmut_1": 1}
    mutants = mutate.WORK / "engine" / "mutants" / "minivllm" / "engine"
    write_meta(mutants / "core.py.meta", codes, hashes)
    write_meta(mutants / "__init__.py.meta", init_codes, {"x_make_engine": "ddd"})
    mutate.sync_verdicts("engine")
    assert mutate.module_results("engine") == {
        "minivllm/engine/__init__.py": init_codes,
        "minivllm/engine/core.py": codes,
    }

    fresh = mutate.WORK / "fresh"
    mutate.restore_verdicts("engine", fresh)
    restored = json.loads((fresh / "mutants/minivllm/engine/core.py.meta").read_text())
    assert restored["exit_code_by_key"] == codes
    assert restored["hash_by_function_name"] == hashes


def test_saving_a_group_keeps_the_other_groups_verdicts(mutate):
    for group, name in [("core", "minivllm.core.request.x_a__mutmut_1"), ("sample", None)]:
        if name:
            write_meta(
                mutate.WORK / group / "mutants/minivllm/core/request.py.meta",
                {name: 1},
                {"x_a": "h"},
            )
            mutate.sync_verdicts(group)
    mutate.save_verdicts("sample", [])
    assert mutate.module_results("core") == {
        "minivllm/core/request.py": {"minivllm.core.request.x_a__mutmut_1": 1}
    }


def test_a_restore_leaves_mutmuts_own_newer_files_alone(mutate):
    """Where the work folder has mutmut's file already, it is the newer record: kept."""
    meta = mutate.WORK / "core" / "mutants/minivllm/core/request.py.meta"
    write_meta(meta, {"minivllm.core.request.x_a__mutmut_1": 1}, {"x_a": "h"})
    mutate.sync_verdicts("core")
    write_meta(meta, {"minivllm.core.request.x_a__mutmut_1": 0}, {"x_a": "h2"})
    mutate.restore_verdicts("core", mutate.WORK / "core")
    assert json.loads(meta.read_text())["hash_by_function_name"] == {"x_a": "h2"}


def test_the_committed_scores_are_the_committed_verdicts():
    """mutation-scores.md is what the committed mutation-verdicts.jsonl gives: neither was
    edited without the other."""
    mutate = load_mutate_script()
    assert (ROOT / "mutation-scores.md").read_text() == mutate.report_text(mutate.score_rows())


def test_every_mutant_called_equivalent_or_explained_exists_and_survived():
    """An equivalent (or explained) mutant is named by mutmut's numbering within its function,
    which moves when the function's code changes: a name that no longer exists, or that the
    tests now kill, was left behind by such a change and would be wrongly left out of the
    score (or explained for nothing)."""
    mutate = load_mutate_script()
    verdicts = {
        name: exit_code
        for group in mutate.GROUPS
        for codes in mutate.module_results(group).values()
        for name, exit_code in codes.items()
    }
    stale = {
        name: verdicts.get(name, "no such mutant")
        for name in [*mutate.EQUIVALENT, *mutate.SURVIVORS_EXPLAINED]
        if verdicts.get(name, "no such mutant") not in (0, None)  # None: not run yet
    }
    assert stale == {}
