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
