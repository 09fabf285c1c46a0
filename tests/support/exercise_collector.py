"""A collector of the audit's that ships nowhere: the counters events each rank wrote, and the ranks that wrote
none. It shows what adding a section to ``gradguard audit`` takes: this one module and one registration
(``with registered("counters_by_rank", CountersByRank):`` in tests/test_audit_collectors.py), the dispatcher and the
other collectors unchanged."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradguard.audit.collector import Collector, Context, Finding, Handler
from gradguard.audit.reader import Record
from gradguard.audit.run_state import RunState
from gradguard.audit.summary import FINDING_ADDED, AddedSection, AuditSummary
from gradguard.events.definitions import Attach, Counters


class CountersByRank(Collector):
    """Counts the ``counters`` events of each rank (each rank writes its own: none is a replica)."""

    def __init__(self, context: Context) -> None:
        self.by_rank: dict[int, int] = {}
        self.replicas_seen = 0
        """Events handed over marked as replicas (a rank's own counters never are)."""

    def reads(self) -> Mapping[type[Any], Handler]:
        return {Attach: self.attach, Counters: self.counters}

    def attach(self, event: Attach, run: RunState, record: Record) -> None:
        self.by_rank.setdefault(run.rank, 0)

    def counters(self, event: Counters, run: RunState, record: Record) -> None:
        self.replicas_seen += run.replica
        self.by_rank[run.rank] = self.by_rank.get(run.rank, 0) + 1

    def section(self, summary: AuditSummary) -> AddedSection:
        lines = [f"rank {rank}: {n} counters events" for rank, n in sorted(self.by_rank.items())]
        return AddedSection(
            "counters_by_rank", {str(rank): n for rank, n in self.by_rank.items()}, "Counters events by rank", lines
        )

    def findings(self, summary: AuditSummary) -> list[Finding]:
        silent = [rank for rank, n in sorted(self.by_rank.items()) if not n]
        return [(FINDING_ADDED, f"ranks without a counters event: {silent}")] if silent else []
