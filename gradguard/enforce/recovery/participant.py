"""Recovery as a participant of the step: a snapshot at the step's first boundary when one is due, the steps of a
rewind's window skipped unread, the host copy of a snapshot carried on after each read, and every applied update
counted (``guard.applied_steps``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gradguard.enforce.recovery.recovery import Recovery
from gradguard.enforce.work.participant import Participant
from gradguard.enforce.work.step_work import StepContext, StepPlan, StepWork

if TYPE_CHECKING:
    from gradguard.policy.document import Policy

__all__ = ["AppliedCount", "RecoveryTakingPart"]


class RecoveryTakingPart(Participant):
    def __init__(self, recovery: Recovery, policy: Callable[[], Policy]) -> None:
        self.recovery, self._policy = recovery, policy

    def opens(self, step: int, plan: StepPlan, context: StepContext) -> bool:
        recovery = self.recovery
        recovery.config = self._policy().recovery  # a reload may have changed it
        return not (recovery.active and recovery.begin_step(step))  # a rewind's window: skipped, its gradients unread

    def after_read(self, work: StepWork, context: StepContext) -> None:
        self.recovery.after_read()  # a snapshot's copy to the host goes on in a chunk that ends before the next read

    def applied(self, work: StepWork) -> None:
        self.recovery.applied_step(work.step)

    def release(self) -> None:
        self.recovery.release()


class AppliedCount(Participant):
    """Recovery's part where the policy has no ``recovery`` section: every applied update counted
    (``guard.applied_steps``), and nothing else. Without the section no snapshot is due, no rewind's window is open
    and no host copy is in flight (a reload that takes the section out gives them back, ``Recovery.reconfigure``,
    then builds this in ``RecoveryTakingPart``'s place), so ``opens`` and ``after_read`` would do nothing: they are
    not taken part in, and cost no call a step."""

    def __init__(self, recovery: Recovery) -> None:
        self.recovery = recovery

    def applied(self, work: StepWork) -> None:
        self.recovery.applied_step(work.step)

    def release(self) -> None:
        self.recovery.release()
