"""Aggregating audit-log events into an :class:`AuditSummary`, in memory bounded by the model, not the log.

What is kept grows with the number of runs, rules and parameter names, never with the number of
steps: counts, first/last steps, largest values, the first few steps of each kind of incident and
the first few halts, with totals for the rest.

:class:`Summarizer` finds each event's run (:mod:`gradguard.audit.runs`) and hands the event to the
collector of its kind: counters snapshots (:mod:`gradguard.audit.counters`), interventions
(:mod:`gradguard.audit.interventions`), non-finite gradients (:mod:`gradguard.audit.nonfinite`),
halts, rewinds and skips (:mod:`gradguard.audit.halts_and_skips`), gradient health (:mod:`gradguard.audit.health`),
or, for any other event name,
:class:`OtherEventCollector`. A malformed event becomes an unreadable line in the read statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final

from gradguard.audit.counters import CounterCheck
from gradguard.audit.fields import Malformed, per_parameter
from gradguard.audit.filters import EventFilter, Filters
from gradguard.audit.halts_and_skips import KEPT_HALTS, HaltSkipCollector
from gradguard.audit.health import HealthCollector
from gradguard.audit.interventions import InterventionCollector
from gradguard.audit.nonfinite import NonfiniteCollector
from gradguard.audit.reader import ReadStats, Record
from gradguard.audit.run_state import RunState
from gradguard.audit.runs import RunTable, seconds_between
from gradguard.audit.summary import (
    AuditSummary,
    Counts,
    FileInfo,
    RunInfo,
    StepTally,
    findings_of,
    joined_stretches,
    unlearned_stretch,
)

__all__ = ["OtherEventCollector", "Summarizer"]

KEPT_EVENT_NAMES: Final = 100


class OtherEventCollector:
    """Events of any other name (a callback's, a later guard's): counted by name, the first
    :data:`KEPT_EVENT_NAMES` names apart and the rest together."""

    def __init__(self, event_filter: EventFilter) -> None:
        self._shown = event_filter.shown
        self._param_filter = event_filter.params
        self.by_name: dict[str, StepTally] = {}

    def add(self, event: dict[str, Any]) -> None:
        name: str = event["event"]
        step = event.get("step")
        rule = event.get("rule")
        if not self._shown(step, rule if type(rule) is str else None):
            return
        param = event.get("param")
        if self._param_filter is not None and not (type(param) is str and self._param_filter(param)):
            return
        steps = self.by_name.get(name)
        if steps is None:
            if len(self.by_name) >= KEPT_EVENT_NAMES:
                name = "(other names)"
                steps = self.by_name.get(name)
            if steps is None:
                steps = self.by_name[name] = StepTally()
        steps.add(step)


class Summarizer:
    """Feed it :class:`Record` s (:meth:`add`); :meth:`summary` at any time gives an :class:`AuditSummary`."""

    def __init__(self, paths: Iterable[str], stats: ReadStats, filters: Filters | None = None) -> None:
        self.paths = list(paths)
        self.stats = stats
        self.filters = filters or Filters()
        event_filter = EventFilter(self.filters)
        self.counters = CounterCheck(self.paths)
        self.runs = RunTable(self.paths, self.counters)
        self.interventions = InterventionCollector(event_filter)
        self.nonfinite = NonfiniteCollector(event_filter)
        self.halts_and_skips = HaltSkipCollector(self.paths, event_filter, self.counters)
        self.other = OtherEventCollector(event_filter)
        self.health = HealthCollector(event_filter)
        self._run_of = self.runs.run_of
        self._handlers: dict[str, Callable[[dict[str, Any], RunState, Record], None]] = {
            "attach": self.runs.attach,
            "detach": self.runs.detach,
            "counters": self.counters.snapshot,
            "intervention": self.interventions.intervention,
            "adaptive_clip": self._adaptive_clip,
            "nonfinite": self.nonfinite.nonfinite,
            "nonfinite_unhalted": self.nonfinite.unhalted_event,
            "nonfinite_group_norm": self.nonfinite.group_norm_event,
            "halt": self.halts_and_skips.halt,
            "rewind": self.halts_and_skips.rewind,
            "skip": self.halts_and_skips.skip,
            "spike_skip": self.halts_and_skips.spike_skip,
            "scaler_skip": self.halts_and_skips.scaler_skip,
            "stats": self.health.stats,
            "vanishing": self.health.flag,
            "exploding": self.health.flag,
            "recovered": self.health.flag,
        }

    def _adaptive_clip(self, event: dict[str, Any], run: RunState, record: Record) -> None:
        """An adaptive clip is an intervention per parameter (``scope: tensor`` events list them in one line)."""
        for one in per_parameter(event):
            self.interventions.intervention(dict(one), run, record)

    def add(self, record: Record) -> None:
        """Take one event; a malformed one is reported as a bad line (with its number) and skipped."""
        event = record.event
        try:
            run = self._run_of(event, record)
            handler = self._handlers.get(event["event"])
            if handler is None:
                self.other.add(event)
            else:
                handler(event, run, record)
        except Malformed as exc:
            self._bad(record, str(exc))
        except (ArithmeticError, LookupError, TypeError, ValueError) as exc:
            # A value no check above foresaw (a fuzzed or hand-edited line): that line is lost, not the report.
            self._bad(record, f"gradguard {event.get('event')!r} event the audit cannot read ({type(exc).__name__})")

    def _bad(self, record: Record, reason: str) -> None:
        path = self.paths[record.file]
        self.stats.events[path] = self.stats.events.get(path, 1) - 1
        self.stats.bad_line(path, record.line, reason)

    def add_all(self, records: Iterable[Record]) -> None:
        for record in records:
            self.add(record)

    def summary(self) -> AuditSummary:
        """The summary of everything added so far."""
        runs = self.runs.infos()
        totals: Counts = {}
        for info in runs:
            for rule, by_action in info.counters.items():
                into = totals.setdefault(rule, {})
                for action, n in by_action.items():
                    into[action] = into.get(action, 0) + n
        starts = [info.start for info in runs if info.start]
        ends = [info.end for info in runs if info.end]
        start, end = (min(starts) if starts else None), (max(ends) if ends else None)
        firsts = [info.first_step for info in runs if info.first_step is not None]
        lasts = [info.last_step for info in runs if info.last_step is not None]
        by_rule_action, by_param = self.interventions.rows()
        nonfinite = self.nonfinite
        stops = self.halts_and_skips
        health, health_flags = self.health.rows()
        files = [
            FileInfo(
                path,
                self.stats.lines.get(path, 0),
                self.stats.events.get(path, 0),
                self.stats.bad_per_file.get(path, 0),
            )
            for path in self.paths
        ]
        summary = AuditSummary(
            files=files,
            runs=runs,
            ranks=sorted({info.rank for info in runs}),
            first_step=min(firsts) if firsts else None,
            last_step=max(lasts) if lasts else None,
            start=start,
            end=end,
            seconds=seconds_between(start, end),
            lines=sum(info.lines for info in files),
            events=sum(info.events for info in files),
            filters=self.filters,
            totals=totals,
            totals_complete=all(info.counters_complete for info in runs),
            intervention_count=sum(row.count for row in by_rule_action),
            intervention_events=sum(row.events for row in by_rule_action),
            by_rule_action=by_rule_action,
            by_param=by_param,
            nonfinite=nonfinite.steps.done(),
            nonfinite_by_kind=dict(sorted(nonfinite.by_kind.items())),
            nonfinite_by_rule=dict(sorted(nonfinite.by_rule.items(), key=lambda item: -item[1])),
            nonfinite_by_param=nonfinite.by_param_rows(),
            unhalted=nonfinite.unhalted.done(),
            unhalted_params=list(nonfinite.unhalted_params),
            group_norm_nonfinite=nonfinite.group_norm.done(),
            halts=list(stops.halts),
            halts_total=stops.halts_total,
            rewinds=list(stops.rewinds.values())[:KEPT_HALTS],
            rewinds_total=len(stops.rewinds),
            unlearned_steps=joined_stretches(
                stretch
                for row in stops.rewinds.values()
                if (stretch := unlearned_stretch(row.step, row.to_step, row.skip_until)) is not None
            ),
            skips=stops.skips.done(),
            skips_by_rule=dict(stops.skips_by_rule),
            skipped_params=dict(sorted(stops.skipped_params.items(), key=lambda item: -item[1])),
            spiked_params=dict(sorted(stops.spiked_params.items(), key=lambda item: -item[1])),
            largest_spike=stops.largest_spike,
            skip_origins=list(stops.skip_origins),
            scaler_skips=stops.scaler.done(),
            other_events={name: steps.done() for name, steps in sorted(self.other.by_name.items())},
            bad_lines=list(self.stats.bad_lines),
            bad_lines_total=self.stats.bad_total,
            mismatches=list(self.counters.mismatches),
            mismatches_total=self.counters.mismatches_total,
            notes=self._notes(runs),
            findings=[],
            series_counts=dict(self.interventions.series),
            health=health,
            health_flags=health_flags,
        )
        summary.findings = findings_of(summary)
        return summary

    def _notes(self, runs: list[RunInfo]) -> list[str]:
        notes = []
        if self.filters.rules:
            seen: set[str] = set()
            for run in self.runs.by_id.values():
                seen.update(run.rules_matched)
                seen.update(rule for rule, _ in run.recomputed)
                if run.snapshot:
                    seen.update(run.snapshot)
            missing = [rule for rule in self.filters.rules if rule not in seen]
            if missing:
                known = ", ".join(sorted(seen)) or "none"
                notes.append(f"--rule {', '.join(missing)}: no such rule in the log (rules seen: {known})")
        for info in runs:
            if not info.counters_complete and info.counters:
                notes.append(
                    f"run {info.run}: scale/zero/drop counts after {info.counters_source.split(' + ')[0]} are "
                    "not in the log (the guard writes them every summary_every steps and at detach)"
                )
        return notes
