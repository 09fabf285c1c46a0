"""Aggregating audit-log events into an ``AuditSummary``, in memory bounded by the model, not the log.

What is kept grows with the number of runs, rules and parameter names, never with the number of
steps: counts, first/last steps, largest values, the first few steps of each kind of incident and
the first few halts, with totals for the rest.

``Summarizer`` finds each event's run (``gradguard.audit.runs``) and hands the event to the
collector of its kind: counters snapshots (``gradguard.audit.counters``), interventions
(``gradguard.audit.interventions``), non-finite gradients (``gradguard.audit.nonfinite``), halts,
rewinds and skips (``gradguard.audit.halts_and_skips``), gradient health (``gradguard.audit.health``), the
ranks (``gradguard.audit.ranks_report``), or, for any other event name,
``OtherEventCollector``. A malformed event becomes an unreadable line in the read statistics.

The runs of a distributed job's ranks make one job (``gradguard.audit.jobs``): an event another rank of the job
already wrote at its step is a replica, counted by its run (each rank's counters are its own) but not again by
the tables, which are then per step across ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final

from gradguard.audit.counters import CounterCheck
from gradguard.audit.fields import Malformed, number_or_none
from gradguard.audit.filters import EventFilter, Filters
from gradguard.audit.halts_and_skips import KEPT_HALTS, HaltSkipCollector
from gradguard.audit.health import HealthCollector
from gradguard.audit.interventions import Entry, InterventionCollector
from gradguard.audit.loss_report import LossCollector, loss_findings
from gradguard.audit.nonfinite import NonfiniteCollector
from gradguard.audit.ranks_report import RankCollector
from gradguard.audit.reader import AnyEvent, ReadStats, Record
from gradguard.audit.rerun_report import RerunCollector
from gradguard.audit.run_state import LastIntervention, RunState
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
from gradguard.events import definitions as ev

__all__ = ["OtherEventCollector", "Summarizer", "name_of"]

KEPT_EVENT_NAMES: Final = 100


def name_of(event: AnyEvent) -> str:
    """The ``event`` name of a line read."""
    return event.event if isinstance(event, ev.ForeignEvent) else ev.event_name(type(event))


class OtherEventCollector:
    """Events of any other name (a callback's, a later guard's): counted by name, the first
    ``KEPT_EVENT_NAMES`` names apart and the rest together."""

    def __init__(self, event_filter: EventFilter) -> None:
        self._shown = event_filter.shown
        self._param_filter = event_filter.params
        self.by_name: dict[str, StepTally] = {}

    def add(self, event: AnyEvent) -> None:
        name = name_of(event)
        step = getattr(event, "step", None)
        rule = getattr(event, "rule", None)
        if not self._shown(step, rule if type(rule) is str else None):
            return
        param = getattr(event, "param", None)
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


Handler = Callable[[Any, RunState, Record], None]


def _both(first: Handler, second: Handler) -> Handler:
    """One event to two collectors, in order."""

    def handle(event: Any, run: RunState, record: Record) -> None:
        first(event, run, record)
        second(event, run, record)

    return handle


def _end_streak(
    run: RunState, events: int, last_ts: str | None, last_clip: LastIntervention | None, low: int, high: int
) -> None:
    """Write a streak of ``events`` clips counted inline to their run (their counts are in ``run.recomputed``)."""
    run.events += events
    run.last_ts = last_ts
    run.last_intervention = last_clip
    run.first_step = low
    run.last_step = high


class Summarizer:
    """Feed it ``Record`` s (``add``); ``summary`` at any time gives an ``AuditSummary``."""

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
        self.loss = LossCollector(event_filter, self.halts_and_skips)
        self.reruns = RerunCollector(event_filter)
        self.by_rank = RankCollector(event_filter)
        self._run_of = self.runs.run_of
        stops, by_rank = self.halts_and_skips, self.by_rank
        self._handlers: dict[type[AnyEvent], Handler] = {
            ev.Attach: self.runs.attach,
            ev.Detach: self.runs.detach,
            ev.Counters: self.counters.snapshot,
            ev.Intervention: self.interventions.intervention,
            ev.AdaptiveClip: self.interventions.adaptive_clip,
            ev.Nonfinite: self.nonfinite.nonfinite,
            ev.NonfiniteUnhalted: self.nonfinite.unhalted_event,
            ev.NonfiniteGroupNorm: self.nonfinite.group_norm_event,
            # The ranks first: a ``ranks`` that names no rank makes the line unreadable before anything counts it.
            ev.Halt: _both(by_rank.verdict, stops.halt),
            ev.Rewind: _both(by_rank.verdict, stops.rewind),
            ev.Skip: _both(by_rank.verdict, stops.skip),
            ev.SpikeSkip: self.halts_and_skips.spike_skip,
            ev.ScalerSkip: self.halts_and_skips.scaler_skip,
            ev.Stats: self.health.stats,
            ev.Vanishing: self.health.flag,
            ev.Exploding: self.health.flag,
            ev.Recovered: self.health.flag,
            ev.LossSpike: self.loss.spike,
            ev.LossNonfinite: self.loss.nonfinite,
            ev.LossUnseen: self.loss.unseen,
            ev.Rerun: _both(self.reruns.rerun, by_rank.rerun),
            ev.RerunUnavailable: self.reruns.unavailable,
            ev.RankOutlier: by_rank.outlier,
            ev.ReplicaDivergence: by_rank.divergence,
            ev.RankFailure: by_rank.failure,
        }

    def add(self, record: Record) -> None:
        """Take one event; one the audit cannot use is reported as a bad line (with its number) and skipped."""
        self.add_all((record,))

    def _bad(self, record: Record, reason: str) -> None:
        path = self.paths[record.file]
        self.stats.events[path] = self.stats.events.get(path, 1) - 1
        self.stats.bad_line(path, record.line, reason)

    def add_all(self, records: Iterable[Record]) -> None:
        """Take every event of ``records`` (see ``add``).

        A clip of one tensor of the run just seen (most lines of a long log) is counted inline, as
        ``InterventionCollector.tensor_clip``
        and ``RunTable.run_of`` would; every other event goes to its handler.
        """
        if self.interventions.filtered:
            for record in records:
                self._handle(record)
            return
        run_of = self._run_of
        clips = self.interventions
        entries = clips.entries
        seq = clips.seq
        intervention = ev.Intervention
        run: RunState | None = None
        run_id, run_file = "", -1
        # A streak of clips of one run is kept in locals (the run's events, last time, last clip, step span) and
        # written to the run before any other event is handled and at the end: attribute stores per line cost
        # about a tenth of the audit.
        streak = 0
        last_ts: str | None = None
        last_clip: LastIntervention | None = None
        low = high = 0
        recomputed: dict[tuple[str, str], int] = {}
        # The guard writes a step's clips rule by rule: the (rule, action) of the line before is compared (two
        # string compares), not looked up, and its clips are counted in ``pending`` till it changes.
        rule_now: str | None = None
        action_now: str | None = None
        key: tuple[str, str] = ("", "")
        by_param: dict[str, Entry] = {}
        pending = 0
        for record in records:
            event = record.event
            if (
                streak >= 0
                and type(event) is intervention
                and event.run == run_id
                and record.file == run_file
                and event.param is not None
            ):
                streak += 1
                ts = event.ts
                if ts is not None:
                    last_ts = ts
                step = event.step
                if step > high:
                    high = step
                elif step < low:
                    low = step
                last_clip = event
                rule, action, raw = event.rule, event.action, event.before
                if rule != rule_now or action != action_now:
                    if pending:
                        recomputed[key] = recomputed.get(key, 0) + pending
                        pending = 0
                    rule_now, action_now, key = rule, action, (rule, action)
                    found = entries.get(key)
                    if found is None:
                        found = entries[key] = {}
                    by_param = found
                pending += 1
                before = raw if type(raw) is float else number_or_none(raw)
                seq += 1
                entry = by_param.get(event.param)
                if entry is None:
                    by_param[event.param] = [1, step, seq, step, seq, before, step]
                    continue
                entry[0] += 1
                entry[3] = step
                entry[4] = seq
                if before is not None and (entry[5] is None or before > entry[5]):
                    entry[5] = before
                    entry[6] = step
                continue
            if pending:
                recomputed[key] = recomputed.get(key, 0) + pending
                pending = 0
            if run is not None and streak > 0:
                _end_streak(run, streak, last_ts, last_clip, low, high)
            clips.seq = seq
            try:
                run = run_of(event, record)
                run_id, run_file = event.run, record.file
                self._dispatch(event, run, record)
            except Malformed as exc:
                self._bad(record, str(exc))
            except (ArithmeticError, LookupError, TypeError, ValueError) as exc:
                # A value no definition foresaw (a fuzzed or hand-edited line): that line is lost, not the report.
                self._bad(record, f"gradguard {name_of(event)!r} event the audit cannot read ({type(exc).__name__})")
            seq = clips.seq
            # The streak starts only where the run has a step span to widen (a clip's own run_of would start it),
            # and only in a job of one rank: another rank's clips may be replicas, which the streak cannot tell.
            first, last = (None, None) if run is None else (run.first_step, run.last_step)
            if run is None or first is None or last is None or run.job.multi:
                streak = -1
            else:
                streak, last_ts, last_clip, low, high = 0, run.last_ts, run.last_intervention, first, last
                recomputed = run.recomputed
        if pending:
            recomputed[key] = recomputed.get(key, 0) + pending
        if run is not None and streak > 0:
            _end_streak(run, streak, last_ts, last_clip, low, high)
        clips.seq = seq

    def _handle(self, record: Record) -> None:
        """One event, to its run and its handler (every clip too, as a filter is on)."""
        event = record.event
        try:
            self._dispatch(event, self._run_of(event, record), record)
        except Malformed as exc:
            self._bad(record, str(exc))
        except (ArithmeticError, LookupError, TypeError, ValueError) as exc:
            self._bad(record, f"gradguard {name_of(event)!r} event the audit cannot read ({type(exc).__name__})")

    def _dispatch(self, event: AnyEvent, run: RunState, record: Record) -> None:
        """``event`` to its handler, marked as a replica where another rank of the run's job wrote it already.

        A job of one rank so far remembers its events too: another rank's run may join it later (its first line
        read after this rank's first steps: one file of several ranks, or a job's files restarted at step 0).
        """
        run.replica = run.job.replica(event, run.rank)
        try:
            handler = self._handlers.get(type(event))
            if handler is None:
                if not run.replica:
                    self.other.add(event)
            else:
                handler(event, run, record)
        finally:
            run.replica = False

    def summary(self) -> AuditSummary:
        """The summary of everything added so far."""
        runs = self.runs.infos()
        jobs = self.runs.job_infos(runs)
        totals: Counts = {}
        for job in jobs:  # a job's ranks count the same events: its counters once, not each rank's
            for rule, by_action in job.counters.items():
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
            rewinds=stops.rewinds[:KEPT_HALTS],
            rewinds_total=len(stops.rewinds),
            unlearned_steps=joined_stretches(
                stretch
                for row in stops.rewinds
                if (stretch := unlearned_stretch(row.step, row.to_step, row.skip_until)) is not None
            ),
            rewind_skips=joined_stretches(
                (row.step, row.skip_until)
                for row in stops.rewinds
                if row.step is not None and row.skip_until is not None
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
            loss=self.loss.rows(),
            loss_unseen=list(self.loss.unseen_lines),
            loss_watched=any(run.loss_watched for run in self.runs.by_id.values()),
            reruns=self.reruns.rows(),
            rerun_ranks={rank: steps.done() for rank, steps in sorted(self.reruns.by_rank.items())},
            rerun_notes=list(self.reruns.notes),
            jobs=jobs,
            by_rank=self.by_rank.rows(),
        )
        summary.findings = findings_of(summary) + loss_findings(summary)
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
