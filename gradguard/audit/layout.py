"""The pieces reports are laid out with: ``Section``, ``Table``, and how numbers, steps, names,
paths and origins read."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradguard.audit.summary import StepList
from gradguard.errors import origin_sentence

__all__ = ["Section", "Table", "name_list", "num", "origin_text", "plural", "short_path", "step_list", "steps_range"]


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    right: frozenset[int] = frozenset()
    """Columns aligned right (numbers)."""


@dataclass
class Section:
    title: str
    lines: list[str] = field(default_factory=list)
    table: Table | None = None
    after: list[str] = field(default_factory=list)


def num(value: float | None) -> str:
    if value is None:
        return ""
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    if abs(value) >= 1e5:
        return f"{value:.3e}"
    return f"{value:,.4g}" if abs(value) >= 1000 else f"{value:.4g}"


def steps_range(first: int | None, last: int | None) -> str:
    if first is None:
        return ""
    return str(first) if last is None or last == first else f"{first}-{last}"


def plural(n: int, word: str, plural: str | None = None) -> str:
    """``1 step``, ``2 steps``."""
    return f"{n:,} {word if n == 1 else (plural or word + 's')}"


def name_list(names: Sequence[str], shown: int, total: int | None = None) -> str:
    """The first ``shown`` names, then ``and N more`` (``total``: how many there are, if not all listed)."""
    total = len(names) if total is None else total
    text = ", ".join(names[:shown])
    return text + (f" and {total - min(shown, len(names)):,} more" if total > min(shown, len(names)) else "")


def short_path(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it, else as it is."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") or not Path(path).is_absolute() else relative


def origin_text(origin: Mapping[str, Any]) -> str:
    """Where a NaN/Inf started, in words, as a halt says it (without its ``Origin:``: the audit's line has the
    label); a foreign or hand-edited origin as it is."""
    try:
        return origin_sentence(origin).removeprefix("Origin: ")
    except (AttributeError, TypeError, ValueError):
        return str(origin)


def step_list(steps: StepList) -> str:
    shown = ", ".join(str(step) for step in steps.steps)
    more = steps.distinct_steps - len(steps.steps)
    return shown + (f" and {more:,} more" if more > 0 else "")
