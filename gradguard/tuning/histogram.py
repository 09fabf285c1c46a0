"""A bounded summary of many positive numbers: counts of ``ln(x)`` in bins 1% wide.

Gradient norms are log-normal-ish, so their logarithms are what is summarised. A bin is
``BIN_WIDTH`` wide in ``ln(x)`` (a 1% step in ``x``), and only bins that hold a value exist:
float32's positive range spans about 19,000 of them, so a histogram stays bounded however many values
it takes, and histograms add (families merge by adding theirs). Medians, median absolute deviations
and quantiles read from it are exact to half a bin (0.5% of the value).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

__all__ = ["BIN_WIDTH", "LogHistogram", "round_up", "yaml_float"]

BIN_WIDTH: Final = 0.01
"""Width of a bin in ``ln(x)``."""


@dataclass
class LogHistogram:
    """Counts of ``ln(x)`` per bin, for finite ``x > 0``."""

    counts: dict[int, int] = field(default_factory=dict)
    total: int = 0

    def add(self, value: float) -> None:
        """Count one finite positive value (the caller leaves out zeros and non-finite values)."""
        key = math.floor(math.log(value) / BIN_WIDTH)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.total += 1

    def add_counts(self, counts: Mapping[int, int], total: int) -> None:
        """Count values already binned: ``counts`` of each bin (keys as ``add`` makes them), ``total`` in all."""
        mine = self.counts
        for key, count in counts.items():
            mine[key] = mine.get(key, 0) + count
        self.total += total

    def merged(self, others: Iterable[LogHistogram]) -> LogHistogram:
        """A new histogram holding this one's counts and the others'."""
        out = LogHistogram(dict(self.counts), self.total)
        for other in others:
            for key, count in other.counts.items():
                out.counts[key] = out.counts.get(key, 0) + count
            out.total += other.total
        return out

    def shifted(self, bins: int) -> LogHistogram:
        """A copy with every value divided by ``e^(bins x BIN_WIDTH)`` (its bins moved down by ``bins``)."""
        return LogHistogram({key - bins: count for key, count in self.counts.items()}, self.total)

    def quantile(self, level: float, *, upper: bool = False, at_most: float | None = None) -> float:
        """The ``level`` quantile of ``ln(x)``: the centre of the bin holding it, or its upper edge with ``upper``.

        ``at_most`` leaves out the values whose ``ln`` is above it (anomalies, for a quantile of the ordinary ones).
        """
        keys = sorted(self.counts)
        if at_most is not None:
            keys = [key for key in keys if key * BIN_WIDTH <= at_most]
        total = sum(self.counts[key] for key in keys)
        if total == 0:
            raise ValueError("a quantile of no values")
        rank = min(total - 1, max(0, math.ceil(level * total) - 1))
        seen = 0
        for key in keys:
            seen += self.counts[key]
            if seen > rank:
                return (key + (1.0 if upper else 0.5)) * BIN_WIDTH
        raise AssertionError("unreachable: the rank is below the total")

    def median(self) -> float:
        """The median of ``ln(x)`` (a bin's centre)."""
        return self.quantile(0.5)

    def mad(self, centre: float) -> float:
        """The median absolute deviation of ``ln(x)`` from ``centre`` (bins taken at their centres)."""
        distances: dict[float, int] = {}
        for key, count in self.counts.items():
            distance = abs((key + 0.5) * BIN_WIDTH - centre)
            distances[distance] = distances.get(distance, 0) + count
        half = (self.total + 1) // 2
        seen = 0
        for distance in sorted(distances):
            seen += distances[distance]
            if seen >= half:
                return distance
        return 0.0


def round_up(value: float) -> float:
    """``value`` rounded up to three significant digits (a threshold is never lowered by rounding)."""
    text = f"{value:.3g}"
    rounded = float(text)
    if rounded < value:
        exponent = math.floor(math.log10(value)) - 2
        rounded = float(f"{rounded + 10.0**exponent:.3g}")
    return rounded


def yaml_float(value: float) -> str:
    """A float as YAML reads it back as a float (PyYAML wants a dot and a signed exponent)."""
    text = f"{value:.3g}"
    mantissa, _, exponent = text.partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    return f"{mantissa}e{exponent}" if exponent else mantissa
