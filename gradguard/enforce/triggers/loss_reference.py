"""The ``loss`` section's judgement on plain floats: the verdict on a step's loss, and the reference it is judged by.

The reference is the median of the last ``window`` applied steps' losses; a NaN/Inf loss is ``loss.nonfinite``'s to
act on, and a loss above ``factor`` x the reference is a spike, whose skips escalate to a halt past the section's
limits. No tensor here, and no torch: the guard's ``LossWatch`` (``gradguard.enforce.triggers.loss``, which learns the
loss from the roots of ``backward()``) is a ``LossReference``, and ``gradguard replay`` judges recorded losses with the
same code in a process that never imports torch.
"""

from __future__ import annotations

import math
import statistics
import struct
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from gradguard.enforce.work.skips import SkipHistory
from gradguard.policy.schema import Loss

__all__ = ["LossReference", "LossVerdict"]


@dataclass(frozen=True)
class LossVerdict:
    """What the ``loss`` section says of a step's loss."""

    kind: str
    """``nonfinite`` or ``spike``."""
    action: str
    """``halt``, ``skip`` or ``ignore``."""
    loss: float
    reference: float | None = None
    factor: float | None = None
    escalation: str | None = None
    """Why a skip became a halt (its limits), or None."""

    @property
    def halt_kind(self) -> str:
        """The halt's ``kind``: ``nan``, ``inf`` or ``spike``."""
        if self.kind == "spike":
            return "spike"
        return "nan" if self.loss != self.loss else "inf"

    @property
    def reason(self) -> str:
        """A halt's reason, in the guard's words (the live halt and ``gradguard replay`` say the same)."""
        if self.kind == "spike":
            why = f"loss {self.loss:.6g} above {self.factor:g} x the reference {self.reference:.6g}"
        else:
            why = f"the loss is {self.loss}"
        return why if self.escalation is None else f"{why}; skip limit exceeded: {self.escalation}"


class LossReference:
    """The reference a step's loss is judged by (the last applied steps' losses), and the spike's skips."""

    def __init__(self) -> None:
        self.history: deque[float] = deque()
        """The losses of the last applied steps (at most the spike's ``window``)."""
        self.seen = 0
        """How many applied steps' losses have entered the history."""
        self.skips = SkipHistory()
        """The spike's skips: in a row, and at which recent steps (its ``max_consecutive_skips``, ``max_skips``)."""

    def judge(self, config: Loss, loss: float, step: int) -> LossVerdict | None:
        """The section's verdict on ``loss``, or None: the step's loss is fine."""
        verdict = self.peek(config, loss)
        return None if verdict is None else self._escalated(verdict, config, step)

    def peek(self, config: Loss | None, loss: float | None) -> LossVerdict | None:
        """The verdict on ``loss`` before its skip limits, changing nothing (for the ``rerun`` section)."""
        if config is None or loss is None:
            return None
        if not math.isfinite(loss):
            return LossVerdict("nonfinite", config.nonfinite, loss)
        spike = config.spike
        if spike is None or self.seen < max(spike.warmup, 1) or not self.history:
            return None
        reference = statistics.median(self.history)
        if reference <= 0 or loss <= spike.factor * reference:
            return None  # a spike is a loss far above a positive reference
        return LossVerdict("spike", spike.action, loss, reference, spike.factor)

    def spike_limit(self, config: Loss) -> float | None:
        """The largest float32 loss ``peek`` would find no spike in now (None: it looks for none now), rounded down:
        a float32 loss at most this is at most ``factor`` times the reference in any precision."""
        spike = config.spike
        if spike is None or self.seen < max(spike.warmup, 1) or not self.history:
            return None
        reference = statistics.median(self.history)
        if reference <= 0:
            return None
        return _float32_at_most(spike.factor * reference)

    def _escalated(self, verdict: LossVerdict, config: Loss, step: int) -> LossVerdict:
        """A skip past the spike section's limits (``max_consecutive_skips``, ``max_skips``) is a halt."""
        if verdict.action != "skip":
            return verdict
        self.skips.note(step)
        spike = config.spike
        if spike is None:
            return verdict
        reason = self.skips.exceeded(spike, step, "loss skips")
        if reason is None:
            return verdict
        return LossVerdict(verdict.kind, "halt", verdict.loss, verdict.reference, verdict.factor, reason)

    def accept(self, config: Loss | None, loss: float | None) -> None:
        """An applied step: its loss (where seen and finite) enters the reference; skips are no longer in a row."""
        self.skips.consecutive = 0
        if config is None:
            return
        if loss is None or not math.isfinite(loss):
            return
        window = config.spike.window if config.spike is not None else 1
        self.history.append(loss)
        while len(self.history) > window:
            self.history.popleft()
        self.seen += 1

    # --- state ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self.history),
            "seen": self.seen,
            "consecutive": self.skips.consecutive,
            "recent": list(self.skips.recent),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = deque(float(value) for value in state.get("history", ()))
        self.seen = int(state.get("seen", len(self.history)))
        recent = deque(int(step) for step in state.get("recent", ()))
        self.skips = SkipHistory(int(state.get("consecutive", 0)), recent)


_FLOAT32_MAX: Final = 3.4028234663852886e38
"""float32's largest finite value (``torch.finfo(torch.float32).max``; a test holds them equal)."""


def _float32_at_most(value: float) -> float:
    """The largest float32 not above ``value`` (a positive float): a bound a float32 comparison keeps exactly."""
    # struct, not a float32 tensor and .item(): this runs at every step, where a tensor made from Python data and
    # read back counts as the step's device traffic (tests/test_loss_section.py counts it).
    if value >= _FLOAT32_MAX:
        return _FLOAT32_MAX
    rounded: float = struct.unpack("<f", struct.pack("<f", value))[0]  # to nearest
    if rounded <= value:
        return rounded
    below: float = struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", rounded))[0] - 1))[0]
    return below
