"""Every notebook runs top to bottom in quick mode (MINIVLLM_QUICK=1), exercises included.

Figures go to a temporary directory so that running the tests never overwrites the committed
full-mode figures.
"""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_quick_mode(path, tmp_path, monkeypatch):
    """The notebook executes without error, its learning-check cells included."""
    monkeypatch.setenv("MINIVLLM_QUICK", "1")
    monkeypatch.setenv("MINIVLLM_FIGURES_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    assert any(tmp_path.iterdir()), "the notebook saved no figure"


def test_there_are_notebooks():
    """Each chapter so far has its notebook."""
    assert len(NOTEBOOKS) >= 3, [p.name for p in NOTEBOOKS]
    assert os.path.isdir(Path(__file__).parent.parent / "figures")


def test_every_chapter_notebook_has_its_gpu_section():
    """Each chapter's notebook ends with an "On a GPU" section that reads its chapter's
    gpu_bench records (or says there are none); the appendix is about the CPU alone."""
    import json

    for path in NOTEBOOKS:
        chapter = path.stem.split("-")[0]
        if not chapter[0].isdigit():
            continue
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
        headings = [
            line
            for cell in cells
            if cell["cell_type"] == "markdown"
            for line in "".join(cell["source"]).splitlines()
            if line.startswith("#")
        ]
        assert f'load_gpu_results("{chapter}"' in code, path.name
        assert any("On a GPU" in h or "On GPUs" in h for h in headings), path.name


def first_code_cell(path: Path):
    notebook = nbformat.read(path, as_version=4)
    return next(cell for cell in notebook.cells if cell.cell_type == "code")


def test_every_notebook_first_says_which_code_and_machine_made_its_numbers():
    """The first code cell prints the commit (`code_version`) and the machine (`machine_label`),
    so a committed output can be traced to the code and the processor that printed it."""
    for path in NOTEBOOKS:
        first = first_code_cell(path)
        assert "code_version()" in first.source and "machine_label()" in first.source, path.name


def test_every_notebook_ran_on_one_commit():
    """The committed outputs are one run of the book: every notebook's first output names the
    commit whose code printed it and the machine it ran on, and all name the same ones, with no
    uncommitted change to the code ("+changes"), so numbers quoted across chapters come from the
    same engine on the same kind of processor."""
    import re

    runs = {}
    for path in NOTEBOOKS:
        first = first_code_cell(path)
        printed = "".join(output.get("text", "") for output in first.outputs)
        found = re.search(r"ran on commit ([0-9a-f]{7,})(\+changes)? · (.+)", printed)
        assert found, f"{path.name}'s first output names no commit: {printed[:200]!r}"
        commit, changed, machine = found.groups()
        assert not changed, f"{path.name} ran on uncommitted code: {found.group(0)!r}"
        runs[path.stem] = (commit, machine.strip())
    assert len(set(runs.values())) == 1, runs


def test_a_resumed_book_run_skips_only_notebooks_run_whole_on_the_same_code(tmp_path):
    """`scripts/run_notebooks.py --resume` continues an interrupted run: a notebook counts as done
    only if every code cell ran and its first output names the code and machine of this run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "run_notebooks", Path(__file__).parent.parent / "scripts" / "run_notebooks.py"
    )
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)

    def saved(path, first_output, second_ran=True):
        notebook = nbformat.v4.new_notebook()
        first = nbformat.v4.new_code_cell("print(code_version())", execution_count=1)
        first.outputs = [nbformat.v4.new_output("stream", name="stdout", text=first_output)]
        second = nbformat.v4.new_code_cell("x = 1", execution_count=2 if second_ran else None)
        notebook.cells = [nbformat.v4.new_markdown_cell("# a"), first, second]
        nbformat.write(notebook, path)
        return path

    line = "commit abc1234 · AMD EPYC, 2 cores, torch 2.13.0+cpu"
    assert runner.ran_on(saved(tmp_path / "a.ipynb", f"ran on {line}\ndevice: cpu\n")) == line
    assert runner.ran_on(saved(tmp_path / "b.ipynb", f"ran on {line}\n", second_ran=False)) is None
    assert runner.ran_on(saved(tmp_path / "c.ipynb", "device: cpu\n")) is None
