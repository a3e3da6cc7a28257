"""A chapter explains its exercise's idea and never prints the answer above the exercise.

The code a learner is asked to write (its solution lives in `minivllm.learning_checks.solutions`)
may appear in a chapter only after its "## Exercises" heading, or folded away in a
`<details>` block that says to read it after trying. The check: no line of a solution's body
(code, not comments, of 20 characters or more, whitespace aside) appears in the chapter's
unfolded text above the heading.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import minivllm.learning_checks.solutions as solutions

CHAPTERS = Path(__file__).parent.parent / "chapters"
SHORTEST_LINE = 20  # shorter lines (`return out`, `continue`) say nothing of a solution


def normalized(line: str) -> str:
    return re.sub(r"\s+", " ", line.split("#")[0]).strip()


def solution_lines(module) -> set[str]:
    lines = set()
    for _, function in inspect.getmembers(module, inspect.isfunction):
        if function.__module__ != module.__name__:
            continue
        source = inspect.getsource(function)
        docstring = inspect.getdoc(function) or ""
        for line in source.splitlines()[1:]:  # the body, without the def line
            code = normalized(line)
            if len(code) >= SHORTEST_LINE and code not in normalized(docstring):
                lines.add(code)
    return lines


def unfolded_text_above_the_exercises(chapter: Path) -> str:
    text = chapter.read_text()
    above = text.split("\n## Exercises", 1)[0]
    return re.sub(r"<details>.*?</details>", "", above, flags=re.DOTALL)


MODULES = [m.name for m in pkgutil.iter_modules(solutions.__path__)]


@pytest.mark.parametrize("module_name", MODULES)
def test_no_solution_is_printed_above_its_exercise(module_name):
    chapter = next(CHAPTERS.glob(f"{module_name.removeprefix('ch')}-*.md"))
    module = importlib.import_module(f"{solutions.__name__}.{module_name}")
    shown = {normalized(line) for line in unfolded_text_above_the_exercises(chapter).splitlines()}
    printed = sorted(solution_lines(module) & shown)
    assert not printed, f"{chapter.name} prints its exercise's solution: {printed}"
