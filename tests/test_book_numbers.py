"""Every number a chapter's measurement quotes comes from its notebook's committed outputs.

A number with decimals in a chapter's "## The measurement" section must equal, at the precision
the chapter writes it, a number printed by one of its notebook's cells (so "16.8x" matches an
output of 16.78x). Integers and numbers inside image captions are not checked: they are counts
and sizes more than measurements.
"""

from __future__ import annotations

import functools
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


@functools.cache
def printed_numbers(stem: str) -> tuple[tuple[float, int], ...]:
    """Every decimal number notebooks/<stem>.ipynb printed (none for a chapter without one); read
    once per test session, as many README rows cite the same notebooks."""
    path = ROOT / "notebooks" / f"{stem}.ipynb"
    return tuple(decimals(notebook_output_text(path))) if path.exists() else ()


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
    missing = not_printed(measurement_section(chapter), printed_numbers(chapter.stem))
    assert not missing, f"{chapter.name} quotes numbers its notebook never printed: {missing}"


def test_there_are_chapters_to_check():
    assert len(CHAPTERS) >= 6, [p.name for p in CHAPTERS]


CHAPTER_LINK = re.compile(r"\]\((?:\.\./)?(?:chapters|notebooks)/([\w-]+)\.(?:md|ipynb)[^)]*\)")


def readme_blocks(heading: str) -> list[tuple[list[str], str]]:
    """The blocks (paragraphs, tables, table rows) of a README section, each with the chapters
    whose notebooks its numbers must come from: the chapters a block links, or, for a block that
    links none, those of the last block above it that did (a table under its introduction)."""
    blocks, sources = [], []
    for paragraph in section((ROOT / "README.md").read_text(), heading).split("\n\n"):
        rows = paragraph.splitlines()
        is_table = all(row.startswith("|") for row in rows)
        for block in rows if is_table else [paragraph]:
            linked = CHAPTER_LINK.findall(block)
            if linked and not is_table:
                sources = linked
            blocks.append((linked if is_table and linked else sources, block))
    return blocks


def measured_text(block: str, heading: str) -> str:
    """What of a README block quotes measurements: not its links or code spans (flags, versions),
    and in a row of the Goals table (chapter | goal | where it stands) only where it stands: the
    goal's own thresholds are targets, not outputs."""
    text = re.sub(r"`[^`]*`", "", CHAPTER_LINK.sub("", block))
    if heading == "Goals" and text.startswith("|"):
        return text.strip().strip("|").split("|")[-1]
    return text


@pytest.mark.parametrize("heading", ["Goals", "How fast"])
def test_readme_numbers_come_from_the_notebooks_they_cite(heading):
    """The README's goals and speeds are copies of notebook outputs, not numbers of their own, and
    each comes from the chapter its row or paragraph links: two chapters' runs of one measurement
    differ, so a row that quoted one chapter's run under another's name would disagree with the
    chapter it sends the reader to. A re-run that moves a number leaves the README failing until
    it is brought up to date."""
    wrong = []
    for sources, block in readme_blocks(heading):
        quoted = measured_text(block, heading)
        printed = [number for stem in sources for number in printed_numbers(stem)]
        if missing := not_printed(quoted, printed):
            wrong.append((sources, missing, block[:80]))
    assert not wrong, (
        f"README's {heading!r} quotes numbers its cited notebooks never printed: {wrong}"
    )


def test_readme_blocks_find_their_chapters():
    """The citation rule above binds: every README block that quotes a number cites a notebook."""
    unsourced = [
        block[:80]
        for heading in ("Goals", "How fast")
        for sources, block in readme_blocks(heading)
        if decimals(measured_text(block, heading)) and not sources
    ]
    assert not unsourced, unsourced
