"""The one protocol through which a feature takes part in the step: ``Participant``.

The step (``enforce.step.pipeline``) runs the same stages every time: gather the gradients, open the step, queue
the device work, read once, rule, report. A participant (the loss watch, the re-run, recovery, the GradScaler
watch, the provenance trace, a fused optimizer's read-after) overrides the stages it needs and nothing else; the
pipeline calls, at each stage, only the participants that override it, in the order they were registered
(``enforce.step.participants``). Each stage gets the data it needs passed in; a participant holds what it needs
across steps itself and never reaches back into the pipeline.

A ruling is what a participant concludes about the update from the read: ``Ruling.decide`` runs after the
gradients' own verdict (a halt of the gradients comes first) and returns True to skip the update, or raises
[`GradientHalt`][gradguard.GradientHalt]; a ``final`` ruling means the step is another's to decide (a GradScaler
that found inf skips the update itself), and no other ruling or verdict is taken.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gradguard.enforce.work.step_work import StepContext, StepPlan, StepWork

__all__ = ["STAGES", "Participant", "Ruling", "clear_gradients"]

STAGES = (
    "boundary",
    "opens",
    "passed",
    "before_figures",
    "beside_actions",
    "after_actions",
    "defers_read",
    "after_read",
    "ruling",
    "applied",
    "halted",
    "release",
)
"""The stages a participant may take part in, in the order a step meets them (``release``: the guard is removed)."""


@dataclass(frozen=True)
class Ruling:
    """A participant's word on the update, taken after the step's read."""

    decide: Callable[[], bool]
    """Run after the gradients' own verdict: True skips the update (the pipeline then clears the gradients); a halt
    raises."""
    final: bool = False
    """The step is another's to decide (its ``decide`` returns the step's verdict): nothing else is judged."""


def clear_gradients(context: StepContext) -> None:
    """Skip the update: no gradient is left for the optimizer, so nothing it owns can change."""
    for param in context.stepped_params():
        param.grad = None


class Participant:
    """A feature's part in the step. Every stage is a no-op here; a participant overrides the ones it takes part in
    (the pipeline calls only those)."""

    def boundary(self, context: StepContext) -> None:
        """A boundary is met, before its gradients are gathered (it may find none to treat)."""

    def opens(self, step: int, plan: StepPlan, context: StepContext) -> bool:
        """The step ``step`` begins with ``plan`` (what it treats; its gradients gathered, none read yet). False: the
        step lies in a window whose updates are skipped unread (a rewind's)."""
        return True

    def passed(self, context: StepContext) -> None:
        """The step was skipped unread (some participant's ``opens`` said so): forget what it began."""

    def before_figures(self, work: StepWork, context: StepContext) -> None:
        """Queue device work before the actions' figures (flags the actions' readers must see first)."""

    def beside_actions(self, work: StepWork) -> None:
        """Queue device work beside the actions' (after the monitors' figures: ``work.sampled`` is known)."""

    def after_actions(self, work: StepWork) -> None:
        """Queue device work after every action (its reader sees the step's non-finite verdict)."""

    def defers_read(self, work: StepWork, context: StepContext, conclude: Callable[[], bool]) -> bool:
        """Take the read and the verdict (``conclude``) later, after the optimizer's update; True: taken."""
        return False

    def after_read(self, work: StepWork, context: StepContext) -> None:
        """The read is done and its changes made: conclude what needs no verdict yet (may raise a halt)."""

    def ruling(self, work: StepWork, context: StepContext) -> Ruling | None:
        """What this participant rules about the update, or None: nothing."""
        return None

    def applied(self, work: StepWork) -> None:
        """The update goes ahead: what the step showed becomes the participant's state across steps."""

    def halted(self, work: StepWork) -> None:
        """The step's verdict is a halt (the gradients' or a ruling's; a halt raised in ``after_read``, the rerun's,
        does not come here): the run stops at this step."""

    def release(self) -> None:
        """The guard is removed: give back every tensor held across steps."""

    def stages(self) -> frozenset[str]:
        """The stages this participant overrides (the pipeline calls it at those only)."""
        mine = type(self)
        return frozenset(stage for stage in STAGES if getattr(mine, stage) is not getattr(Participant, stage))
