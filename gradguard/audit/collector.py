"""What a collector of ``gradguard audit`` is: one section of the report, the findings about it, and the events it
reads, knowing nothing of the other collectors.

A collector says which events it reads (``reads``: event type -> handler). The dispatcher
(``gradguard.audit.dispatch``) hands it each of them with the event's run, its replica mark already set
(``RunState.replica``: another rank of the job wrote the same event at its step), and its record (file and line).
When the log is read, the collector gives its part of the ``AuditSummary`` (``contribute``) and its findings
(``findings``). A collector whose data the summary has no field for (one added by a user or a test) gives its own
section instead (``section``: its JSON under its name, and its text). Collectors are registered in one place,
``gradguard.audit.collectors``; none builds, holds or calls another.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from gradguard.audit.filters import EventFilter, Filters
from gradguard.audit.reader import ReadStats, Record
from gradguard.audit.run_state import RunState
from gradguard.audit.summary import AddedSection, AuditSummary
from gradguard.events.definitions import Intervention, Nonfinite

if TYPE_CHECKING:
    from gradguard.audit.run_book import RunBook

__all__ = ["UNCLAIMED", "Collector", "Context", "Finding", "Handler"]

Handler = Callable[[Any, RunState, Record], None]
"""Takes one event, its run (replica mark set) and its record."""

Finding = tuple[int, str]
"""(place, words): a finding and its place in the report's Findings line (``gradguard.audit.summary``'s
``FINDING_*`` places), so the line reads the same whichever collector registered first."""


class Unclaimed:
    """The key a collector reads under to take the events no collector reads (a later guard's, a callback's)."""


UNCLAIMED: Final = Unclaimed


@dataclass(frozen=True)
class Context:
    """What every collector is built from (``factory(context)``): the same for all, none of them another."""

    paths: list[str]
    """The files read, by index (``Record.file``)."""
    filters: Filters
    event_filter: EventFilter
    stats: ReadStats
    """What the reader counted: lines, events, unreadable lines."""
    runs: RunBook
    """Every run and job so far (the dispatcher's bookkeeping), for the collectors that report on them."""

    def where(self, record: Record) -> str:
        """``path:line`` of a record."""
        return f"{self.paths[record.file]}:{record.line}"


class Collector:
    """One section of the report. Override ``reads`` and what the section needs of the rest."""

    def reads(self) -> Mapping[type[Any], Handler]:
        """Event type (or ``UNCLAIMED``) -> the handler that takes it."""
        return {}

    def clips(self, run: RunState, records: Sequence[Record]) -> None:
        """A streak of one-tensor clips (``Intervention`` with a ``param``) of ``run``, all of one rule and action,
        read one after the other (most lines of a long log), all replicas or none (``run.replica``): each to its
        handler, unless the collector takes them at once."""
        self._each(Intervention, run, records)

    def nonfinites(self, run: RunState, records: Sequence[Record]) -> None:
        """A streak of ``nonfinite`` detections of ``run`` (a NaN step writes one per tensor), all of one rule and kind,
        all replicas or none: each to its handler, unless the collector takes them at once."""
        self._each(Nonfinite, run, records)

    def _each(self, kind: type[Any], run: RunState, records: Sequence[Record]) -> None:
        """A streak's records, each to the collector's handler of ``kind``."""
        handle = self.reads()[kind]
        for record in records:
            handle(record.event, run, record)

    def contribute(self, fields: dict[str, Any]) -> None:
        """Put the collector's fields of the ``AuditSummary`` into ``fields``."""

    def findings(self, summary: AuditSummary) -> list[Finding]:
        """What the section found that the user must look at (each makes the audit exit 1)."""
        return []

    def section(self, summary: AuditSummary) -> AddedSection | None:
        """A section of its own, for a collector whose data the ``AuditSummary`` has no field for."""
        return None
