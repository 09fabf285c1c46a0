"""The first pass of ``gradguard suggest``: every family's histogram of ``ln(norm)``, one recorded step at a time.

Each recorded norm is folded into its family's ``LogHistogram`` (bounded: memory does not grow with the log's
length), and each member's into its own; families (``gradguard.tuning.families``) are made as names are first seen.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from gradguard.tuning.blocks import stacked
from gradguard.tuning.families import Family, family_key
from gradguard.tuning.histogram import BIN_WIDTH, LogHistogram

__all__ = ["NormSummary"]


@dataclass
class NormSummary:
    """The first pass: every family's histogram of ``ln(norm)``, built one recorded step at a time."""

    families: dict[str, Family] = field(default_factory=dict)
    names: dict[str, Family] = field(default_factory=dict)
    """Parameter name -> its family, in the order first seen."""

    _block_names: list[str] = field(default_factory=list)
    _values: array[float] = field(default_factory=lambda: array("d"))
    """The gathered steps' norms, row after row (``_block_names`` in each)."""
    _left_out: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Parameter name -> its zero and non-finite norms, so a member taken apart (``take_apart``) takes its own."""

    def take_apart(self, name: str) -> Family:
        """``name`` out of its family, as a family of its own (a tensor the run's policy clipped hard)."""
        family = self.names[name]
        family.members.discard(name)
        own = family.by_member.pop(name, LogHistogram())
        family.histogram = LogHistogram().merged(family.by_member.values())
        zeros, nonfinite = self._left_out.get(name, (0, 0))
        family.zeros, family.nonfinite = family.zeros - zeros, family.nonfinite - nonfinite
        if not family.members:
            del self.families[family.keys[0]]
        apart = Family([name], {name}, LogHistogram().merged([own]), {name: own}, zeros, nonfinite)
        self.names[name] = apart
        return apart

    def add(self, norms: dict[str, float]) -> None:
        """One recorded step's norms; they are counted a block of steps at a time (``flush``)."""
        names = list(norms)
        if names != self._block_names:
            self.flush()
            self._block_names = names
            for name in names:
                if name not in self.names:
                    key = family_key(name)
                    family = self.families.get(key)
                    if family is None:
                        family = self.families[key] = Family([key])
                    family.members.add(name)
                    self.names[name] = family
        self._values.extend(norms.values())
        if len(self._values) >= _HISTOGRAM_STEPS * len(names):
            self.flush()

    def flush(self) -> None:
        """Count the gathered steps' norms, every member's column at once (binned as ``LogHistogram.add`` bins).

        ``ln`` is numpy's float64 logarithm, which can be an ulp away from ``math.log``: enough to move a norm on a
        bin's edge into the next bin, so the few within a millionth of a bin of an edge are binned again with
        ``math.log``, and the histograms are those ``LogHistogram.add`` makes (whichever library takes the logarithm:
        no torch, so ``gradguard suggest`` starts without it). One ``unique`` over
        ``(column, bin)`` pairs counts the whole block.
        """
        if not self._values:
            return
        values = stacked(self._values, len(self._block_names))
        self._values = array("d")
        positive = (values > 0.0) & (values < math.inf)
        zeros: list[int] = (values == 0.0).sum(axis=0).tolist()
        counted: list[int] = positive.sum(axis=0).tolist()
        steps = values.shape[0]
        for name, zero, count in zip(self._block_names, zeros, counted, strict=True):
            family = self.names[name]
            family.zeros += zero
            family.nonfinite += steps - count - zero
            before = self._left_out.get(name, (0, 0))
            self._left_out[name] = (before[0] + zero, before[1] + steps - count - zero)
        if not any(counted):
            return
        kept = values[positive]
        scaled = np.log(kept) / BIN_WIDTH
        edge = np.flatnonzero(np.abs(scaled - np.round(scaled)) < 1e-6)
        if len(edge):
            scaled[edge] = [math.log(value) / BIN_WIDTH for value in kept[edge].tolist()]
        keys = np.floor(scaled).astype(np.int64)
        columns = np.nonzero(positive)[1]
        low = int(keys.min())
        span = int(keys.max()) - low + 1
        pairs, counts = np.unique(columns * span + (keys - low), return_counts=True)
        by_column: dict[int, dict[int, int]] = {}
        for pair, count in zip(pairs.tolist(), counts.tolist(), strict=True):
            column, key = divmod(pair, span)
            by_column.setdefault(column, {})[key + low] = count
        for column, binned in by_column.items():
            name = self._block_names[column]
            family = self.names[name]
            own = family.by_member.get(name)
            if own is None:
                own = family.by_member[name] = LogHistogram()
            own.add_counts(binned, counted[column])
            family.histogram.add_counts(binned, counted[column])


_HISTOGRAM_STEPS: Final = 512
"""Recorded steps gathered before their norms are counted: 512 x 300 tensors is 1.2 MB of float64, and the
binning's temporaries stay small enough that the peak is flat in the log's length (2,048 steps grew it)."""
