"""The counters' summary as a participant: every ``summary_every`` steps, an applied step writes the cumulative
counters, so the log reproduces counts that are not logged per step."""

from __future__ import annotations

from collections.abc import Callable

from gradguard.enforce.work.participant import Participant
from gradguard.enforce.work.step_work import StepWork

__all__ = ["CounterSummary"]


class CounterSummary(Participant):
    def __init__(self, every: int, emit: Callable[[], None]) -> None:
        self.every, self._emit = every, emit

    def applied(self, work: StepWork) -> None:
        if self.every and (work.step + 1) % self.every == 0:
            self._emit()
