"""Halts, rewinds, skipped steps and GradScaler's skipped steps: which rules they count, and the halts' and
rewinds' details."""

from __future__ import annotations

from typing import Any, Final

from gradguard.audit.counters import CounterCheck
from gradguard.audit.fields import number_or_none
from gradguard.audit.filters import EventFilter
from gradguard.audit.reader import Record
from gradguard.audit.run_state import SCALER_KEY, LastIntervention, RunState
from gradguard.audit.summary import HALT_PARAMS_SHOWN, HaltRow, RewindRow, SkipOrigin, StepTally, unlearned_stretch
from gradguard.events.counters import LOSS_RULE, RERUN_RULE
from gradguard.events.definitions import Halt, Intervention, Rewind, ScalerSkip, Skip, SpikeSkip

__all__ = ["HaltSkipCollector"]

KEPT_HALTS: Final = 50
ESCALATION: Final = "skip limit exceeded"
"""How the ``reason`` of a halt (or rewind) starts when a skip rule went past its limits."""


class HaltSkipCollector:
    """Takes ``halt``, ``rewind``, ``skip``, ``spike_skip`` and ``scaler_skip`` events; a halt is also a counters
    snapshot (a rewind is not: the run goes on)."""

    def __init__(self, paths: list[str], event_filter: EventFilter, counters: CounterCheck) -> None:
        self.paths = paths
        self.counters = counters
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

    def halt(self, event: Halt, run: RunState, record: Record) -> None:
        rule, params, step, reason, kind = event.rule, event.params, event.step, event.reason, event.kind
        if rule == LOSS_RULE and not params and kind != "overflow":
            run.count(rule, "halt")  # the loss section's (a rule of that name halts on named parameters)
        elif rule == RERUN_RULE and kind == "transient":
            run.count(rule, "halt")  # the rerun section's (transient: halt): the guard counts it as rerun/halt
        elif kind == "spike":
            run.count(rule, "halt_on_spike")  # skip_step_on_spike past its limits
        elif kind == "overflow":
            run.count(rule, "halt_on_nonfinite")  # GradScaler skipped more than max_scaler_skips steps in a row
        elif reason is not None and reason.startswith(ESCALATION):
            run.count(rule, "halt_on_nonfinite")
            _count_skips_before(run, rule, step)
        else:
            # Every halt rule that covered a non-finite gradient of the step counts it (the reason, if any, is
            # recovery's: no snapshot old enough, or max_rewinds reached).
            halting = run.halting_rules if run.watch_step == step and run.halting_rules else {rule: None}
            for name in halting:
                run.count(name, "halt_on_nonfinite")
        run.halted_at.append(step)
        self.counters.snapshot(event, run, record)
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
                where=f"{self.paths[record.file]}:{record.line}",
                ts=event.ts,
                preceded_by=_describe(run.last_intervention),
                origin=event.origin,
                restored_to=event.restored_to,
                ranks=[run.rank],
                runs=[run.run],
            )
            self.halts.append(row)
            self._same_halt[(run.job.number, step, rule, kind)] = row

    def rewind(self, event: Rewind, run: RunState, record: Record) -> None:
        """Recovery turned a halt into a rewind: counted under the halt's rule as ``rewind``; the run went on."""
        rule, params, step, reason, kind = event.rule, event.params, event.step, event.reason, event.kind
        to_step, skip_until = event.to_step, event.skip_until
        run.count(rule, "rewind")
        run.rewinds += 1
        if kind != "spike" and reason is not None and reason.startswith(ESCALATION):
            _count_skips_before(run, rule, step)  # as the halt would have: the skip rules before it skipped
        stretch = unlearned_stretch(step, to_step, skip_until)
        if stretch is not None:
            run.rewound.append(stretch)
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
            where=f"{self.paths[record.file]}:{record.line}",
            ts=event.ts,
            origin=event.origin,
        )
        self._same_rewind[key] = row
        self.rewinds.append(row)

    def _params_shown(self, params: list[str]) -> bool:
        """Whether ``--param`` leaves a halt or rewind shown (one without parameters, an overflow, is not narrowed)."""
        return self._param_filter is None or bool(self._narrow(params))

    def skip(self, event: Skip, run: RunState, record: Record) -> None:
        rule, params, step = event.rule, event.params, event.step
        skipping = run.skipping_rules if run.watch_step == step and run.skipping_rules else {rule: None}
        for name in skipping:
            run.count(name, "skip_step_on_nonfinite")
        if run.replica or not self._tally(step, rule, params, self.skipped_params):
            return
        origin = event.origin
        if origin is not None and len(self.skip_origins) < KEPT_HALTS:
            self.skip_origins.append(SkipOrigin(run=run.run, rank=run.rank, step=step, origin=origin))

    def spike_skip(self, event: SpikeSkip, run: RunState, record: Record) -> None:
        """A step ``skip_step_on_spike`` skipped: one event per spiking rule (or parameter)."""
        rule, params, step = event.rule, event.params, event.step
        run.count(rule, "skip_step_on_spike")
        if run.replica or not self._tally(step, rule, params, self.spiked_params):
            return
        z = event.z
        if type(z) is float and (self.largest_spike is None or z > self.largest_spike[0]):
            self.largest_spike = (z, step)

    def _tally(self, step: int | None, rule: str, params: list[str], per_param: dict[str, int]) -> bool:
        """Count a skipped step the filters show, and its parameters into ``per_param``; False if not shown."""
        if not self._shown(step, rule):
            return False
        names = self._narrow(params)
        if not names:
            return False
        self.skips.add(step)
        self.skips_by_rule[rule] = self.skips_by_rule.get(rule, 0) + 1
        for name in names:
            per_param[name] = per_param.get(name, 0) + 1
        return True

    def scaler_skip(self, event: ScalerSkip, run: RunState, record: Record) -> None:
        run.count(*SCALER_KEY)
        step = event.step
        if not run.replica and self._param_filter is None and self._shown(step, None) and not self._rules:
            self.scaler.add(step)


def _count_skips_before(run: RunState, rule: str, step: int | None) -> None:
    """A skip rule went past its limits at ``step``: the skip rules before it (policy order) counted the skip."""
    order = run.rule_order
    if order is None or rule not in order:
        run.unverifiable.add("skip_step_on_nonfinite")
        return
    for name in run.skipping_rules if run.watch_step == step else {}:
        if name in order and order.index(name) < order.index(rule):
            run.count(name, "skip_step_on_nonfinite")


def _describe(last: LastIntervention | None) -> str | None:
    """The run's last intervention before a halt, in words."""
    if last is None:
        return None
    if isinstance(last, Intervention):
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
