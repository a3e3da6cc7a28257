"""Every timing in the notebooks goes through the one measuring harness, bench/measure.py:
comparisons in interleaved rounds (`interleaved`), one-off events by its `stopwatch`. A notebook
that reads a clock itself (`time.perf_counter()`, `time.time()`, `time.monotonic()`) or uses
`timeit` has built a timing loop of its own, with none of the harness's rounds, warm-ups or
spread, and fails here."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))

CLOCKS = {
    "perf_counter",
    "perf_counter_ns",
    "time",
    "time_ns",
    "monotonic",
    "monotonic_ns",
    "process_time",
}
MAGICS = ("%timeit", "%%timeit", "%time ", "%%time")


def own_timings(source: str) -> list[str]:
    """The places where a code cell's source reads a clock itself or uses timeit."""
    found = [line.strip() for line in source.splitlines() if line.lstrip().startswith(MAGICS)]
    # IPython's magics and shell escapes are not Python; the rest of the cell is.
    python = "\n".join(
        "" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()
    )
    flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT  # a notebook may await at the top
    tree = compile(python, "<cell>", "exec", flags=flags)
    time_modules = {"time"}  # and whatever `import time as ...` names it
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "time":
                    time_modules.add(alias.asname or "time")
                if alias.name == "timeit":
                    found.append("import timeit")
        elif isinstance(node, ast.ImportFrom):
            if node.module == "timeit":
                found.append("from timeit import ...")
            elif node.module == "time":
                found += [f"from time import {a.name}" for a in node.names if a.name in CLOCKS]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in CLOCKS
            and isinstance(node.value, ast.Name)
            and node.value.id in time_modules
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def code_cells(path: Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    return ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_notebook_times_with_a_clock_of_its_own(path):
    found = [(number, place) for number, source in enumerate(code_cells(path))
             for place in own_timings(source)]  # fmt: skip
    assert not found, (
        f"{path.name} times with its own clock (code cell, place): {found}; use"
        " bench/measure.py's interleaved (comparisons) or stopwatch (one-off events)"
    )


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import time\nstart = time.perf_counter()\nf()\nprint(time.perf_counter() - start)",
         ["time.perf_counter", "time.perf_counter"]),
        ("import time as clock\nt = clock.monotonic()", ["clock.monotonic"]),
        ("from time import perf_counter\nt = perf_counter()", ["from time import perf_counter"]),
        ("import timeit\ntimeit.timeit(f, number=10)", ["import timeit"]),
        ("x = 1\n%timeit f()", ["%timeit f()"]),
        ("stamps.append(time.time())", ["time.time"]),
        ("await asyncio.sleep(0)\nt = time.perf_counter_ns()", ["time.perf_counter_ns"]),
        # The harness, and things that only look like clocks, are fine.
        ("with stopwatch() as watch:\n    f()\nprint(watch.seconds)", []),
        ("timings = interleaved({'a': f}, repeats=5)\ntime.sleep(1)", []),
        ("import time\nrecord.time = 3\nx = time_per_token", []),
    ],
)  # fmt: skip
def test_a_clock_read_by_hand_is_found(source, expected):
    assert own_timings(source) == expected
