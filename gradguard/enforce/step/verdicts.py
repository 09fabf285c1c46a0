"""What a step came to, after its one sync: counters, events, and a halt or a skip.

A halt raises [`GradientHalt`][gradguard.GradientHalt] before the optimizer touches anything (the log is flushed first);
a skip clears every gradient the update would use, so no parameter or optimizer state changes, and
escalates to a halt past the skip rule's limits.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Final

from gradguard.enforce.actions.nonfinite import SkipLimits, joined_kind
from gradguard.enforce.recovery.decisions import HaltReport, RewindRequested, ranks_field
from gradguard.enforce.recovery.recovery import Recovery
from gradguard.enforce.triggers.loss import LossVerdict
from gradguard.enforce.work.participant import clear_gradients
from gradguard.enforce.work.step_work import StepContext, StepOutcome
from gradguard.errors import GradientHalt, GuardWarning
from gradguard.events.counters import LOSS_RULE, Counters
from gradguard.events.log import EventLog
from gradguard.policy.schema import HaltOnNonfinite, Rule, SkipStepOnNonfinite, SkipStepOnSpike

__all__ = ["SKIP_CAUSES", "SkipCause", "Verdicts", "skip_causes"]

_SKIP_ACTION = {SkipStepOnNonfinite: "skip_step_on_nonfinite", SkipStepOnSpike: "skip_step_on_spike"}


class Verdicts:
    """Turns a step's outcome into counters and events, and halts or skips."""

    def __init__(self, counters: Counters, events: EventLog, skip_limits: SkipLimits, recovery: Recovery) -> None:
        self.counters = counters
        self.events = events
        self.skip_limits = skip_limits
        self.recovery = recovery
        self._warned_scheduler = False

    def report(self, rules: Sequence[Rule], outcome: StepOutcome, names: dict[int, str], step: int) -> None:
        """Count and log the step's non-finite gradients; raise [`GradientHalt`][gradguard.GradientHalt] where a halt
        rule saw NaN/Inf. Its interventions are counted apart (``interventions``), once nothing skips or halts it."""
        for index in sorted(outcome.nonfinite):
            kind, rule_index = outcome.nonfinite[index]
            self.counters.add(rules[rule_index].name, kind)
            self.events.emit(
                "info",
                "nonfinite",
                step=step,
                rule=rules[rule_index].name,
                param=names[index],
                kind=kind,
                halts=index in outcome.halted_by,
                skips=index in outcome.skipped_by,
            )
        passed = sorted(set(outcome.nonfinite) - set(outcome.halted_by) - set(outcome.skipped_by))
        if passed and not outcome.halted_by and not outcome.skipped_by:
            # No halt or skip rule covers these: say loudly that the optimizer is about to apply them.
            self.events.emit(
                "warning",
                "nonfinite_unhalted",
                step=step,
                params=[names[i] for i in passed],
                kinds=sorted({outcome.nonfinite[i][0] for i in passed}),
            )
        if outcome.halted_by:
            offenders = sorted(outcome.halted_by)
            kind = joined_kind(outcome.nonfinite[i][0] for i in offenders)
            rule = rules[outcome.halted_by[offenders[0]]].name
            counts = [rules[r].name for r in sorted(set(outcome.halted_by.values()))]
            params = first_first([names[i] for i in offenders], outcome.origin)
            kinds = {names[i]: outcome.nonfinite[i][0] for i in offenders}
            report = HaltReport(step, rule, params, kinds, kind, outcome.note, outcome.origin, outcome.ranks)
            self.halt(report, counts, "halt_on_nonfinite")

    def interventions(self, *outcomes: StepOutcome) -> None:
        """Count and log what applied steps did."""
        for outcome in outcomes:
            self.counters.add_many(outcome.counts)
            for event, fields in outcome.events:
                level = "warning" if event.startswith("nonfinite") or event == "norm_overflow" else "debug"
                self.events.emit(level, event, **fields)

    def halt(self, halt: HaltReport, rules: Sequence[str], action: str) -> None:
        """Halt (``action`` counted under each of ``rules``), or, with recovery, rewind instead.

        Raises [`GradientHalt`][gradguard.GradientHalt], or ``RewindRequested`` for the engine (counted as ``rewind``
        under the halt's rule). Past ``max_rewinds`` the halt restores the snapshot first and says so.
        """
        decision = self.recovery.decide(halt.step) if self.recovery.active else None
        if decision is not None and decision.rewind and decision.snapshot is not None:
            self.counters.add(halt.rule, "rewind")
            raise RewindRequested(halt, decision.snapshot)
        for rule in rules:
            self.counters.add(rule, action)
        restored = None
        if decision is not None and decision.snapshot is not None:
            restored = decision.snapshot.step
            self.recovery.restore(decision.snapshot, self.recovery.lr_scale)
        reason = "; ".join(part for part in (halt.reason, decision.why if decision else None) if part) or None
        fields = halt.fields() | {"reason": reason}
        extra = {} if restored is None else {"restored_to": restored}
        self.events.emit("error", "halt", **fields, **extra, counters=self.counters.snapshot())
        self.events.flush()
        raise GradientHalt(
            step=halt.step,
            params=halt.params,
            kind=halt.kind,
            rule=halt.rule,
            reason=reason,
            origin=halt.origin,
            restored_to=restored,
            ranks=halt.ranks,
        )

    def scaler_skip(self, rules: Sequence[Rule], step: int, loss_scale: float | None) -> None:
        """GradScaler skipped ``step``: at a ``halt_on_nonfinite``'s scale floor, or past its skips in a row, halt.

        An overflow is the scaler's business until it is not passing: a NaN that persists makes the scaler
        skip every step and cut the scale forever, and the run learns nothing without a word.
        """
        self.skip_limits.scaler_skips += 1
        skips = self.skip_limits.scaler_skips
        for rule in rules:
            if not rule.active_at(step):
                continue
            for action in rule.actions:
                if not isinstance(action, HaltOnNonfinite) or not action.active_at(step):
                    continue
                why = None
                floor, limit = action.min_loss_scale, action.max_scaler_skips
                if floor is not None and loss_scale is not None and loss_scale <= floor:
                    why = f"GradScaler skipped {skips} steps in a row, the last at loss scale {loss_scale:g} "
                    why += f"(min_loss_scale: {floor:g}): the inf/NaN persists"
                elif limit is not None and skips > limit:
                    why = f"GradScaler skipped {skips} steps in a row (max_scaler_skips: {limit}): the inf/NaN persists"
                if why is not None:
                    report = HaltReport(step, rule.name, [], {}, "overflow", why, None)
                    self.halt(report, [rule.name], "halt_on_nonfinite")

    def loss(self, verdict: LossVerdict, step: int) -> bool:
        """The ``loss`` section's verdict: counted and logged; a halt (a rewind under recovery) raises, a skip returns
        True (the pipeline clears the step's gradients, as for any ruling that skips); ``ignore`` returns False."""
        self.counters.add(LOSS_RULE, verdict.kind)
        if verdict.kind == "spike":
            fields = {"reference": verdict.reference, "factor": verdict.factor}
            self.events.emit("warning", "loss_spike", step=step, loss=verdict.loss, action=verdict.action, **fields)
        else:
            self.events.emit("warning", "loss_nonfinite", step=step, loss=verdict.loss, action=verdict.action)
        if verdict.action == "halt":
            report = HaltReport(step, LOSS_RULE, [], {}, verdict.halt_kind, verdict.reason, None)
            self.halt(report, [LOSS_RULE], "halt")
        return verdict.action == "skip"

    def rewound(self, request: RewindRequested, context: StepContext) -> None:
        """Recovery turned a halt into a rewind: restore, skip this update, say so as loudly as a halt."""
        halt, snapshot = request.halt, request.snapshot
        self.recovery.rewind(halt.step, snapshot)
        clear_gradients(context)
        self.events.emit(
            "warning",
            "rewind",
            **halt.fields(),
            to_step=snapshot.step,
            rewinds=self.recovery.rewinds,
            skip_until=self.recovery.skip_until,
            lr_scale=self.recovery.lr_scale,
        )

    def skip_escalates(self, rules: Sequence[Rule], outcome: StepOutcome, step: int) -> bool:
        """Whether ``skip`` of this step's skips would halt (or rewind) instead: a skip rule past its limits."""
        causes = skip_causes(outcome)
        return any(self.skip_limits.would_exceed(r, rules[r], step, cause) for r, cause in causes)

    def skip(
        self, rules: Sequence[Rule], outcome: StepOutcome, names: dict[int, str], step: int, context: StepContext
    ) -> None:
        """Skip the update: no gradient is left for the optimizer, so nothing it owns can change."""
        offenders = sorted(outcome.skipped_by)
        params = first_first([names[i] for i in offenders], outcome.origin)
        kinds = {names[i]: outcome.nonfinite[i][0] for i in offenders}
        kind = joined_kind(kinds.values())
        for rule_index, cause in skip_causes(outcome):
            rule = rules[rule_index]
            reason = self.skip_limits.record(rule_index, rule, step, cause)
            if reason is not None:
                why = f"skip limit exceeded: {reason}"
                if cause is SkipStepOnNonfinite:
                    report = HaltReport(step, rule.name, params, kinds, kind, why, outcome.origin, outcome.ranks)
                    self.halt(report, [rule.name], "halt_on_nonfinite")
                spiked = [p for spike in outcome.spikes if spike.rule_index == rule_index for p in spike.params]
                self.halt(HaltReport(step, rule.name, spiked, {}, "spike", why, None), [rule.name], "halt_on_spike")
            self.counters.add(rule.name, _SKIP_ACTION[cause])
        clear_gradients(context)
        if offenders:
            self.events.emit(
                "warning",
                "skip",
                step=step,
                rule=rules[outcome.skipped_by[offenders[0]]].name,
                params=params,
                kinds=kinds,
                kind=kind,
                origin=outcome.origin,
                ranks=ranks_field(outcome.ranks),
            )
        for rule_index in sorted({spike.rule_index for spike in outcome.spikes}):
            mine = [spike for spike in outcome.spikes if spike.rule_index == rule_index]
            worst = max(mine, key=lambda spike: spike.z)
            self.events.emit(
                "warning",
                "spike_skip",
                step=step,
                rule=rules[rule_index].name,
                params=[param for spike in mine for param in spike.params],
                norm=worst.norm,
                mean=worst.mean,
                std=worst.std,
                z=worst.z,
                z_thresh=worst.z_thresh,
                samples=worst.samples,
            )
        optimizer = context.optimizer
        why = "non-finite gradient" if offenders else "gradient norm spike"
        if (
            optimizer is not None
            and not self._warned_scheduler
            and getattr(optimizer.step, "_wrapped_by_lr_sched", False)
        ):
            self._warned_scheduler = True
            warnings.warn(
                f"gradguard skipped optimizer step {step} ({why}), but an LR scheduler wraps this "
                "optimizer and will still advance when you call scheduler.step(). To keep the schedule on "
                "applied steps, call scheduler.step() only when guard.last_step_skipped is False.",
                GuardWarning,
                stacklevel=6,
            )


SkipCause = type[SkipStepOnNonfinite | SkipStepOnSpike]
"""The kind of action a skip was made by: its limits are those of the rule's actions of that kind."""
SKIP_CAUSES: Final[tuple[SkipCause, ...]] = (SkipStepOnNonfinite, SkipStepOnSpike)


def skip_causes(outcome: StepOutcome) -> list[tuple[int, SkipCause]]:
    """The skip rules a skipped step counts under, each with the kind of its skip, in rule order."""
    causes: list[tuple[int, SkipCause]]
    causes = [(r, SkipStepOnNonfinite) for r in sorted(set(outcome.skipped_by.values()))]
    causes += [(r, SkipStepOnSpike) for r in sorted({spike.rule_index for spike in outcome.spikes})]
    return causes


def first_first(params: list[str], origin: Mapping[str, Any] | None) -> list[str]:
    """``params`` with those whose gradients went non-finite first (as backward accumulated them) first."""
    first = [name for name in (origin or {}).get("first_params", ()) if name in params]
    return first + [name for name in params if name not in first] if first else params
