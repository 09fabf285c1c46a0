"""Aggregating audit-log events into an ``AuditSummary``, in memory bounded by the model, not the log.

What is kept grows with the number of runs, rules and parameter names, never with the number of steps: counts,
first/last steps, largest values, the first few steps of each kind of incident and the first few halts, with totals
for the rest.

``Summarizer`` builds the registered collectors (``gradguard.audit.collectors``) side by side from one ``Context``,
and the one dispatcher (``gradguard.audit.dispatch``) that hands them the lines; ``summary`` gathers each
collector's part of the ``AuditSummary``, its findings and any section of its own. A line flows one way: command ->
reader -> dispatcher -> collectors -> summary -> report.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gradguard.audit.collector import Context, Finding
from gradguard.audit.collectors import build
from gradguard.audit.dispatch import Dispatcher
from gradguard.audit.filters import EventFilter, Filters
from gradguard.audit.layout import plural
from gradguard.audit.reader import ReadStats, Record
from gradguard.audit.run_book import RunBook
from gradguard.audit.summary import FINDING_UNREADABLE, AuditSummary, FileInfo

__all__ = ["Summarizer"]


class Summarizer:
    """Feed it ``Record`` s (``add``, ``add_all``); ``summary`` at any time gives an ``AuditSummary``."""

    def __init__(self, paths: Iterable[str], stats: ReadStats, filters: Filters | None = None) -> None:
        self.paths = list(paths)
        self.stats = stats
        self.filters = filters or Filters()
        self.runs = RunBook()
        context = Context(self.paths, self.filters, EventFilter(self.filters), stats, self.runs)
        self.collectors = build(context)
        self.dispatcher = Dispatcher(self.runs, self.collectors, self.paths, stats, one_by_one=self.filters.active)

    def add(self, record: Record) -> None:
        """Take one event; one the audit cannot use is reported as a bad line (with its number) and skipped."""
        self.dispatcher.add_all((record,))

    def add_all(self, records: Iterable[Record]) -> None:
        """Take every event of ``records`` (see ``add``)."""
        self.dispatcher.add_all(records)

    def summary(self) -> AuditSummary:
        """The summary of everything added so far."""
        stats = self.stats
        files = [
            FileInfo(path, stats.lines.get(path, 0), stats.events.get(path, 0), stats.bad_per_file.get(path, 0))
            for path in self.paths
        ]
        fields: dict[str, Any] = {
            "files": files,
            "lines": sum(info.lines for info in files),
            "events": sum(info.events for info in files),
            "filters": self.filters,
            "bad_lines": list(stats.bad_lines),
            "bad_lines_total": stats.bad_total,
            "findings": [],
        }
        for collector in self.collectors:
            collector.contribute(fields)
        summary = AuditSummary(**fields)
        found: list[Finding] = []
        if summary.bad_lines_total:
            found.append((FINDING_UNREADABLE, plural(summary.bad_lines_total, "unreadable line")))
        for collector in self.collectors:
            found += collector.findings(summary)
            added = collector.section(summary)
            if added is not None:
                summary.added.append(added)
        summary.findings = [words for _, words in sorted(found, key=lambda finding: finding[0])]
        return summary
