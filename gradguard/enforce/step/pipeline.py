"""The step, top to bottom: the stages every boundary runs, in order.

1. **gather** (``gather``): the gradients to treat, wherever they live; none: nothing to do.
2. **open**: the step's number (``StepBook.begin_step``); each participant may decline it (a rewind's window skips the
   update unread).
3. **device work** (``device_work``): the figures and changes the actions and participants queue on the device.
4. **the one read** (``Pending.sync``): everything the host needs, in one transfer; the changes it showed are needed
   are made (``DeferredWrites``). A participant may take the read and what follows until after the optimizer's
   update (a fused optimizer's).
5. **after the read**: the participants conclude what needs no verdict yet (a re-run, the monitors' figures).
6. **verdict**: the participants' rulings, the gradients' own verdict (``Verdicts``: a halt first), then a skip.
7. **report**: an applied step's figures become the state across steps; counters and events are written.

Each stage gets the data it needs passed in; what lasts across steps (the step count, which gradients were treated)
is the book's (``StepBook``), and what a feature adds is a participant's (``participants``).
"""

from __future__ import annotations

from gradguard.enforce.actions.overflow import clear_overflows
from gradguard.enforce.distributed.collective import Collective
from gradguard.enforce.plans.plan import Plan
from gradguard.enforce.recovery.decisions import RewindRequested
from gradguard.enforce.step.book import StepBook
from gradguard.enforce.step.device_work import queue_device_work
from gradguard.enforce.step.gather import gather
from gradguard.enforce.step.participants import Participants
from gradguard.enforce.step.verdicts import Verdicts
from gradguard.enforce.work.participant import Ruling, clear_gradients
from gradguard.enforce.work.step_work import Carry, StepContext, StepWork
from gradguard.enforce.work.tensors import without_grad
from gradguard.errors import GradientHalt, GuardStateError
from gradguard.policy.matching import Binding

__all__ = ["EMPTY_STAGE_REFUSED", "StepPipeline"]

EMPTY_STAGE_REFUSED = (
    "a pipeline stage with no gradient to treat at its first step (every guarded parameter frozen) is not "
    "built yet: the other stages wait for its verdict in their exchange, which it would never join. Guard a pipeline "
    "whose every stage trains a guarded parameter (unfreeze one, or match one with the policy)"
)


class StepPipeline:
    """Runs the stages for one guard; ``run`` is one step."""

    def __init__(
        self, book: StepBook, participants: Participants, verdicts: Verdicts, carry: Carry, collective: Collective
    ) -> None:
        self.book = book
        self.participants = participants
        self.verdicts = verdicts
        self.carry = carry
        self.collective = collective

    @without_grad
    def run(self, plan: Plan, context: StepContext, binding: Binding) -> bool:
        """Treat the current gradients of ``plan``'s tensors under ``binding``; False: the update must be skipped.

        Raises [`GradientHalt`][gradguard.GradientHalt] before the optimizer's step when the step halts (or, where
        the read waits for a fused update, from the optimizer's post-hook, with the update undone)."""
        participants, book = self.participants, self.book
        for participant in participants.at["boundary"]:
            participant.boundary(context)
        grads, wrapped, reduced = gather(plan, book.applied_versions, context)  # 1. gather
        book.last_run_treated = bool(grads)
        if not grads:
            if self.collective.pipeline is not None and not book.began:
                raise GuardStateError(EMPTY_STAGE_REFUSED)  # the other stages hear of it in their exchange's poll
            return True
        step = book.begin_step(grads)  # 2. open
        for participant in participants.at["opens"]:  # a loop, not all() over a generator: no call a participant
            if not participant.opens(step, plan, context):  # declined: the later ones are not asked
                clear_gradients(context)  # its update is skipped, its gradients unread
                for passed in participants.at["passed"]:
                    passed.passed(context)
                return False
        work = StepWork.begin(binding, plan.names, plan.fragile, grads, wrapped, step, self.collective, context)
        queue_device_work(plan, work, context, participants)  # 3. device work
        if reduced is not None:
            work.reduced = reduced
            reduced.watch(work.pending)  # whether an action changed a Partial gradient's reduced copy, in the read

        def conclude() -> bool:
            return self.conclude(work, context)

        for participant in participants.at["defers_read"]:
            if participant.defers_read(work, context, conclude):
                return True
        return conclude()

    @without_grad
    def conclude(self, work: StepWork, context: StepContext) -> bool:
        """The step's one read, what it shows, the verdict and the report."""
        late = self.carry.ride(work.pending)  # the last applied step's figures that came after its read
        work.pending.sync()  # 4. the one read: the step's one host sync
        self.verdicts.interventions(*late)
        work.writes.apply()  # the changes the read showed are needed, to those tensors only
        clear_overflows(work, work.fragile)
        if work.reduced is not None:
            work.reduced.install()  # a Partial gradient an action changed takes its reduced copy; the others stay
        for participant in self.participants.at["after_read"]:  # 5. after the read
            participant.after_read(work, context)
        proceed, applied = self._verdict(work, context)  # 6. verdict
        if applied:
            self._report(work, context)  # 7. report
        return proceed

    def _verdict(self, work: StepWork, context: StepContext) -> tuple[bool, bool]:
        """The participants' rulings and the gradients' own verdict: (the update goes ahead, as the guard's applied
        step); a final ruling's step goes ahead as another's (a GradScaler skips it itself)."""
        outcome, verdicts, rules = work.outcome, self.verdicts, work.binding.policy.rules
        try:
            rulings: list[Ruling] = []
            for participant in self.participants.at["ruling"]:
                ruling = participant.ruling(work, context)
                if ruling is not None and ruling.final:
                    return ruling.decide(), False  # nothing else is judged
                if ruling is not None:
                    rulings.append(ruling)
            verdicts.report(rules, outcome, work.names, work.step)  # a gradient's halt comes first
            for ruling in rulings:
                if ruling.decide():
                    clear_gradients(context)  # the update is skipped: nothing is left for the optimizer
                    return False, False
            if outcome.skipped_by or outcome.spikes:
                verdicts.skip(rules, outcome, work.names, work.step, context)
                return False, False
            # Only a step that goes ahead: a skipped or halted one's interventions (a ruling's too: the ranks', the
            # loss's, a re-run's) did not happen.
            verdicts.interventions(outcome)
        except RewindRequested as request:
            verdicts.rewound(request, context)
            return False, False
        except GradientHalt:
            for participant in self.participants.at["halted"]:
                participant.halted(work)
            self.book.mark_halted(work)
            raise
        return True, True

    def _report(self, work: StepWork, context: StepContext) -> None:
        """The update goes ahead: what the step showed becomes the state across steps."""
        self.carry.keep(work.carried)  # figures its read could not give, for the next read
        for participant in self.participants.at["applied"]:
            participant.applied(work)
        self.book.treated(work, context)
