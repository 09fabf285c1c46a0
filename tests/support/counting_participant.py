"""A participant written as an exercise (issue 43): it counts the steps it sees and vetoes one. It is this one module
and one registration; the step's pipeline knows nothing of it."""

from __future__ import annotations

from gradguard.enforce.step.participants import Parts
from gradguard.enforce.work.participant import Participant, Ruling, clear_gradients
from gradguard.enforce.work.step_work import StepContext, StepPlan, StepWork

NAME = "counting_veto"


class CountingVeto(Participant):
    """Counts every step it sees (opened, applied) and vetoes the update of step ``veto``."""

    def __init__(self, veto: int) -> None:
        self.veto = veto
        self.opened: list[int] = []
        self.applied_steps: list[int] = []
        self.vetoed: list[int] = []

    def opens(self, step: int, plan: StepPlan, context: StepContext) -> bool:
        self.opened.append(step)
        return True

    def ruling(self, work: StepWork, context: StepContext) -> Ruling | None:
        if work.step != self.veto:
            return None

        def veto() -> bool:
            self.vetoed.append(work.step)
            clear_gradients(context)
            return True

        return Ruling(veto)

    def applied(self, work: StepWork) -> None:
        self.applied_steps.append(work.step)


def factory_for(made: list[CountingVeto], veto: int):  # type: ignore[no-untyped-def]
    """A registration's factory: each guard gets its own participant, kept in ``made`` for the test to read."""

    def build(parts: Parts) -> CountingVeto:
        participant = CountingVeto(veto)
        made.append(participant)
        return participant

    return build
