"""The non-finite gradients section: detections (by kind, rule and parameter), steps that applied them unhalted, and
group clips skipped on a non-finite norm.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gradguard.audit.collector import Collector, Context, Finding, Handler
from gradguard.audit.layout import plural
from gradguard.audit.reader import Record
from gradguard.audit.run_state import RunState
from gradguard.audit.summary import (
    FINDING_GROUP_NORMS,
    FINDING_NONFINITE,
    FINDING_UNHALTED,
    AuditSummary,
    NonfiniteRow,
    ParamTally,
    StepTally,
)
from gradguard.events.definitions import Nonfinite, NonfiniteGroupNorm, NonfiniteUnhalted

__all__ = ["NonfiniteCollector"]


class _Nonfinite(ParamTally):
    __slots__ = ("kinds",)

    def __init__(self) -> None:
        super().__init__()
        self.kinds: dict[str, None] = {}


class NonfiniteCollector(Collector):
    """Takes ``nonfinite``, ``nonfinite_unhalted`` and ``nonfinite_group_norm`` events."""

    def __init__(self, context: Context) -> None:
        event_filter = context.event_filter
        self._shown = event_filter.shown
        self._narrow = event_filter.narrow
        self._rules = event_filter.rules
        self._param_filter = event_filter.params
        self._filtered = event_filter.filters.active
        """Whether a filter is on (else every event is shown: a NaN step's line per tensor takes no filter calls)."""
        self.steps = StepTally()
        self.by_kind: dict[str, int] = {}
        self.by_rule: dict[str, int] = {}
        self._by_param: dict[str, _Nonfinite] = {}
        self.unhalted = StepTally()
        self.unhalted_params: dict[str, None] = {}
        self.group_norm = StepTally()

    def reads(self) -> Mapping[type[Any], Handler]:
        return {
            Nonfinite: self.nonfinite,
            NonfiniteUnhalted: self.unhalted_event,
            NonfiniteGroupNorm: self.group_norm_event,
        }

    def nonfinite(self, event: Nonfinite, run: RunState, record: Record) -> None:
        rule, kind, param, step = event.rule, event.kind, event.param, event.step
        if run.replica or (self._filtered and (not self._shown(step, rule) or not self._narrow([param]))):
            return
        self.steps.add(step)
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        self.by_rule[rule] = self.by_rule.get(rule, 0) + 1
        entry = self._by_param.get(param)
        if entry is None:
            entry = self._by_param[param] = _Nonfinite()
        entry.add(step, rule)
        entry.kinds[kind] = None

    def nonfinites(self, run: RunState, records: Sequence[Record]) -> None:
        """A streak of detections of one rule and kind (a NaN step's line per tensor; no filter on): counted at once,
        each tensor's tally updated in one loop."""
        if run.replica or not records:
            return
        first: Nonfinite = records[0].event  # type: ignore[assignment]  # a streak holds nonfinite lines only
        rule, kind, n = first.rule, first.kind, len(records)
        self.by_kind[kind] = self.by_kind.get(kind, 0) + n
        self.by_rule[rule] = self.by_rule.get(rule, 0) + n
        steps, by_param = self.steps, self._by_param
        steps.events += n
        last = steps.last_added
        for record in records:
            event: Nonfinite = record.event  # type: ignore[assignment]
            step, param = event.step, event.param
            if step != last:
                steps.add(step, 0)
                last = step
            entry = by_param.get(param)
            if entry is None:
                entry = by_param[param] = _Nonfinite()
            entry.add(step, rule)
            entry.kinds[kind] = None

    def unhalted_event(self, event: NonfiniteUnhalted, run: RunState, record: Record) -> None:
        names, step = event.params, event.step
        if run.replica or self._rules or not self._shown(step, None):
            return
        names = self._narrow(names)
        if not names:
            return
        self.unhalted.add(step)
        for name in names:
            self.unhalted_params[name] = None

    def group_norm_event(self, event: NonfiniteGroupNorm, run: RunState, record: Record) -> None:
        step = event.step
        if not run.replica and self._param_filter is None and self._shown(step, event.rule):
            self.group_norm.add(step)

    def by_param_rows(self) -> list[NonfiniteRow]:
        """One row per parameter, in order of its first non-finite step."""
        rows = [
            NonfiniteRow(name, acc.count, list(acc.kinds), list(acc.rules), acc.first, acc.last)
            for name, acc in self._by_param.items()
        ]
        rows.sort(key=lambda row: (row.first_step if row.first_step is not None else -1, -row.count))
        return rows

    def contribute(self, fields: dict[str, Any]) -> None:
        fields["nonfinite"] = self.steps.done()
        fields["nonfinite_by_kind"] = dict(sorted(self.by_kind.items()))
        fields["nonfinite_by_rule"] = dict(sorted(self.by_rule.items(), key=lambda item: -item[1]))
        fields["nonfinite_by_param"] = self.by_param_rows()
        fields["unhalted"] = self.unhalted.done()
        fields["unhalted_params"] = list(self.unhalted_params)
        fields["group_norm_nonfinite"] = self.group_norm.done()

    def findings(self, summary: AuditSummary) -> list[Finding]:
        found = []
        if summary.unhalted.events:
            words = (
                f"{plural(summary.unhalted.distinct_steps, 'step')} applied non-finite gradients "
                "(no halt or skip rule covered them)"
            )
            found.append((FINDING_UNHALTED, words))
        if summary.nonfinite.events:
            found.append((FINDING_NONFINITE, plural(summary.nonfinite.events, "non-finite gradient")))
        if summary.group_norm_nonfinite.events:
            words = plural(summary.group_norm_nonfinite.events, "group clip") + " skipped on a non-finite norm"
            found.append((FINDING_GROUP_NORMS, words))
        return found
