"""The "Gradient health" of ``gradguard audit``: the monitors' ``stats``, ``vanishing``, ``exploding`` and
``recovered`` events.

Per series (rule, scope, name, stat) it keeps the first, last, smallest and largest figure, and a
median: exact while a series has at most ``EXACT_SAMPLES`` figures, then estimated from a fixed-size
histogram on a signed log scale (``BINS_PER_DECADE`` bins per decade between 1e-30 and 1e30, so at most
~12,000 bins a series, in practice a few dozen), whose bin centres are within 1.2% of any value they hold.
Memory grows with the number of series, never with the number of steps. Per name it keeps when it vanished
or exploded and when it recovered (the first ``KEPT_EPISODES``).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gradguard.audit.collector import Collector, Context, Handler
from gradguard.audit.fields import Malformed
from gradguard.audit.reader import Record
from gradguard.audit.run_state import RunState
from gradguard.audit.summary import FlagRow, HealthRow
from gradguard.events.definitions import Exploding, Recovered, Stats, Vanishing, as_float, event_name

__all__ = ["BINS_PER_DECADE", "EXACT_SAMPLES", "HealthCollector", "LogHistogram"]

EXACT_SAMPLES: Final = 256
BINS_PER_DECADE: Final = 100
KEPT_EPISODES: Final = 20
_LOW_DECADE, _HIGH_DECADE = -30, 30
_MAX_KEY: Final = 1 + (_HIGH_DECADE - _LOW_DECADE) * BINS_PER_DECADE
"""The largest ``_bin`` of any value, in magnitude."""
_NUMPY_FROM: Final = 64
"""Values binned at once from which numpy's fixed cost (about 30 us a call) pays."""


class LogHistogram:
    """A streaming median: exact up to ``EXACT_SAMPLES`` values, then from signed log-scale bins."""

    def __init__(self) -> None:
        self.exact: list[float] | None = []
        self.bins: dict[int, int] = {}
        self.count = 0

    def add(self, value: float) -> None:
        self.count += 1
        exact = self.exact
        if exact is not None:
            exact.append(value)
            if len(exact) > EXACT_SAMPLES:
                self.exact = None  # from now on the bins answer
                self.add_bins(_bin(one) for one in exact)
            return
        key = _bin(value)
        self.bins[key] = self.bins.get(key, 0) + 1

    def add_bins(self, keys: Iterable[int]) -> None:
        bins = self.bins
        for key in keys:
            bins[key] = bins.get(key, 0) + 1

    def retire_exact(self) -> None:
        """From now on the bins answer: the exact values go to them (many at once with numpy, a few one by one)."""
        exact, self.exact = self.exact, None
        if exact is None or len(exact) < _NUMPY_FROM:
            self.add_bins(_bin(one) for one in exact or ())
            return
        import numpy as np

        found, counts = np.unique(_bins(np.array(exact)), return_counts=True)
        self.add_bins_counted(found.tolist(), counts.tolist())

    def add_bins_counted(self, keys: list[int], counts: list[int]) -> None:
        bins = self.bins
        for key, n in zip(keys, counts, strict=True):
            bins[key] = bins.get(key, 0) + n

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


def _bins(values: Any) -> Any:
    """``_bin`` of every value of a finite float64 array, as an int64 array."""
    import numpy as np

    magnitude = np.abs(values)
    with np.errstate(divide="ignore"):
        decades = np.minimum(np.log10(magnitude), float(_HIGH_DECADE)) - _LOW_DECADE
    position = 1 + np.floor(np.maximum(decades, 0.0) * BINS_PER_DECADE).astype(np.int64)
    keys = np.where(values > 0, position, -position)
    keys[magnitude < 10.0**_LOW_DECADE] = 0
    return keys


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


_BLOCK_ROWS: Final = 512
"""Steps of one (rule, stat)'s figures gathered before they are added to their series, all at once."""


class _Block:
    """The figures of one (rule, scope, stat) at consecutive ``stats`` events with the same names, gathered as rows
    and added to their series a block at a time (numpy): a monitor of every tensor writes hundreds a line."""

    def __init__(self, names: list[str], series: list[_Series], kept: list[int]) -> None:
        self.names = names
        self.series = series
        self.kept = kept
        """The columns of ``names`` kept (``--param``)."""
        self.rows: list[bytes] = []
        """The gathered rows, each its figures as C doubles (``pack``), as numpy reads them."""
        self.pack = struct.Struct(f"{len(series)}d").pack
        """A row's figures (floats) as bytes: ``struct`` takes a float as it is, where ``array`` parses each as an
        argument (a seventh of the audit's instructions on a monitor's line of 200 figures)."""
        self.last_step = 0

    def add(self, row: bytes, step: int) -> None:
        self.rows.append(row)
        self.last_step = step
        if len(self.rows) >= _BLOCK_ROWS:
            self.flush()

    def flush(self) -> None:
        """Add the gathered rows to their series, the whole block at once: a column at a time, a monitor's 200 columns
        would cost 20 numpy calls each, twice the lines' decoding."""
        if not self.rows:
            return
        import numpy as np

        width = len(self.series)
        matrix = np.frombuffer(b"".join(self.rows), dtype=np.float64).reshape(-1, width)
        self.rows = []
        finite = np.isfinite(matrix)
        bad = (len(matrix) - finite.sum(axis=0)).tolist()
        if any(bad):  # a monitor's figures at a NaN step: left out of the smallest, largest and median
            lows = np.where(finite, matrix, np.inf).min(axis=0).tolist()
            highs = np.where(finite, matrix, -np.inf).max(axis=0).tolist()
        else:
            lows, highs = matrix.min(axis=0).tolist(), matrix.max(axis=0).tolist()
        lasts = matrix[-1].tolist()
        rows = len(matrix)
        binned: list[int] = []
        for index, series in enumerate(self.series):
            series.last, series.last_step = lasts[index], self.last_step
            if bad[index]:
                series.nonfinite += bad[index]
                if bad[index] == rows:
                    continue
            low, high = lows[index], highs[index]
            series.low = low if series.low is None else min(series.low, low)
            series.high = high if series.high is None else max(series.high, high)
            median, finite_count = series.median, rows - bad[index]
            exact = median.exact
            if exact is not None:
                if len(exact) + finite_count <= EXACT_SAMPLES:
                    exact.extend((matrix[finite[:, index], index] if bad[index] else matrix[:, index]).tolist())
                    median.count += finite_count
                    continue
                median.retire_exact()
            median.count += finite_count  # past its exact values (most series, most blocks): bins only
            binned.append(index)
        if binned:
            for index, (keys, counts) in zip(binned, _bin_counts(matrix, finite, binned), strict=True):
                self.series[index].median.add_bins_counted(keys, counts)


def _bin_counts(matrix: Any, finite: Any, places: list[int]) -> list[tuple[list[int], list[int]]]:
    """For each column of ``matrix`` (float64, rows x columns) at ``places``, each with a finite value: the distinct
    bins (``_bin``) of its finite values and how many each holds, from one ``np.unique`` over all of them."""
    import numpy as np

    span = 2 * _MAX_KEY + 1
    codes = _bins(np.where(finite, matrix, 1.0)[:, places]) + _MAX_KEY
    codes += np.arange(len(places), dtype=np.int64) * span
    found, counts = np.unique(codes[finite[:, places]], return_counts=True)
    column, key = np.divmod(found, span)
    ends = np.searchsorted(column, np.arange(1, len(places) + 1)).tolist()
    keys, numbers = (key - _MAX_KEY).tolist(), counts.tolist()
    start, out = 0, []
    for end in ends:
        out.append((keys[start:end], numbers[start:end]))
        start = end
    return out


class HealthCollector(Collector):
    """``stats``, ``vanishing``, ``exploding`` and ``recovered`` events, filtered by step, rule and name."""

    def __init__(self, context: Context) -> None:
        self._filter = context.event_filter
        self.series: dict[tuple[str, str, str, str], _Series] = {}
        self.flags: dict[tuple[str, str, str], FlagRow] = {}
        self._blocks: dict[tuple[str, str, str], _Block] = {}

    def reads(self) -> Mapping[type[Any], Handler]:
        return {Stats: self.stats, Vanishing: self.flag, Exploding: self.flag, Recovered: self.flag}

    def contribute(self, fields: dict[str, Any]) -> None:
        fields["health"], fields["health_flags"] = self.rows()

    def stats(self, event: Stats, run: RunState, record: Record) -> None:
        rule, scope, figures, step = event.rule, event.scope, event.figures, event.step
        if run.replica or not self._filter.shown(step, rule):  # another rank's figures of the same gradient
            return
        keep = self._filter.params
        for stat, values in figures.items():
            if scope == "group":
                if isinstance(values, dict):
                    raise Malformed(f"gradguard 'stats' event whose {stat!r} figures are per name at scope group")
                if keep is None:  # a rule's joint figure is not one parameter's
                    self._add((rule, scope, rule, stat), as_float(values), step)
                continue
            if not isinstance(values, dict):
                raise Malformed(f"gradguard 'stats' event whose {stat!r} figures are not per name")
            block = self._blocks.get((rule, scope, stat))
            names = list(values)
            if block is None or block.names != names:
                if block is not None:
                    block.flush()
                block = self._blocks[(rule, scope, stat)] = self._block(rule, scope, stat, names, values, step)
                continue
            figures_row: Iterable[float | str] = values.values()
            if keep is not None:
                listed = list(figures_row)
                figures_row = [listed[index] for index in block.kept]
            try:
                row = block.pack(*figures_row)
            except struct.error:  # "NaN", "Infinity", "-Infinity"
                row = block.pack(*[as_float(value) for value in figures_row])
            block.add(row, step)

    def _block(self, rule: str, scope: str, stat: str, names: list[str], values: dict[str, Any], step: int) -> _Block:
        """A new block for these names; their first figures (this event's) go straight to their series."""
        keep = self._filter.params
        kept = [index for index, name in enumerate(names) if keep is None or keep(name)]
        series = []
        for index in kept:
            name = names[index]
            self._add((rule, scope, name, stat), as_float(values[name]), step)
            series.append(self.series[(rule, scope, name, stat)])
        return _Block(names, series, kept)

    def flush(self) -> None:
        """Add every gathered figure to its series."""
        for block in self._blocks.values():
            block.flush()

    def _add(self, key: tuple[str, str, str, str], value: float, step: int) -> None:
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = _Series(value, step)
        series.add(value, step)

    def flag(self, event: Vanishing | Exploding | Recovered, run: RunState, record: Record) -> None:
        kind, rule, name, step = event_name(type(event)), event.rule, event.name, event.step
        norm = as_float(event.norm)
        threshold = None if isinstance(event, Recovered) else as_float(event.threshold)
        if (
            run.replica
            or not self._filter.shown(step, rule)
            or (self._filter.params is not None and not self._filter.params(name))
        ):
            return
        if kind == "recovered":
            assert isinstance(event, Recovered)
            row = self.flags.get((rule, name, event.was))
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
        self.flush()
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
