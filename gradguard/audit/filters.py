"""What ``gradguard audit --since/--until/--rule/--param`` keep: ``Filters``, and ``EventFilter``
applying them to one event.

Filters narrow the breakdowns; the run table, the reproduced counters and the cross-check always
cover the whole log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradguard.policy.patterns import pattern_matcher

__all__ = ["EventFilter", "Filters"]


@dataclass(frozen=True)
class Filters:
    """Which incidents the breakdowns cover; empty means all."""

    since: int | None = None
    """First step shown (inclusive)."""
    until: int | None = None
    """Last step shown (inclusive)."""
    rules: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    """Parameter-name patterns, as in a policy: globs, or ``re:<regex>``."""

    def __post_init__(self) -> None:
        for pattern in self.params:
            try:
                pattern_matcher(pattern)
            except ValueError as exc:  # the policy's own pattern checks: RE2, linear time
                raise ValueError(f"invalid regular expression in --param {pattern!r}: {exc}") from None

    @property
    def active(self) -> bool:
        return self.since is not None or self.until is not None or bool(self.rules) or bool(self.params)

    def describe(self) -> str:
        parts = []
        if self.since is not None or self.until is not None:
            low = "" if self.since is None else str(self.since)
            high = "" if self.until is None else str(self.until)
            parts.append(f"steps {low}..{high}")
        if self.rules:
            parts.append("rule " + " or ".join(self.rules))
        if self.params:
            parts.append("param " + " or ".join(self.params))
        return ", ".join(parts) if parts else "none"

    def as_json(self) -> dict[str, Any]:
        return {"since": self.since, "until": self.until, "rules": list(self.rules), "params": list(self.params)}


class _ParamFilter:
    def __init__(self, patterns: tuple[str, ...]) -> None:
        self._tests = [pattern_matcher(pattern) for pattern in patterns]
        self._cache: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        hit = self._cache.get(name)
        if hit is None:
            if len(self._cache) > 100_000:
                self._cache.clear()
            hit = any(test(name) for test in self._tests)
            self._cache[name] = hit
        return hit


class EventFilter:
    """``Filters`` applied to one event: its step and rule (``shown``), its parameters (``narrow``)."""

    def __init__(self, filters: Filters) -> None:
        self.filters = filters
        self.since = filters.since
        self.until = filters.until
        self.rules = frozenset(filters.rules)
        self.params = _ParamFilter(filters.params) if filters.params else None

    def shown(self, step: int | None, rule: str | None) -> bool:
        """Whether an event at ``step`` (``None``: no step) under ``rule`` passes the step and rule filters."""
        if step is not None:
            if self.since is not None and step < self.since:
                return False
            if self.until is not None and step > self.until:
                return False
        return not self.rules or rule in self.rules

    def narrow(self, names: list[str]) -> list[str]:
        """The names that pass the parameter filter (all of them when there is none)."""
        keep = self.params
        return names if keep is None else [name for name in names if keep(name)]
