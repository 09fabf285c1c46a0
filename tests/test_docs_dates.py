"""The GPU figures quoted in docs/limits.md and the README carry the date of their run, a run docs/performance.md
reports, and agree with what performance.md says of that run (issue 58, item 9: limits.md quoted the H200 run of
2026-11-26 beside performance.md's of 2026-11-28).

A quoted item is a bullet or paragraph that names the H200. Its dates must be those of performance.md's H200 sections
(``### On an NVIDIA H200 (torch ..., DATE)``), every measured ratio in it (a figure like ``1.013x``) must appear in the
section of its date, and a link to such a section must point at a heading that exists and is of the item's date.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PERFORMANCE = ROOT / "docs" / "performance.md"
QUOTING = [ROOT / "docs" / "limits.md", ROOT / "README.md"]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
RUN_HEADING = re.compile(r"^### On an NVIDIA H200 \(.*(20\d\d-\d\d-\d\d)\)$", re.MULTILINE)
RATIO = re.compile(r"\b\d+\.\d{3,}x")
"""A measured ratio (three decimals or more); a target (``1.01x``) has two."""
RUN_LINK = re.compile(r"performance\.md#(on-an-nvidia-h200[a-z0-9-]*)")


def items(text: str) -> list[str]:
    """The bullets and paragraphs of a page, each as one string (a bullet's indented lines are part of it)."""
    found: list[list[str]] = []
    for line in text.splitlines():
        if not line.strip():
            found.append([])
        elif line.startswith(("- ", "* ", "#")) or not found:
            found.append([line])
        else:
            found[-1].append(line)
    return [" ".join(item) for item in found if item]


def runs() -> dict[str, str]:
    """performance.md's H200 sections by date: the text from the heading to the next heading of its level or above."""
    text = PERFORMANCE.read_text(encoding="utf-8")
    found = {}
    for heading in RUN_HEADING.finditer(text):
        end = re.compile(r"^#{1,3} ", re.MULTILINE).search(text, heading.end())
        found[heading.group(1)] = text[heading.start() : end.start() if end else len(text)]
    return found


def anchor(heading: str) -> str:
    """The anchor mkdocs gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).strip().replace(" ", "-")


def on_the_gpu(item: str) -> str:
    """The part of ``item`` about the H200: from its first mention up to where the item turns to the CPU (the README's
    "not yet reached" names the H200's figures, then the CPU's)."""
    start = item.index("H200")
    end = item.find("CPU", start)
    return item[start : end if end >= 0 else len(item)]


def quoted() -> list[tuple[str, str]]:
    return [
        (path.name, item)
        for path in QUOTING
        for item in items(path.read_text(encoding="utf-8"))
        if "H200" in item and not item.startswith("#")
    ]


def test_performance_md_dates_each_h200_run_and_the_pages_quote_some() -> None:
    """The premise: the runs are found by their headings, and there is something to check."""
    assert len(runs()) >= 2
    assert len(quoted()) >= 4


@pytest.mark.parametrize(("page", "item"), quoted(), ids=lambda value: str(value)[:60])
def test_an_h200_figure_carries_the_date_of_a_run_performance_md_reports(page: str, item: str) -> None:
    dates = set(DATE.findall(item))
    assert dates, f"{page}: an H200 figure without the date of its run: {item[:300]}"
    assert dates <= set(runs()), (
        f"{page}: {sorted(dates)} is not the date of an H200 run in performance.md: {item[:300]}"
    )


@pytest.mark.parametrize(("page", "item"), quoted(), ids=lambda value: str(value)[:60])
def test_each_measured_ratio_beside_a_dated_h200_run_is_what_performance_md_reports_of_that_run(
    page: str, item: str
) -> None:
    known = runs()
    dates = [date for date in DATE.findall(item) if date in known]
    for ratio in RATIO.findall(on_the_gpu(item)):
        assert any(ratio in known[date] for date in dates), (page, ratio, dates, item[:300])


@pytest.mark.parametrize(("page", "item"), quoted(), ids=lambda value: str(value)[:60])
def test_a_link_to_an_h200_run_points_at_a_heading_that_exists_of_the_date_the_item_gives(page: str, item: str) -> None:
    headings = {anchor(match.group(0).removeprefix("### ")): match.group(1) for match in RUN_HEADING.finditer(
        PERFORMANCE.read_text(encoding="utf-8")
    )}  # fmt: skip
    for link in RUN_LINK.findall(item):
        assert link in headings, (page, link, sorted(headings))
        assert headings[link] in DATE.findall(item), (page, link, item[:300])


def test_the_overhead_figures_quoted_are_the_newest_run_s_on_both_pages() -> None:
    """Where limits.md and the README quote the guard's H200 overhead (measured ratios), both quote the newest run."""
    newest = max(runs())
    quoting = {page for page, item in quoted() if RATIO.search(item)}
    assert quoting == {"limits.md", "README.md"}
    for page, item in quoted():
        if RATIO.search(item):
            assert newest in DATE.findall(item), (page, newest, item[:300])
