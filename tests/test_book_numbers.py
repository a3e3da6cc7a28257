"""Every number a chapter's measurement quotes comes from its notebook's committed outputs.

A number with decimals in a chapter's "## The measurement" section must equal, at the precision
the chapter writes it, a number printed by one of its notebook's cells (so "16.8x" matches an
output of 16.78x). Integers and numbers inside image captions are not checked: they are counts
and sizes more than measurements.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DECIMAL = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)\.(\d+)(?!\d)")
# Chapters whose measurement section still quotes runs older than the code it describes; their
# notebooks' next full run rewrites them. strict: the mark must go once the chapter passes.
STALE: dict[str, str] = {}


def decimals(text: str) -> list[tuple[float, int]]:
    """Every decimal number in the text, with its number of decimal places."""
    return [
        (float(m.group(1).replace(",", "") + "." + m.group(2)), len(m.group(2)))
        for m in DECIMAL.finditer(text)
    ]


def notebook_output_text(path: Path) -> str:
    texts = []
    for cell in json.loads(path.read_text())["cells"]:
        for output in cell.get("outputs", []):
            texts.append("".join(output.get("text", "")))
            texts.append("".join(output.get("data", {}).get("text/plain", "")))
    return "\n".join(texts)


def section(text: str, heading: str) -> str:
    """The text under a `## heading` line, up to the next `## ` heading."""
    start = re.search(rf"^## {re.escape(heading)}$", text, re.MULTILINE).start()
    end = text.find("\n## ", start + 1)
    return text[start:] if end == -1 else text[start:end]


def measurement_section(chapter: Path) -> str:
    measured = section(chapter.read_text(), "The measurement")
    return re.sub(r"!\[[^\]]*\]\([^)]*\)", "", measured)  # captions name sizes, not results


def not_printed(quoted: str, printed: list[tuple[float, int]]) -> list[float]:
    """The decimal numbers of `quoted` that no printed number equals at the quoted precision."""
    return [
        value
        for value, places in decimals(quoted)
        if not any(round(x, places) == round(value, places) for x, _ in printed)
    ]


CHAPTERS = [
    path
    for path in sorted((ROOT / "chapters").glob("*.md"))
    if "## The measurement" in path.read_text()
    and (ROOT / "notebooks" / f"{path.stem}.ipynb").exists()
]


@pytest.mark.parametrize(
    "chapter",
    [
        pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=STALE[p.stem]))
        if p.stem in STALE
        else p
        for p in CHAPTERS
    ],
    ids=[p.stem for p in CHAPTERS],
)
def test_measurement_numbers_come_from_the_notebook(chapter):
    printed = decimals(notebook_output_text(ROOT / "notebooks" / f"{chapter.stem}.ipynb"))
    missing = not_printed(measurement_section(chapter), printed)
    assert not missing, f"{chapter.name} quotes numbers its notebook never printed: {missing}"


def test_there_are_chapters_to_check():
    assert len(CHAPTERS) >= 6, [p.name for p in CHAPTERS]


@pytest.mark.parametrize("heading", ["Goals", "How fast"])
def test_readme_numbers_come_from_the_notebooks(heading):
    """The README's goals and speeds are copies of notebook outputs, not numbers of their own: a
    re-run that moves them leaves the README failing until it is brought up to date."""
    printed = [
        number
        for notebook in sorted((ROOT / "notebooks").glob("*.ipynb"))
        for number in decimals(notebook_output_text(notebook))
    ]
    missing = not_printed(section((ROOT / "README.md").read_text(), heading), printed)
    assert not missing, f"README's {heading!r} quotes numbers no notebook printed: {missing}"
