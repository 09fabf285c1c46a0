"""The one interface every action family implements for the step engine.

An action family says what it needs from the step (``ActionKernel.wants_raw_norm``), what it
observes of the gradients as they arrive (``ActionKernel.observe``, before any action), what it does
to the gradients (``ActionKernel.apply``, batched on the device) and what it reports (by queueing
device figures into ``work.pending`` with a reader that records into ``work.outcome``). The engine
gathers what all actions need, runs them in policy order and reads every figure back in the step's
one host transfer.

Adding an action means adding its schema to ``gradguard.policy.schema`` and one kernel here.
"""

from __future__ import annotations

from typing import ClassVar

from gradguard.enforce.work.step_work import StepWork
from gradguard.policy.matching import BoundRule
from gradguard.policy.schema import Action

__all__ = ["ActionKernel"]


class ActionKernel:
    """How one action family acts at the step boundary. Kernels are stateless; one instance serves all."""

    schemas: ClassVar[tuple[type[Action], ...]] = ()
    """The policy schema classes this kernel executes."""
    watches: ClassVar[bool] = False
    """The action only watches for NaN/Inf (halt, skip): its verdict comes with the raw norms, and
    ``apply`` is never called for it."""
    observes: ClassVar[bool] = False
    """The action only observes the gradient as it arrives (``monitor``): on the steps where
    ``samples`` is true, the engine calls ``observe`` before any action of any rule runs (after
    the raw 2-norms are taken, which it may reuse); ``apply`` is never called for it, it never
    counts as a change to the gradient, and steps it does not sample cost it nothing."""

    alarms: ClassVar[bool] = False
    """Whatever its reader will do before the update, the action raises an alarm for (``Pending.quiet_if``): the step's
    read may then wait for a fused optimizer's update (``gradguard.enforce.step.fused_update``)."""

    def wants_raw_norm(self, action: Action) -> bool:
        """Whether the action can use the 2-norm of each gradient as it arrived (shared, taken once)."""
        return False

    def may_hold(self, action: Action) -> bool:
        """Whether the action can hold its change to a tensor for the step's read when the tensor's one later change
        is a group clip (``StepWork.held``): it then changes nothing on the device before the read."""
        return False

    def may_erase_nonfinite(self, action: Action) -> bool:
        """Whether the action can make a NaN/Inf gradient finite (so the watch must judge it before)."""
        return False

    def samples(self, action: Action, step: int) -> bool:
        """Whether an observing action takes its figures at ``step``."""
        return action.active_at(step)

    def observe(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> None:
        """Queue figures of the gradients of ``ids`` as they arrived (only for ``observes`` kernels)."""
        raise NotImplementedError

    def apply(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> bool:
        """Act on the gradients of tensors ``ids`` (members of ``bound`` with a gradient this step).

        Returns ``False`` when the rule's later actions have nothing left to act on (``drop``).
        """
        raise NotImplementedError
