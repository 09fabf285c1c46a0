"""``gradguard suggest`` counts a block of norms at once in torch, and its histograms are exactly those
``LogHistogram.add`` makes one norm at a time with ``math.log``, also for norms on a bin's edge (where
torch's logarithm, an ulp away from ``math.log`` on some values, would move a norm into the next bin)."""

from __future__ import annotations

import math

from gradguard.tuning.histogram import BIN_WIDTH, LogHistogram
from gradguard.tuning.suggest import NormSummary

ON_AN_EDGE = 3714.5023825112958
"""A norm whose bin torch's float64 ``log`` and ``math.log`` disagree on (AVX-512, torch 2.13): 821 or 822."""


def _around_every_edge(low: int, high: int) -> list[float]:
    """The doubles a few ulps either side of each bin edge ``e^(k x BIN_WIDTH)`` for ``low <= k < high``."""
    values = []
    for k in range(low, high):
        x = math.exp(k * BIN_WIDTH)
        for _ in range(3):
            x = math.nextafter(x, 0.0)
        for _ in range(7):
            values.append(x)
            x = math.nextafter(x, math.inf)
    return values


def test_suggest_bins_every_norm_as_a_log_histogram_does_even_on_a_bin_s_edge() -> None:
    values = [ON_AN_EDGE, *_around_every_edge(-2500, 2500), 0.0, math.nan, math.inf, -1.0, 5e-324]
    summary = NormSummary()
    for value in values:
        summary.add({"blocks.0.w": value})
    summary.flush()
    expected = LogHistogram()
    for value in values:
        if 0.0 < value < math.inf:
            expected.add(value)
    family = summary.names["blocks.0.w"]
    assert family.by_member["blocks.0.w"].counts == expected.counts
    assert family.histogram.counts == expected.counts
    assert family.histogram.total == expected.total == len(values) - 4
    assert family.zeros == 1
    assert family.nonfinite == 3, "NaN, inf and a negative value are not counted as norms"
