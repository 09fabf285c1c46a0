"""The "Gradient health" of ``gradguard audit``: the monitors' ``stats``, ``vanishing``, ``exploding`` and
``recovered`` events.

Per series (rule, scope, name, stat) it keeps the first, last, smallest and largest figure, and a
median: exact while a series has at most :data:`EXACT_SAMPLES` figures, then estimated from a
fixed-size histogram on a signed log scale (:data:`BINS_PER_DECADE` bins per decade between 1e-30
and 1e30, so at most ~12,000 bins a series, in practice a few dozen), whose bin centres are within
1.2% of any value they hold. Memory grows with the number of series, never with the number of steps.
Per name it keeps when it vanished or exploded and when it recovered (the first :data:`KEPT_EPISODES`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final

from gradguard.audit.fields import Malformed, number_or_none
from gradguard.audit.filters import EventFilter
from gradguard.audit.reader import Record
from gradguard.audit.run_state import RunState
from gradguard.audit.summary import FlagRow, HealthRow

__all__ = ["BINS_PER_DECADE", "EXACT_SAMPLES", "HealthCollector", "LogHistogram"]

EXACT_SAMPLES: Final = 256
BINS_PER_DECADE: Final = 100
KEPT_EPISODES: Final = 20
_LOW_DECADE, _HIGH_DECADE = -30, 30


class LogHistogram:
    """A streaming median: exact up to :data:`EXACT_SAMPLES` values, then from signed log-scale bins."""

    def __init__(self) -> None:
        self.exact: list[float] | None = []
        self.bins: dict[int, int] = {}
        self.count = 0

    def add(self, value: float) -> None:
        self.count += 1
        self.bins[_bin(value)] = self.bins.get(_bin(value), 0) + 1
        if self.exact is not None:
            self.exact.append(value)
            if len(self.exact) > EXACT_SAMPLES:
                self.exact = None  # from now on the bins answer

    def median(self) -> float | None:
        if not self.count:
            return None
        if self.exact is not None:
            ordered = sorted(self.exact)
            middle = len(ordered) // 2
            return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
        seen, half = 0, (self.count + 1) / 2
        for key in sorted(self.bins):
            seen += self.bins[key]
            if seen >= half:
                return _centre(key)
        return None  # pragma: no cover - the bins hold every value


def _bin(value: float) -> int:
    """0 for zero (and below 1e-30); +-(1 + position) on a log scale, largest magnitudes furthest out."""
    magnitude = abs(value)
    if magnitude < 10.0**_LOW_DECADE:
        return 0
    decades = min(math.log10(magnitude), float(_HIGH_DECADE)) - _LOW_DECADE
    position = 1 + int(decades * BINS_PER_DECADE)
    return position if value > 0 else -position


def _centre(key: int) -> float:
    if key == 0:
        return 0.0
    magnitude: float = 10.0 ** (_LOW_DECADE + (abs(key) - 0.5) / BINS_PER_DECADE)
    return magnitude if key > 0 else -magnitude


@dataclass
class _Series:
    first: float
    first_step: int | None
    last: float = math.nan
    last_step: int | None = None
    low: float | None = None
    high: float | None = None
    nonfinite: int = 0
    median: LogHistogram = field(default_factory=LogHistogram)

    def add(self, value: float, step: int | None) -> None:
        self.last, self.last_step = value, step
        if not math.isfinite(value):
            self.nonfinite += 1
            return
        self.low = value if self.low is None else min(self.low, value)
        self.high = value if self.high is None else max(self.high, value)
        self.median.add(value)


class HealthCollector:
    """``stats``, ``vanishing``, ``exploding`` and ``recovered`` events, filtered by step, rule and name."""

    def __init__(self, event_filter: EventFilter) -> None:
        self._filter = event_filter
        self.series: dict[tuple[str, str, str, str], _Series] = {}
        self.flags: dict[tuple[str, str, str], FlagRow] = {}

    def stats(self, event: dict[str, Any], run: RunState, record: Record) -> None:
        rule, scope, figures = event.get("rule"), event.get("scope"), event.get("figures")
        if type(rule) is not str or type(scope) is not str or not isinstance(figures, dict):
            raise Malformed("gradguard 'stats' event without a 'rule', a 'scope' and a 'figures' mapping")
        step = event.get("step")
        step = step if type(step) is int else None
        if not self._filter.shown(step, rule):
            return
        keep = self._filter.params
        for stat, values in figures.items():
            by_name = {rule: values} if scope == "group" else values
            if not isinstance(by_name, dict):
                raise Malformed(f"gradguard 'stats' event whose {stat!r} figures are not per name")
            if scope == "group" and keep is not None:
                continue  # a rule's joint figure is not one parameter's
            for name, raw in by_name.items():
                if keep is not None and not keep(name):
                    continue
                value = number_or_none(raw)
                if value is None:
                    raise Malformed(f"gradguard 'stats' event with a figure that is not a number: {raw!r}")
                key = (rule, scope, name, stat)
                series = self.series.get(key)
                if series is None:
                    series = self.series[key] = _Series(value, step)
                series.add(value, step)

    def flag(self, event: dict[str, Any], run: RunState, record: Record) -> None:
        kind, rule, name = event["event"], event.get("rule"), event.get("name")
        if type(rule) is not str or type(name) is not str:
            raise Malformed(f"gradguard {kind!r} event without a 'rule' and a 'name' string")
        step = event.get("step")
        step = step if type(step) is int else None
        norm = number_or_none(event.get("norm"))  # before counting: an unreadable number makes the line unreadable
        threshold = number_or_none(event.get("threshold"))
        if kind != "recovered":
            run.count(rule, kind)
        if not self._filter.shown(step, rule) or (self._filter.params is not None and not self._filter.params(name)):
            return
        if kind == "recovered":
            was = event.get("was")
            row = self.flags.get((rule, name, str(was)))
            if row is not None and row.episodes and row.episodes[-1][1] is None:
                row.episodes[-1][1] = step
            return
        row = self.flags.get((rule, name, kind))
        if row is None:
            row = self.flags[(rule, name, kind)] = FlagRow(rule, name, kind, 0, [], None, None)
        row.times += 1
        row.threshold = threshold
        if len(row.episodes) < KEPT_EPISODES:
            row.episodes.append([step, None])
        if norm is not None:
            worse = min if kind == "vanishing" else max
            row.worst = norm if row.worst is None else worse(row.worst, norm)

    def rows(self) -> tuple[list[HealthRow], list[FlagRow]]:
        rows = [
            HealthRow(
                rule,
                scope,
                name,
                stat,
                series.median.count + series.nonfinite,
                series.first_step,
                series.last_step,
                series.first,
                series.last,
                series.low,
                series.median.median(),
                series.high,
                series.nonfinite,
                series.median.exact is not None,
            )
            for (rule, scope, name, stat), series in self.series.items()
        ]
        return rows, list(self.flags.values())
