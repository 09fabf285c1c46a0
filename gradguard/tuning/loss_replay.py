"""The replay of a policy's ``loss`` section (``gradguard.tuning.replay``): the guard's own ``LossWatch`` on the
recorded losses.

Each recorded step's loss (``RecordedStep.loss``) is judged as the guard judges it, before any other verdict of
the step, and enters the reference only where the replay applies the step. The verdicts are listed as rule
``loss``, actions ``spike`` and ``nonfinite``: the guard's counters. A log without a loss lists the section as
undecidable.
"""

from __future__ import annotations

from typing import Final

from gradguard.enforce.triggers.loss_reference import LossReference, LossVerdict
from gradguard.policy.schema import Loss
from gradguard.tuning.records import RecordedStep

__all__ = ["NO_LOSS", "LossReplay"]

"""The rule name the ``loss`` section's verdicts are listed (and counted by the guard) under."""
NO_LOSS: Final = (
    "the log holds no loss: its stats events carry none (the guard records the step's loss beside the norms a "
    "monitor writes, where it sees the loss: docs/policy-reference.md#the-loss-section)"
)


class LossReplay:
    """The ``loss`` section of a replayed policy (``config``; ``None``: the policy has none)."""

    def __init__(self, config: Loss | None) -> None:
        self.config = config
        self.watch = LossReference()
        self.steps: dict[str, list[int]] = {}
        """Verdict -> the steps it was given on: ``nonfinite`` (always watched by a section), ``spike`` (where
        configured)."""
        if config is not None:
            self.steps["nonfinite"] = []
            if config.spike is not None:
                self.steps["spike"] = []

    def judge(self, recorded: RecordedStep) -> LossVerdict | None:
        """The section's verdict on the step's recorded loss, as the guard's (before any other verdict of the step)."""
        if self.config is None or recorded.loss is None:
            return None
        return self.watch.judge(self.config, recorded.loss, recorded.step)

    def applied(self, recorded: RecordedStep) -> None:
        """The replay applies the step: its loss enters the reference, as the guard's ``accept``."""
        self.watch.accept(self.config, recorded.loss)

    def given(self, verdict: LossVerdict, step: int) -> None:
        """Note the verdict at ``step`` (it takes effect: no gradient halt came first)."""
        self.steps[verdict.kind].append(step)
