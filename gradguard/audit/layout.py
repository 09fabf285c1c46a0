"""The pieces reports are laid out with: :class:`Section`, :class:`Table`, and how numbers and steps read."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Section", "Table", "num", "steps_range"]


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
