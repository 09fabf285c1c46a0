"""The ``rerun`` section in ``gradguard audit``: the steps computed again, and the ranks whose faults were transient.

``RerunCollector`` takes the ``rerun`` and ``rerun_unavailable`` events. Each re-run is counted for the counters'
cross-check (``{"rerun": {"transient": n, "reproducible": n}}``) and gathered into one ``RerunRow`` per verdict;
a transient fault is also counted against each rank whose computation differed (every rank of a process group
writes the same event, so one re-run is counted once per job and step: ``gradguard.audit.jobs``): a rank with
many is a suspect device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gradguard.audit.collector import Collector, Context, Handler
from gradguard.audit.layout import Section, Table, step_list
from gradguard.audit.reader import Record
from gradguard.audit.run_state import RunState
from gradguard.audit.summary import AuditSummary, RerunRow, StepTally
from gradguard.events.counters import RERUN_RULE
from gradguard.events.definitions import Rerun, RerunUnavailable

__all__ = ["RerunCollector", "rerun_section"]

KEPT_NOTES: Final = 10


class RerunCollector(Collector):
    """Takes the ``rerun`` section's events."""

    def __init__(self, context: Context) -> None:
        self._shown = context.event_filter.shown
        self._steps: dict[str, StepTally] = {}
        self._asked: dict[str, dict[str, int]] = {}
        self._seen: set[tuple[str, int | None]] = set()
        self.by_rank: dict[int, StepTally] = {}
        """Rank -> the steps at which its computation differed (transient faults)."""
        self.notes: list[str] = []

    def reads(self) -> Mapping[type[Any], Handler]:
        return {Rerun: self.rerun, RerunUnavailable: self.unavailable}

    def contribute(self, fields: dict[str, Any]) -> None:
        fields["reruns"] = self.rows()
        fields["rerun_ranks"] = {rank: steps.done() for rank, steps in sorted(self.by_rank.items())}
        fields["rerun_notes"] = list(self.notes)

    def rerun(self, event: Rerun, run: RunState, record: Record) -> None:
        if run.replica or not self._shown(event.step, RERUN_RULE):  # every rank of the group wrote it: once
            return
        self._steps.setdefault(event.verdict, StepTally()).add(event.step)
        asked = self._asked.setdefault(event.verdict, {})
        asked[event.asked] = asked.get(event.asked, 0) + 1
        key = (run.run, event.step)
        if event.verdict == "transient" and key not in self._seen:  # a run that wrote it twice (a hand-made log)
            self._seen.add(key)
            for rank in event.ranks:
                self.by_rank.setdefault(rank, StepTally()).add(event.step)

    def unavailable(self, event: RerunUnavailable, run: RunState, record: Record) -> None:
        if not run.replica and len(self.notes) < KEPT_NOTES:
            self.notes.append(f"run {run.run}, rank {run.rank}, step {event.step}: {event.why}")

    def rows(self) -> list[RerunRow]:
        order = {"transient": 0, "reproducible": 1}
        return [
            RerunRow(verdict, self._steps[verdict].done(), dict(sorted(self._asked[verdict].items())))
            for verdict in sorted(self._steps, key=lambda verdict: order.get(verdict, 2))
        ]


def rerun_section(summary: AuditSummary) -> Section:
    """``Re-runs (the rerun section)``: a row per verdict, the transient faults by rank, the steps not re-run."""
    rows = [
        [
            row.verdict,
            f"{row.steps.events:,}",
            step_list(row.steps),
            ", ".join(f"{a} {n:,}" for a, n in row.asked.items()),
        ]
        for row in summary.reruns
    ]
    lines = [] if rows else ["none"]
    after = []
    if summary.rerun_ranks:
        after.append(
            "transient faults by rank (a rank with many is a suspect device): "
            + ", ".join(
                f"rank {rank} {steps.events:,} (steps {step_list(steps)})"
                for rank, steps in summary.rerun_ranks.items()
            )
        )
        most = max(steps.events for steps in summary.rerun_ranks.values())
        worst = [rank for rank, steps in summary.rerun_ranks.items() if steps.events == most]
        if len(worst) < len(summary.rerun_ranks):  # a tie names every rank of it; all alike, none stands out
            after.append(f"most: rank{'s' if len(worst) > 1 else ''} {', '.join(map(str, worst))}")
    after += [f"not re-run: {note}" for note in summary.rerun_notes]
    table = Table(["verdict", "count", "steps", "asked by"], rows, frozenset({1})) if rows else None
    return Section("Re-runs (the rerun section)", lines, table, after)
