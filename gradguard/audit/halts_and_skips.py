"""The halts, rewinds and skipped steps sections: the halts' and rewinds' details (one row for all the ranks that
made each), the steps the guard skipped (non-finite gradients, spikes, the loss section's skips, outlier ranks) and
where their faults started, and GradScaler's skipped steps.

What the guard counted for each of these events is the counters section's (``gradguard.audit.counting``); a row
shows the account of the rank that made the fault where another rank only received it through the reduction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from gradguard.audit.collector import Collector, Context, Finding, Handler
from gradguard.audit.fields import number_or_none
from gradguard.audit.layout import plural
from gradguard.audit.reader import Record
from gradguard.audit.run_state import RANKS_RULE, LastIntervention, RunState
from gradguard.audit.summary import (
    FINDING_HALTS,
    FINDING_REWINDS,
    FINDING_SKIPS,
    HALT_PARAMS_SHOWN,
    AuditSummary,
    HaltRow,
    RewindRow,
    SkipOrigin,
    StepTally,
    joined_stretches,
    unlearned_stretch,
)
from gradguard.events import definitions as ev
from gradguard.events.counters import LOSS_RULE

__all__ = ["KEPT_HALTS", "HaltSkipCollector"]

KEPT_HALTS: Final = 50


class HaltSkipCollector(Collector):
    """Takes ``halt``, ``rewind``, ``skip``, ``spike_skip`` and ``scaler_skip`` events, the loss section's and the
    ranks section's skips, and the clips (the last before a halt is named in its row)."""

    def __init__(self, context: Context) -> None:
        self._where = context.where
        event_filter = context.event_filter
        self._shown = event_filter.shown
        self._narrow = event_filter.narrow
        self._rules = event_filter.rules
        self._param_filter = event_filter.params
        self.halts: list[HaltRow] = []
        """The first ``KEPT_HALTS`` halts."""
        self.halts_total = 0
        self.skips = StepTally()
        self.skips_by_rule: dict[str, int] = {}
        self.skipped_params: dict[str, int] = {}
        self.spiked_params: dict[str, int] = {}
        self.largest_spike: tuple[float, int | None] | None = None
        self.skip_origins: list[SkipOrigin] = []
        self.scaler = StepTally()
        self.rewinds: list[RewindRow] = []
        """Every rewind shown, one row for all the ranks that made it (a run makes at most ``max_rewinds``)."""
        self._same_rewind: dict[tuple[Any, ...], RewindRow] = {}
        """The row of each (job, step, to_step, skip_until, rule, kind): its replicas on other ranks join it."""
        self._same_halt: dict[tuple[Any, ...], HaltRow] = {}
        """The row of each halt kept, by (job, step, rule, kind): its replicas on other ranks join it."""
        self._same_skip: dict[tuple[Any, ...], SkipOrigin] = {}
        """The origin row of each skip kept, by (job, step, rule): a replica with the origin rank's account replaces
        it."""
        self._last_clip: dict[str, LastIntervention] = {}
        """Run id -> its last intervention, for the halt that may follow it."""

    def reads(self) -> Mapping[type[Any], Handler]:
        return {
            ev.Halt: self.halt,
            ev.Rewind: self.rewind,
            ev.Skip: self.skip,
            ev.SpikeSkip: self.spike_skip,
            ev.ScalerSkip: self.scaler_skip,
            ev.LossSpike: self.loss_verdict,
            ev.LossNonfinite: self.loss_verdict,
            ev.RankOutlier: self.outlier,
            ev.Intervention: self.intervention,
            ev.AdaptiveClip: self.adaptive_clip,
        }

    def clips(self, run: RunState, records: Sequence[Record]) -> None:
        if records:
            self._last_clip[run.run] = records[-1].event  # type: ignore[assignment]  # a streak holds clips only

    def intervention(self, event: ev.Intervention, run: RunState, record: Record) -> None:
        if event.param is not None:
            self._last_clip[run.run] = event
            return
        n = event.n_params if event.n_params is not None else len(event.params or ())
        self._last_clip[run.run] = (event.step, event.rule, event.action, n, number_or_none(event.before))

    def adaptive_clip(self, event: ev.AdaptiveClip, run: RunState, record: Record) -> None:
        before, params = event.before, event.params
        if isinstance(before, list):
            if params and before:
                last = (event.step, event.rule, event.action, params[-1], number_or_none(before[-1]))
                self._last_clip[run.run] = last
        elif event.param is not None:
            last = (event.step, event.rule, event.action, event.param, number_or_none(before))
            self._last_clip[run.run] = last
        else:
            n = event.n_params if event.n_params is not None else len(params)
            self._last_clip[run.run] = (event.step, event.rule, event.action, n, number_or_none(before))

    def halt(self, event: ev.Halt, run: RunState, record: Record) -> None:
        rule, params, step, reason, kind = event.rule, event.params, event.step, event.reason, event.kind
        if run.replica:  # the same halt on another rank of the job: its row names this rank too
            row = self._same_halt.get((run.job.number, step, rule, kind))
            if row is not None and run.rank not in row.ranks:
                row.ranks.append(run.rank)
                row.runs.append(run.run)
                if _origin_rank_speaks(row.origin, event.origin):
                    row.origin = event.origin
                if not row.n_params and params:  # a re-run's halt names its parameters on the ranks they differed
                    row.params, row.n_params = params[:HALT_PARAMS_SHOWN], len(params)
            return
        if not self._shown(step, rule) or not self._params_shown(params):
            return
        self.halts_total += 1
        if len(self.halts) < KEPT_HALTS:
            row = HaltRow(
                run=run.run,
                rank=run.rank,
                step=step,
                rule=rule,
                kind=kind,
                reason=reason,
                params=params[:HALT_PARAMS_SHOWN],
                n_params=len(params),
                where=self._where(record),
                ts=event.ts,
                preceded_by=_describe(self._last_clip.get(run.run)),
                origin=event.origin,
                restored_to=event.restored_to,
                ranks=[run.rank],
                runs=[run.run],
            )
            self.halts.append(row)
            self._same_halt[(run.job.number, step, rule, kind)] = row

    def rewind(self, event: ev.Rewind, run: RunState, record: Record) -> None:
        """Recovery turned a halt into a rewind: one row for every rank that made it."""
        rule, params, step, reason, kind = event.rule, event.params, event.step, event.reason, event.kind
        to_step, skip_until = event.to_step, event.skip_until
        key = (run.job.number, step, to_step, skip_until, rule, kind)
        if run.replica:  # the same rewind on another rank of the job: one row for all its ranks
            same = self._same_rewind.get(key)
            if same is not None and run.rank not in same.ranks:
                same.runs.append(run.run)
                same.ranks.append(run.rank)
                if _origin_rank_speaks(same.origin, event.origin):
                    same.origin = event.origin
            return
        if not self._shown(step, rule) or not self._params_shown(params):
            return
        row = RewindRow(
            step=step,
            to_step=to_step,
            skip_until=skip_until,
            rule=rule,
            kind=kind,
            reason=reason,
            params=params[:HALT_PARAMS_SHOWN],
            n_params=len(params),
            rewinds=event.rewinds,
            lr_scale=number_or_none(event.lr_scale),
            runs=[run.run],
            ranks=[run.rank],
            where=self._where(record),
            ts=event.ts,
            origin=event.origin,
        )
        self._same_rewind[key] = row
        self.rewinds.append(row)

    def _params_shown(self, params: list[str]) -> bool:
        """Whether ``--param`` leaves a halt or rewind shown (one without parameters, an overflow, is not narrowed)."""
        return self._param_filter is None or bool(self._narrow(params))

    def skip(self, event: ev.Skip, run: RunState, record: Record) -> None:
        step, origin = event.step, event.origin
        key = (run.job.number, step, event.rule)
        if run.replica:  # the origin rank's own account replaces a rank's that only received the fault
            same = self._same_skip.get(key)
            if same is not None and _origin_rank_speaks(same.origin, origin):
                assert origin is not None
                same.run, same.rank, same.origin = run.run, run.rank, origin
            elif same is None and isinstance(origin, dict) and len(self.skip_origins) < KEPT_HALTS:
                self._keep_origin(key, SkipOrigin(run=run.run, rank=run.rank, step=step, origin=origin))
            return
        if not self._tally(step, event.rule, event.params, self.skipped_params):
            return
        if origin is not None and len(self.skip_origins) < KEPT_HALTS:
            self._keep_origin(key, SkipOrigin(run=run.run, rank=run.rank, step=step, origin=origin))

    def _keep_origin(self, key: tuple[Any, ...], row: SkipOrigin) -> None:
        self.skip_origins.append(row)
        self._same_skip[key] = row

    def spike_skip(self, event: ev.SpikeSkip, run: RunState, record: Record) -> None:
        """A step ``skip_step_on_spike`` skipped: one event per spiking rule (or parameter)."""
        if run.replica or not self._tally(event.step, event.rule, event.params, self.spiked_params):
            return
        z = event.z
        if type(z) is float and (self.largest_spike is None or z > self.largest_spike[0]):
            self.largest_spike = (z, event.step)

    def loss_verdict(self, event: ev.LossSpike | ev.LossNonfinite, run: RunState, record: Record) -> None:
        """The loss section skipped the step (its cause is the loss section's to say)."""
        if event.action == "skip" and not run.replica and self._shown(event.step, LOSS_RULE):
            self._skipped(event.step, LOSS_RULE)

    def outlier(self, event: ev.RankOutlier, run: RunState, record: Record) -> None:
        """The ranks section skipped the step: a rank's own gradient norm far above the others' (``on_outlier``)."""
        if event.action == "skip" and not run.replica and self._shown(event.step, RANKS_RULE):
            self._skipped(event.step, RANKS_RULE)

    def _skipped(self, step: int | None, rule: str) -> None:
        self.skips.add(step)
        self.skips_by_rule[rule] = self.skips_by_rule.get(rule, 0) + 1

    def _tally(self, step: int | None, rule: str, params: list[str], per_param: dict[str, int]) -> bool:
        """Count a skipped step the filters show, and its parameters into ``per_param``; False if not shown."""
        if not self._shown(step, rule):
            return False
        names = self._narrow(params)
        if not names:
            return False
        self._skipped(step, rule)
        for name in names:
            per_param[name] = per_param.get(name, 0) + 1
        return True

    def scaler_skip(self, event: ev.ScalerSkip, run: RunState, record: Record) -> None:
        step = event.step
        if not run.replica and self._param_filter is None and self._shown(step, None) and not self._rules:
            self.scaler.add(step)

    def contribute(self, fields: dict[str, Any]) -> None:
        rewinds = self.rewinds
        fields["halts"] = list(self.halts)
        fields["halts_total"] = self.halts_total
        fields["rewinds"] = rewinds[:KEPT_HALTS]
        fields["rewinds_total"] = len(rewinds)
        fields["unlearned_steps"] = joined_stretches(
            stretch
            for row in rewinds
            if (stretch := unlearned_stretch(row.step, row.to_step, row.skip_until)) is not None
        )
        fields["rewind_skips"] = joined_stretches(
            (row.step, row.skip_until) for row in rewinds if row.step is not None and row.skip_until is not None
        )
        fields["skips"] = self.skips.done()
        fields["skips_by_rule"] = dict(self.skips_by_rule)
        fields["skipped_params"] = dict(sorted(self.skipped_params.items(), key=lambda item: -item[1]))
        fields["spiked_params"] = dict(sorted(self.spiked_params.items(), key=lambda item: -item[1]))
        fields["largest_spike"] = self.largest_spike
        fields["skip_origins"] = list(self.skip_origins)
        fields["scaler_skips"] = self.scaler.done()

    def findings(self, summary: AuditSummary) -> list[Finding]:
        found = []
        if summary.halts_total:
            found.append((FINDING_HALTS, plural(summary.halts_total, "halt")))
        if summary.rewinds_total:
            unlearned = sum(last - first + 1 for first, last in summary.unlearned_steps)
            words = plural(summary.rewinds_total, "rewind") + f" ({plural(unlearned, 'step')} never learned from)"
            found.append((FINDING_REWINDS, words))
        if summary.skips.events:
            found.append((FINDING_SKIPS, plural(summary.skips.events, "skipped step")))
        return found


def _describe(last: LastIntervention | None) -> str | None:
    """The run's last intervention before a halt, in words."""
    if last is None:
        return None
    if isinstance(last, ev.Intervention):
        assert last.param is not None
        last = (last.step, last.rule, last.action, last.param, number_or_none(last.before))
    step, rule, action, what, before = last
    value = "?" if before is None else f"{before:.4g}"
    if isinstance(what, int):
        return f"{action} of {what} parameters as a group (rule {rule!r}) at step {step}, group norm before {value}"
    return f"{action} of {what} (rule {rule!r}) at step {step}, before {value}"


def _origin_rank_speaks(shown: Any, other: Any) -> bool:
    """Whether a replica's origin should replace the row's: the row has a rank's that only received the fault through
    the reduction (or none), the replica the account of a rank that made it (where it started, its module)."""
    received = not isinstance(shown, dict) or shown.get("phase") == "received"
    return received and isinstance(other, dict) and other.get("phase") != "received"
