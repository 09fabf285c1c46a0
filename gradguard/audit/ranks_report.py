"""The "Ranks" section of ``gradguard audit``: what the log says about each rank of a distributed run.

``RankCollector`` takes the events that name ranks: ``halt``, ``rewind`` and ``skip`` (their ``ranks``, the ranks
whose own gradients, before the reduction, held the fault, ``{"2": "host-a"}``), ``rank_outlier`` (a rank far off
the others), ``replica_divergence`` (replicas outside the majority), ``rank_failure`` (an exception in one rank's
step) and ``rerun`` (the ranks whose computations of a re-run step differed: ``transient``; or did not:
``reproducible``). Every rank writes each of them, so each is counted once per job and step (a replica is skipped:
``gradguard.audit.jobs``). A table of one row per rank: a rank that many faults name is a suspect device or host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gradguard.audit.collector import Collector, Context, Handler
from gradguard.audit.fields import Malformed
from gradguard.audit.layout import Section, Table, step_list
from gradguard.audit.layout import plural as _plural
from gradguard.audit.reader import Record
from gradguard.audit.run_state import RunState
from gradguard.audit.summary import AuditSummary, RankRow, StepTally
from gradguard.events.counters import RERUN_RULE
from gradguard.events.definitions import Halt, RankFailure, RankOutlier, ReplicaDivergence, Rerun, Rewind, Skip

__all__ = ["RankCollector", "most_faults", "ranks_section"]

KEPT_ERRORS: Final = 3
"""The exceptions of each rank's ``rank_failure`` events kept (the first)."""
_VERDICT_COLUMN: Final = {Halt: "halts", Rewind: "rewinds", Skip: "skips"}


class _Rank:
    __slots__ = ("counts", "errors", "hosts", "steps")

    def __init__(self) -> None:
        self.hosts: dict[str, None] = {}
        self.counts: dict[str, int] = {}
        self.steps = StepTally()
        self.errors: list[str] = []


class RankCollector(Collector):
    """Takes every event that names a rank; ``rows`` gives one ``RankRow`` per rank named, in rank order."""

    def __init__(self, context: Context) -> None:
        self._shown = context.event_filter.shown
        self._ranks: dict[int, _Rank] = {}

    def reads(self) -> Mapping[type[Any], Handler]:
        return {
            Halt: self.verdict,
            Rewind: self.verdict,
            Skip: self.verdict,
            RankOutlier: self.outlier,
            ReplicaDivergence: self.divergence,
            RankFailure: self.failure,
            Rerun: self.rerun,
        }

    def contribute(self, fields: dict[str, Any]) -> None:
        fields["by_rank"] = self.rows()

    def _add(self, rank: int, host: str | None, column: str, step: int) -> _Rank:
        entry = self._ranks.get(rank)
        if entry is None:
            entry = self._ranks[rank] = _Rank()
        if host:
            entry.hosts[host] = None
        entry.counts[column] = entry.counts.get(column, 0) + 1
        entry.steps.add(step)
        return entry

    def _named(self, ranks: dict[str, str], column: str, step: int, event: str) -> None:
        for key, host in ranks.items():
            try:
                rank = int(key)
            except ValueError:
                raise Malformed(f"gradguard {event!r} event whose 'ranks' has {key!r}, not a rank number") from None
            self._add(rank, host, column, step)

    def verdict(self, event: Halt | Rewind | Skip, run: RunState, record: Record) -> None:
        """A halt, rewind or skip: counted against each rank its ``ranks`` names (none in one process)."""
        if run.replica or not event.ranks or not self._shown(event.step, event.rule):
            return
        self._named(event.ranks, _VERDICT_COLUMN[type(event)], event.step, type(event).__name__.lower())

    def outlier(self, event: RankOutlier, run: RunState, record: Record) -> None:
        if not run.replica and self._shown(event.step, None):
            self._named(event.ranks, "outliers", event.step, "rank_outlier")

    def divergence(self, event: ReplicaDivergence, run: RunState, record: Record) -> None:
        if not run.replica and self._shown(event.step, None):
            self._named(event.ranks, "divergences", event.step, "replica_divergence")

    def failure(self, event: RankFailure, run: RunState, record: Record) -> None:
        if run.replica or not self._shown(event.step, None):
            return
        entry = self._add(event.failed_rank, event.host, "failures", event.step)
        if len(entry.errors) < KEPT_ERRORS:
            entry.errors.append(f"step {event.step}: {event.error}")

    def rerun(self, event: Rerun, run: RunState, record: Record) -> None:
        """A re-run's verdict, against each rank whose computation it names."""
        if run.replica or not self._shown(event.step, RERUN_RULE):
            return
        for rank in event.ranks:
            self._add(rank, None, event.verdict, event.step)

    def rows(self) -> list[RankRow]:
        rows = []
        for rank, entry in sorted(self._ranks.items()):
            counts = entry.counts
            rows.append(
                RankRow(
                    rank=rank,
                    hosts=list(entry.hosts),
                    halts=counts.get("halts", 0),
                    rewinds=counts.get("rewinds", 0),
                    skips=counts.get("skips", 0),
                    outliers=counts.get("outliers", 0),
                    divergences=counts.get("divergences", 0),
                    failures=counts.get("failures", 0),
                    transient=counts.get("transient", 0),
                    reproducible=counts.get("reproducible", 0),
                    steps=entry.steps.done(),
                    errors=list(entry.errors),
                )
            )
        return rows


def ranks_section(summary: AuditSummary) -> Section:
    """``Ranks``: one row per rank an event named; faults are those made on the rank, before the reduction."""
    title = "Ranks (faults by the rank where they were made, outliers, divergences, failures, re-runs)"
    if not summary.by_rank:
        return Section(title, ["none: no event named a rank (a fault made after the reduction names none)"])
    rows = [
        [
            str(row.rank),
            ", ".join(row.hosts) or "?",
            f"{row.halts + row.rewinds + row.skips:,}",
            f"{row.halts:,}",
            f"{row.rewinds:,}",
            f"{row.skips:,}",
            f"{row.outliers:,}",
            f"{row.divergences:,}",
            f"{row.failures:,}",
            f"{row.transient:,}",
            f"{row.reproducible:,}",
            step_list(row.steps),
        ]
        for row in summary.by_rank
    ]
    headers = [
        "rank",
        "host",
        "faults",
        "halts",
        "rewinds",
        "skips",
        "outliers",
        "divergences",
        "failures",
        "transient",
        "reproducible",
        "steps",
    ]
    lines = [
        "per step across ranks: an event every rank wrote is counted once; faults: halts, rewinds and skips whose "
        "gradient was at fault on that rank before the reduction"
    ]
    after = [f"rank {row.rank} failed at {error}" for row in summary.by_rank for error in row.errors]
    most = most_faults(summary.by_rank)
    if most is not None:
        after.append(most)
    return Section(title, lines, Table(headers, rows, frozenset(range(2, 11))), after)


def most_faults(rows: list[RankRow]) -> str | None:
    """``most faults: rank 1 (host-b), 3 faults (a suspect device or host)``; a tie names every rank of it, and
    ranks all at fault equally (or none at fault) name none: no rank stands out."""
    faults = {row.rank: row.halts + row.rewinds + row.skips for row in rows}
    most = max(faults.values(), default=0)
    worst = [row for row in rows if faults[row.rank] == most]
    if not most or len(worst) == len(rows):
        return None
    named = ", ".join(f"{row.rank} ({', '.join(row.hosts) or 'host unknown'})" for row in worst)
    each = "" if len(worst) == 1 else " each"
    ranks = "ranks" if len(worst) > 1 else "rank"
    return f"most faults: {ranks} {named}, {_plural(most, 'fault')}{each} (a suspect device or host)"
