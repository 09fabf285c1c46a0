"""``gradguard suggest``'s ``loss`` section: a ``spike.factor`` from a recorded run's losses.

The guard's reference is the median of the last ``window`` applied steps' losses (``gradguard.enforce.triggers.loss``),
and a falling loss makes the whole run's median a poor one: the early losses are far above the late ones. So
``LossRatios`` walks the recorded losses in step order and measures each against the median of the last
``window`` (``LOSS_WINDOW``, 100) losses before it, as the guard will, once ``LOSS_WARMUP`` (20) have been seen
(the proposed ``warmup``; until ``window`` have been seen the reference is the median of those there are, as the
guard's is). A loss above ``SPIKE_FACTOR`` x its reference, a NaN/Inf or non-positive loss never enters
the reference (the guard's reference leaves spikes and skipped steps out too).

The factor follows the norms' rule (``gradguard.tuning.suggest``) on the ratios ``ln(loss / reference)``, pooled
in a ``LogHistogram``: the largest of ``e^(z x spread)`` (spread: ``1.4826 x MAD`` of the ratios, at least
``MIN_SPREAD``), ``MIN_FACTOR`` and the ``1 - budget`` quantile of the ordinary ratios (below ``e^(2 z x
spread)`` and below ``SPIKE_FACTOR``), and never above ``SPIKE_FACTOR``: a loss ten times its reference is a
spike however noisy the run, so a loss 20x its reference is always caught, and an ordinary step is not.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from gradguard.tuning.histogram import BIN_WIDTH, LogHistogram, round_up, yaml_float

__all__ = [
    "LOSS_MAX_CONSECUTIVE_SKIPS",
    "LOSS_WARMUP",
    "LOSS_WINDOW",
    "LossFactor",
    "LossRatios",
    "loss_factor",
    "loss_lines",
]

LOSS_WINDOW: Final = 100
"""The proposed ``window``: the guard's default."""
LOSS_WARMUP: Final = 20
"""The proposed ``warmup``. Not the window's 100: the guard judges no loss before ``warmup`` have entered its
reference, so a warm-up of 100 leaves the first 100 steps unwatched (a spike at step 80 of a 200-step run went
through). A median of 20 losses is steady enough, and a falling loss sits below the median of the higher losses
before it, so an early reference flags no ordinary step; the factor is learned on the same ratios."""
LOSS_MAX_CONSECUTIVE_SKIPS: Final = 3
"""More loss skips in a row than this halt the run (the loss stays high: not a spike, a change)."""


class LossRatios:
    """Each recorded loss against the median of the ``window`` losses before it (see the module), one at a time."""

    def __init__(self, window: int = LOSS_WINDOW, warmup: int = LOSS_WARMUP) -> None:
        self.window = window
        self.warmup = min(warmup, window)
        self.ratios = LogHistogram()
        """``loss / reference`` of every step measured (anomalies included; the quantile leaves them out)."""
        self.losses = 0
        self.nonfinite = 0
        self.nonpositive = 0
        self.largest: tuple[float, int] | None = None
        """The largest ``loss / reference`` and its step."""
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []

    def add(self, step: int, loss: float, spike_factor: float) -> None:
        self.losses += 1
        if not math.isfinite(loss):
            self.nonfinite += 1
            return
        if loss <= 0:
            self.nonpositive += 1
            return
        if self._recent and len(self._recent) >= self.warmup:
            ordered = self._sorted
            middle = len(ordered) // 2
            reference = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
            if reference > 0:
                ratio = loss / reference
                self.ratios.add(ratio)
                if self.largest is None or ratio > self.largest[0]:
                    self.largest = (ratio, step)
                if ratio > spike_factor:
                    return  # an anomaly: it does not enter the reference
        self._recent.append(loss)
        bisect.insort(self._sorted, loss)
        if len(self._recent) > self.window:
            self._sorted.pop(bisect.bisect_left(self._sorted, self._recent.popleft()))


_NONFINITE_WORDS: Final = {
    "skip": "A NaN/Inf loss skips the step, as a spike does",
    "halt": "A NaN/Inf loss halts the run, as the run's policy did",
    "ignore": "A NaN/Inf loss is let through, as the run's policy did",
}


@dataclass
class LossFactor:
    """The proposed ``loss.spike.factor`` and the figures behind it (``ln`` of ``loss / reference``)."""

    ratios: LossRatios
    centre: float
    spread: float
    level: float
    quantile: float
    factor: float
    bound_by: str
    """Which bound set ``factor``: ``spread``, ``factor`` (``MIN_FACTOR``) or ``quantile``."""
    spikes: list[int] = field(default_factory=list)
    """The recorded steps the replay flagged as spikes."""
    nonfinite: list[int] = field(default_factory=list)
    """The recorded steps the replay found a NaN/Inf loss at."""


def loss_factor(
    ratios: LossRatios, *, budget: float, z: float, min_spread: float, min_factor: float, spike_factor: float
) -> LossFactor:
    """The factor of ``ratios`` by the norms' rule (the module's docstring); ``ratios`` holds at least one."""
    histogram = ratios.ratios
    centre = histogram.median()
    spread = max(1.4826 * histogram.mad(centre), min_spread)
    ceiling = math.log(spike_factor)
    level = 1.0 - budget
    ordinary = min(2.0 * z * spread, ceiling)
    quantile = histogram.quantile(level, upper=True, at_most=ordinary) if _any_below(histogram, ordinary) else 0.0
    bounds = {"spread": min(z * spread, ceiling), "factor": math.log(min_factor), "quantile": min(quantile, ceiling)}
    bound_by = max(bounds, key=lambda key: bounds[key])
    factor = min(round_up(math.exp(bounds[bound_by])), spike_factor)
    return LossFactor(ratios, centre, spread, level, quantile, factor, bound_by)


def _any_below(histogram: LogHistogram, at_most: float) -> bool:
    return any(key * BIN_WIDTH <= at_most for key in histogram.counts)


def loss_lines(
    found: LossFactor | None,
    ratios: LossRatios,
    steps: str | None,
    *,
    z: float,
    spike_factor: float,
    least: int,
    nonfinite: str = "skip",
) -> list[str]:
    """The suggestion's ``loss:`` section with its comments (``steps``: where the replay flagged spikes, in words),
    or a comment saying why there is none."""
    window = ratios.window
    if found is None:
        if not ratios.losses:
            return ["# No loss section: the log holds no loss (the guard records it beside the monitor's norms)."]
        return [
            f"# No loss section: {ratios.ratios.total:,} losses measured against a reference of {window} earlier "
            f"ones (of {ratios.losses:,} recorded), fewer than {least}: too little evidence.",
        ]
    largest = ratios.largest
    peak = f"; the largest {largest[0]:.3g}x at step {largest[1]}" if largest is not None else ""
    left = ratios.nonfinite + ratios.nonpositive
    left_out = f"; {left:,} non-finite or non-positive left out" if left else ""
    if found.bound_by == "spread":
        why = f"e^({z:g} x {found.spread:.3g})"
    elif found.bound_by == "factor":
        why = "the least factor (the spread is small)"
    else:
        why = f"the {100.0 * found.level:.3g}% quantile of ordinary ratios"
    lines = [
        f"# The loss: each recorded loss against the median of the {window} before it (once {ratios.warmup} are "
        "there: the warm-up),",
        "# as the guard's reference (a falling loss leaves the whole run's median behind).",
        f"# {found.ratios.ratios.total:,} ratios{left_out}; median {math.exp(found.centre):.3g}x, spread "
        f"{found.spread:.3g}{peak}.",
        f"# factor: {found.factor:.3g} = {why}; never above {spike_factor:g}, so a loss 20x its reference is always "
        "a spike.",
        f"# {_NONFINITE_WORDS.get(nonfinite, 'A NaN/Inf loss: ' + nonfinite)}; more than {LOSS_MAX_CONSECUTIVE_SKIPS} "
        "loss skips in a row halt the run.",
    ]
    if steps is not None:
        lines.append(f"# On the recorded run it {steps}.")
    return [
        *lines,
        "loss:",
        f"  nonfinite: {nonfinite}",
        "  spike:",
        f"    factor: {yaml_float(found.factor)}",
        f"    window: {window}",
        f"    warmup: {ratios.warmup}",
        "    action: skip",
        f"    max_consecutive_skips: {LOSS_MAX_CONSECUTIVE_SKIPS}",
    ]
