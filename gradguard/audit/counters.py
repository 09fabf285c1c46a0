"""The counters section: each run's ``guard.counters.snapshot()`` reproduced from its events, and every snapshot
the log carries cross-checked against them.

``guard.counters.snapshot()`` is ``{rule: {action: count}}``. The log carries that snapshot whole in every
``counters`` event (every ``summary_every`` steps), in ``detach`` and in ``halt``; it also carries one event per
clip, non-finite detection, halt, skip, loss verdict, re-run and ranks check, but nothing per step for ``scale``,
``zero`` and ``drop``. ``CounterCheck`` counts every event as the guard counted it (``gradguard.audit.counting``)
and, at every snapshot, checks the counts against it: a difference means lost or foreign lines, and is a finding.
A run's counters are its last snapshot plus what the events after it add (``run_state.reproduced_counters``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, Union

from gradguard.audit import counting
from gradguard.audit.collector import Collector, Context, Finding, Handler
from gradguard.audit.reader import Record
from gradguard.audit.run_state import RunState, recomputable
from gradguard.audit.summary import FINDING_MISMATCHES, AuditSummary, Mismatch
from gradguard.events import definitions as ev

Snapshot = Union[ev.Counters, ev.Detach, ev.Halt]  # noqa: UP007
"""An event that carries the run's whole ``counters``."""

__all__ = ["CounterCheck"]

KEPT_MISMATCHES: Final = 50


class CounterCheck(Collector):
    """Counts every counted event into its run (and job), and checks each snapshot against the counts so far."""

    def __init__(self, context: Context) -> None:
        self._where = context.where
        self.mismatches: list[Mismatch] = []
        """The first ``KEPT_MISMATCHES`` mismatches."""
        self.mismatches_total = 0

    def reads(self) -> Mapping[type[Any], Handler]:
        counted: dict[type[Any], Handler] = {
            kind: _counting(count) for kind, count in counting.COUNTS.items() if kind is not ev.Halt
        }
        return counted | {ev.Halt: self.halt, ev.Counters: self.snapshot, ev.Detach: self.snapshot}

    def clips(self, run: RunState, records: Sequence[Record]) -> None:
        """A streak of one-tensor clips, all of one rule and action: counted at once."""
        if records:
            first: ev.Intervention = records[0].event  # type: ignore[assignment]  # a streak holds clips only
            run.count(first.rule, first.action, len(records))

    def nonfinites(self, run: RunState, records: Sequence[Record]) -> None:
        """A streak of non-finite detections, all of one rule and kind: counted at once."""
        counting.nonfinites([record.event for record in records], run)  # type: ignore[misc]  # nonfinite lines only

    def halt(self, event: ev.Halt, run: RunState, record: Record) -> None:
        counting.halt(event, run)
        self.snapshot(event, run, record)

    def snapshot(self, event: Snapshot, run: RunState, record: Record) -> None:
        counts = event.counters
        steps = None if isinstance(event, ev.Halt) else event.steps
        if steps is not None:
            run.steps = steps if run.steps is None else max(run.steps, steps)
        step = None if isinstance(event, ev.Detach) else event.step
        for rule, by_action in counts.items():
            for action, logged in by_action.items():
                key = (rule, action)
                if recomputable(key) and action not in run.unverifiable:
                    self._check(run, key, logged, step, record)
        for key, counted in run.recomputed.items():
            if (
                counted
                and recomputable(key)
                and key[1] not in run.unverifiable
                and key[1] not in counts.get(key[0], {})
            ):
                self._check(run, key, 0, step, record)
        run.snapshot = counts
        run.snapshots += 1
        run.snapshot_event = ev.event_name(type(event))
        run.snapshot_step = step if step is not None else run.last_step
        run.at_snapshot = dict(run.recomputed)

    def _check(self, run: RunState, key: tuple[str, str], logged: int, step: int | None, record: Record) -> None:
        counted = run.recomputed.get(key, 0)
        if counted == logged or key in run.mismatched:
            return
        run.mismatched.add(key)
        self.mismatches_total += 1
        if len(self.mismatches) < KEPT_MISMATCHES:
            self.mismatches.append(Mismatch(run.run, step, key[0], key[1], logged, counted, self._where(record)))

    def contribute(self, fields: dict[str, Any]) -> None:
        fields["mismatches"] = list(self.mismatches)
        fields["mismatches_total"] = self.mismatches_total

    def findings(self, summary: AuditSummary) -> list[Finding]:
        n = summary.mismatches_total
        if not n:
            return []
        words = f"{n:,} counter mismatch{'' if n == 1 else 'es'} between the events and the counters events"
        return [(FINDING_MISMATCHES, words)]


def _counting(count: counting.Count) -> Handler:
    def handle(event: Any, run: RunState, record: Record) -> None:
        count(event, run)

    return handle
