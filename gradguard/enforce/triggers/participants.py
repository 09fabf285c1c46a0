"""The triggers as participants of the step: the loss watch, the re-run and the monitors' health.

Each adapts its trigger to the step's stages (``enforce.work.participant``) and holds what it needs from the guard
(the policy as it is now, the event log, the counters); the triggers themselves (``loss``, ``rerun``, ``health``)
know nothing of the stages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gradguard.enforce.recovery.decisions import HaltReport, ranks_field
from gradguard.enforce.triggers.health import Health
from gradguard.enforce.triggers.loss import LossVerdict, LossWatch
from gradguard.enforce.triggers.rerun import Reruns
from gradguard.enforce.triggers.rerun_figures import Figures
from gradguard.enforce.work.participant import Participant, Ruling
from gradguard.enforce.work.step_work import StepContext, StepWork
from gradguard.errors import GradientHalt, ranks_words
from gradguard.events.counters import RERUN_RULE, Counters
from gradguard.events.log import EventLog

if TYPE_CHECKING:
    from gradguard.policy.document import Policy
    from gradguard.policy.sections import Rerun

__all__ = ["HealthTakingPart", "LossTakingPart", "RerunTakingPart"]


class LossTakingPart(Participant):
    """The loss watch: the step's loss rides its read, and the ``loss`` section rules on it.

    It takes part at every step, watched or not: a step it does not watch forgets the roots its backward left.
    """

    def __init__(
        self,
        watch: LossWatch,
        policy: Callable[[], Policy],
        events: EventLog,
        judge: Callable[[LossVerdict, int], bool],
    ) -> None:
        self.watch, self._events, self._judge = watch, events, judge
        # The sections as the policy has them now: a reload builds the participants again (``Participants.rebuild``),
        # so they cannot change under this one, and each stage saves asking for the policy (a call, 3 a step).
        now = policy()
        self._loss, self._always = now.loss, now.loss is not None or now.rerun is not None

    def passed(self, context: StepContext) -> None:
        self.watch.discard()

    def beside_actions(self, work: StepWork) -> None:
        self.watch.begin(work, self._always or work.sampled, self._events, self._loss)

    def ruling(self, work: StepWork, context: StepContext) -> Ruling | None:
        verdict = self.watch.verdict(self._loss, work.outcome, work.step)
        if verdict is None:
            return None
        step, judge = work.step, self._judge
        return Ruling(lambda: judge(verdict, step))

    def applied(self, work: StepWork) -> None:
        self.watch.accept(self._loss, work.outcome.loss)


class HealthTakingPart(Participant):
    """The monitors' health: the figures of the gradients as they arrived, said before any verdict, current once the
    step is applied (or halts the run)."""

    def __init__(self, health: Health) -> None:
        self.health = health

    def after_read(self, work: StepWork, context: StepContext) -> None:
        outcome = work.outcome
        if outcome.observed and not outcome.scaler_found_inf:
            self.health.report(outcome.observed, work.step, outcome.loss)

    def applied(self, work: StepWork) -> None:
        self.health.commit(work.step)

    def halted(self, work: StepWork) -> None:
        self.health.commit(work.step)  # the run stops here: its figures are the last ones


class RerunTakingPart(Participant):
    """The ``rerun`` section: after the read, a suspect step is computed again (``RerunRequested``) or, on its second
    computation, the two are compared; a transient fault under ``transient: halt`` halts here."""

    def __init__(
        self, reruns: Reruns, watch: LossWatch, policy: Callable[[], Policy], events: EventLog, counters: Counters
    ) -> None:
        self.reruns, self.watch, self._policy, self._events, self._counters = reruns, watch, policy, events, counters

    def after_read(self, work: StepWork, context: StepContext) -> None:
        policy = self._policy()
        # A suspect step that cannot be computed again whole is said so, before the verdict.
        self.reruns.settle(policy, self.watch, self._events, work, context)
        self._rerun_or_compare(policy, work, context)

    def _rerun_or_compare(self, policy: Policy, work: StepWork, context: StepContext) -> None:
        outcome, reruns, step = work.outcome, self.reruns, work.step
        config = policy.rerun
        if config is None or outcome.scaler_found_inf:
            return
        # The figures are taken only where they are kept or compared: under FSDP2 and tensor parallel, a host read.
        if reruns.first is not None and reruns.step == step:
            self._compare(work, Figures.of(work), config)
            return
        asked = reruns.trigger(config, outcome, self.watch.peek(policy.loss, outcome.loss))
        if asked is None:
            return
        if context.rerunnable:
            reruns.origin_ranks = dict(outcome.ranks)  # where the first computation's fault was made, if known
            reruns.request(step, asked, Figures.of(work))
        if not reruns.noted:
            reruns.noted = True
            why = "the loop has no closure for the guard to run again (optimizer.step(closure), or Lightning's "
            why += f"automatic optimization); the verdict ({asked}) stands"
            self._events.emit("warning", "rerun_unavailable", step=step, why=why)

    def _compare(self, work: StepWork, second: Figures, config: Rerun) -> None:
        reruns, outcome, step = self.reruns, work.outcome, work.step
        asked, first = reruns.asked, reruns.first
        assert first is not None
        device = next(iter(work.grads.values())).device
        result = reruns.compare(config, second, work.collective, device)
        self._counters.add(RERUN_RULE, result.verdict)
        fields: dict[str, Any] = {"loss_first": first.loss, "loss_second": outcome.loss}
        fields |= {"max_rel_diff": result.max_rel_diff}
        fields |= {"params": result.params, "ranks": result.ranks}
        # Whether the fault came back on the rank that made it: a transient one there points at that device.
        origin = reruns.origin_ranks
        recurred = {rank: host for rank, host in origin.items() if rank in outcome.ranks}
        fields |= {
            "origin_ranks": ranks_field(origin),
            "recurred": ranks_field(recurred),
        }
        self._events.emit("warning", "rerun", step=step, verdict=result.verdict, asked=asked, **fields)
        if result.verdict == "reproducible":
            outcome.note = f"computed again, the fault repeated (reproducible; asked by {asked})"
            return
        if config.transient != "halt":
            return
        # What the first computation held in each parameter that differed: the fault the second one did not
        # repeat (a non-finite norm, else a finite one that came out otherwise).
        kinds: dict[str, str] = {}
        for name in result.params:
            value = first.norms.get(name)
            if value is not None and value != value:
                kinds[name] = "nan"
            elif value is not None and abs(value) == float("inf"):
                kinds[name] = "inf"
            else:
                kinds[name] = "differed"
        losses = ""
        if first.loss is not None and outcome.loss is not None:
            losses = f"; loss {first.loss:.6g} then {outcome.loss:.6g}"
        ranks = f"; on rank(s) {', '.join(map(str, result.ranks))}" if result.ranks else ""
        if origin:
            ranks += f"; made on {ranks_words(origin)} and not made there again"
        why = (
            f"the rerun section (transient: halt) computed step {step} again, asked by {asked}, and the second "
            f"computation differed from the first (max relative difference {result.max_rel_diff:.3g}{losses}"
            f"{ranks}): a transient fault, not the model's. The device is suspect: drain the node and resume "
            "from the last checkpoint, or set rerun.transient: continue to go on with the second computation"
        )
        # Not a rewind: the state is sound, the device is not.
        self._counters.add(RERUN_RULE, "halt")
        fields = HaltReport(step, RERUN_RULE, result.params, kinds, "transient", why, None, origin).fields()
        self._events.emit("error", "halt", **fields, counters=self._counters.snapshot())
        self._events.flush()
        raise GradientHalt(step=step, params=result.params, kind="transient", rule=RERUN_RULE, reason=why, ranks=origin)
