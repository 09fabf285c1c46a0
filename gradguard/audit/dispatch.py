"""The one dispatcher of ``gradguard audit``: every line read goes through ``Dispatcher.add_all``, once.

For each record it does the run's bookkeeping (``RunBook.run_of``: its file, time, step span), says whether the event
is a replica (another rank of the job wrote it at its step: ``Job.replica``; a job of one rank cannot have one and
only holds its events, ``Job.hold``), and hands it to every collector that registered for its type, in registration
order (``gradguard.audit.collectors``). No collector sees an event before this is done, and none does it again.

Most lines of a long log are clips of one tensor of the run, rule and action just seen, and a NaN step writes a
``nonfinite`` line per tensor of one run, rule and kind: such lines are gathered while they last and handed to each
collector that reads them at once (``Collector.clips``, ``Collector.nonfinites``), a streak per collector instead of
a call per line per collector; in a job of several ranks, in parts that are all replicas or none
(``Job.streak_replicas``, marked on the run as for any event); in a job of one rank, held as a
whole (``Job.hold_streak``). A filter on (``--since``, ``--rule``, ...) takes them one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Any, Final

from gradguard.audit.collector import UNCLAIMED, Collector, Handler
from gradguard.audit.fields import Malformed
from gradguard.audit.reader import AnyEvent, ReadStats, Record
from gradguard.audit.run_book import RunBook
from gradguard.audit.run_state import RunState
from gradguard.events import definitions as ev

__all__ = ["STREAK_RECORDS", "Dispatcher", "Readers", "name_of"]

STREAK_RECORDS: Final = 512
"""Records of an iterator taken at a time (a list is taken whole: its records are held already)."""
Readers = tuple[Callable[[RunState, Sequence[Record]], None], ...]
"""The collectors' ``clips`` (or ``nonfinites``), each taking a streak at once."""
_UNREADABLE = (ArithmeticError, LookupError, TypeError, ValueError)
"""What a collector may raise on a value no definition foresaw (a fuzzed or hand-edited line): that line is lost,
not the report."""
_REFUSED = (Malformed, *_UNREADABLE)
"""What makes a line unreadable to the dispatcher: a definition's refusal (``Malformed``), or ``_UNREADABLE``."""


def name_of(event: AnyEvent) -> str:
    """The ``event`` name of a line read."""
    return event.event if isinstance(event, ev.ForeignEvent) else ev.event_name(type(event))


class Dispatcher:
    """Takes records (``add_all``) and hands each event, with its run, to the collectors registered for its type."""

    def __init__(
        self,
        runs: RunBook,
        collectors: Sequence[Collector],
        paths: Sequence[str],
        stats: ReadStats,
        *,
        one_by_one: bool,
    ) -> None:
        self.runs = runs
        self.paths = list(paths)
        self.stats = stats
        self.one_by_one = one_by_one
        """Whether every clip goes through its handlers (a filter is on): no streak."""
        by_type: dict[type[Any], list[Handler]] = {}
        for collector in collectors:
            for kind, handler in collector.reads().items():
                by_type.setdefault(kind, []).append(handler)
        self._unclaimed = tuple(by_type.pop(UNCLAIMED, ()))
        self._handlers = {kind: tuple(handlers) for kind, handlers in by_type.items()}
        self._clip_readers: Readers = tuple(one.clips for one in collectors if ev.Intervention in one.reads())
        self._nonfinite_readers: Readers = tuple(one.nonfinites for one in collectors if ev.Nonfinite in one.reads())

    def add_all(self, records: Iterable[Record]) -> None:
        """Take every event of ``records``: a list (a read chunk's) as it is, an iterator ``STREAK_RECORDS`` at a time
        (a streak holds no more: memory stays a chunk's, whatever the caller hands in)."""
        if isinstance(records, list):
            self._add_batch(records)
            return
        iterator = iter(records)
        while batch := list(islice(iterator, STREAK_RECORDS)):
            self._add_batch(batch)

    def _add_batch(self, records: list[Record]) -> None:
        """Take every event of ``records``; one a collector cannot use is reported as an unreadable line and skipped.

        A one-tensor clip of the run, rule and action of the clip before joins the streak, as a ``nonfinite`` of the
        run, rule and kind of the one before does; the run's step span is kept in locals while it lasts (attribute
        stores per line would cost a tenth of the audit) and written with the streak, before the next other event.
        """
        if self.one_by_one:
            for record in records:
                self._dispatch(record)
            return
        clip, nonfinite = ev.Intervention, ev.Nonfinite
        run: RunState | None = None
        run_id, run_file, rule, action = "", -1, "", ""
        streak: list[Record] = []
        gather = streak.append
        streaking = streaking_nonfinite = False
        low = high = 0
        for record in records:
            event = record.event
            if (
                streaking
                and type(event) is clip
                and event.run == run_id
                and event.rule == rule
                and event.action == action
                and record.file == run_file
                and event.param is not None
            ) or (
                streaking_nonfinite
                and type(event) is nonfinite
                and event.run == run_id
                and event.rule == rule
                and event.kind == action
                and record.file == run_file
            ):
                gather(record)
                step = event.step
                if step > high:
                    high = step
                elif step < low:
                    low = step
                continue
            if streak:
                assert run is not None
                self._flush(run, streak, low, high, self._clip_readers if streaking else self._nonfinite_readers)
                streak = []
                gather = streak.append
            streaking = streaking_nonfinite = False
            if not ((type(event) is clip and event.param is not None) or type(event) is nonfinite):
                run = self._dispatch(record)
                continue
            # A one-tensor clip (or a nonfinite) starts a streak: its run's bookkeeping now (``run_of`` gives the
            # run a step span to widen), the rest with the streak's, whose rule and action (kind) are its own, so
            # that a collector takes the streak at once.
            run = self._run_of(record)
            if run is None:
                continue
            gather(record)
            low, high = run.first_step, run.last_step  # type: ignore[assignment]
            run_id, run_file, rule = event.run, record.file, event.rule
            if type(event) is clip:
                streaking, action = True, event.action
            else:
                streaking_nonfinite, action = True, event.kind  # type: ignore[union-attr]  # a nonfinite line
        if streak:
            assert run is not None
            self._flush(run, streak, low, high, self._clip_readers if streaking else self._nonfinite_readers)

    def _flush(self, run: RunState, streak: list[Record], low: int, high: int, readers: Readers) -> None:
        """The streak's bookkeeping into its run (its first event's was done as it began), then the streak to every
        collector that reads its kind."""
        run.events += len(streak) - 1
        last_ts = streak[-1].event.ts
        if last_ts is None:  # the guard stamps every line: only a hand-written log gets here
            last_ts = next((record.event.ts for record in reversed(streak) if record.event.ts is not None), None)
        if last_ts is not None:
            run.last_ts = last_ts
        run.first_step = low
        run.last_step = high
        job = run.job
        if not job.multi:
            job.hold_streak(streak, high, run.rank)
            for take in readers:
                take(run, streak)
            return
        # Another rank may have written these events: the streak goes on in parts, each all replicas or none.
        start = 0
        try:
            parts = job.streak_replicas(streak, run.rank)
            for end, replica in parts:
                part = streak if start == 0 and end == len(streak) else streak[start:end]
                run.replica = replica
                for take in readers:
                    take(run, part)
                start = end
        finally:
            run.replica = False

    def _run_of(self, record: Record) -> RunState | None:
        """The event's run, its bookkeeping done; None where the line was unreadable."""
        try:
            return self.runs.run_of(record.event, record)
        except _REFUSED as exc:
            self._unreadable(record, exc)
        return None

    def _dispatch(self, record: Record) -> RunState | None:
        """One event: its run's bookkeeping, its replica mark, then its handlers; None where the line was unreadable."""
        event = record.event
        try:
            run = self.runs.run_of(event, record)
            job = run.job
            run.replica = job.replica(event, run.rank) if job.multi else job.hold(event, run.rank)
            try:
                handlers = self._handlers.get(type(event))
                if handlers is None:
                    if not run.replica:
                        for handle in self._unclaimed:
                            handle(event, run, record)
                else:
                    for handle in handlers:
                        handle(event, run, record)
            finally:
                run.replica = False
        except _REFUSED as exc:
            self._unreadable(record, exc)
            return None
        return run

    def _unreadable(self, record: Record, exc: Exception) -> None:
        """The line of ``record`` is reported unreadable: a definition's own words (``Malformed``), else the error's
        type."""
        if isinstance(exc, Malformed):
            self._bad(record, str(exc))
        else:
            self._bad(record, f"gradguard {name_of(record.event)!r} event the audit cannot read ({type(exc).__name__})")

    def _bad(self, record: Record, reason: str) -> None:
        path = self.paths[record.file]
        self.stats.events[path] = self.stats.events.get(path, 1) - 1
        self.stats.bad_line(path, record.line, reason)
