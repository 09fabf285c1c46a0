"""The runs section: one row per run id (attach info, steps, times, how it ended), and the runs grouped by job
(``gradguard.audit.jobs``) into ``JobInfo`` rows, whose counters make the totals. Whole log, never filtered.

The runs themselves are the dispatcher's bookkeeping (``gradguard.audit.run_book``): ``RunTable`` reads what only
some events say of their run (its attach, detach, halts and rewinds) and makes the rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from gradguard.audit.collector import Collector, Context, Handler
from gradguard.audit.jobs import Job
from gradguard.audit.reader import Record
from gradguard.audit.run_state import RunState, recomputable, reproduced_counters
from gradguard.audit.summary import Counts, JobInfo, RunInfo, joined_stretches, unlearned_stretch
from gradguard.events.definitions import Attach, Detach, Halt, Rewind

__all__ = ["RunTable", "job_counters", "ran_steps", "seconds_between", "snapshot_memory"]


class RunTable(Collector):
    """Takes ``attach``, ``detach``, ``halt`` and ``rewind`` into their runs; gives the runs, jobs and totals."""

    def __init__(self, context: Context) -> None:
        self.paths = context.paths
        self.filters = context.filters
        self.book = context.runs
        self.by_id = context.runs.by_id
        self.jobs = context.runs.jobs

    def reads(self) -> Mapping[type[Any], Handler]:
        return {Attach: self.attach, Detach: self.detach, Halt: self.halt, Rewind: self.rewind}

    def attach(self, event: Attach, run: RunState, record: Record) -> None:
        run.model, run.policy, run.params = event.model, event.policy, event.params
        run.start_step = event.start_step
        run.attached = True
        run.rule_order = list(event.rules)
        run.rules_matched = dict(event.rules)
        run.snapshot_memory = snapshot_memory(event.recovery)
        run.loss_watched = event.loss is not None

    def detach(self, event: Detach, run: RunState, record: Record) -> None:
        run.detach_reason = event.reason

    def halt(self, event: Halt, run: RunState, record: Record) -> None:
        run.halted_at.append(event.step)

    def rewind(self, event: Rewind, run: RunState, record: Record) -> None:
        run.rewinds += 1
        stretch = unlearned_stretch(event.step, event.to_step, event.skip_until)
        if stretch is not None:
            run.rewound.append(stretch)

    def contribute(self, fields: dict[str, Any]) -> None:
        runs = self.infos()
        jobs = self.job_infos(runs)
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
        fields.update(
            runs=runs,
            jobs=jobs,
            ranks=sorted({info.rank for info in runs}),
            first_step=min(firsts) if firsts else None,
            last_step=max(lasts) if lasts else None,
            start=start,
            end=end,
            seconds=seconds_between(start, end),
            totals=totals,
            totals_complete=all(info.counters_complete for info in runs),
            notes=self._notes(runs),
        )

    def _notes(self, runs: list[RunInfo]) -> list[str]:
        notes = []
        if self.filters.rules:
            seen: set[str] = set()
            for run in self.by_id.values():
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

    def infos(self) -> list[RunInfo]:
        """Every run, in order of its first event's time (then rank, run id)."""
        runs = [self.info(run) for run in self.by_id.values()]
        runs.sort(key=lambda info: (info.start or "", info.rank, info.run))
        return runs

    def info(self, run: RunState) -> RunInfo:
        counters, source, complete = reproduced_counters(run)
        if run.detach_reason is not None:
            ended = f"detached ({run.detach_reason})"
            if run.halted_at:
                ended = f"halted at step {run.halted_at[-1]}; " + ended
        elif run.halted_at:
            ended = f"halted at step {run.halted_at[-1]}; no detach event"
        else:
            ended = "no detach event: still running, or the process died"
        first_step, last_step = ran_steps(run)
        steps = run.steps  # the guard's step count: a resumed run's began at its start_step, not 0
        if steps is None and last_step is not None:
            steps = last_step + 1
        if steps is not None:
            steps = max(steps - run.start_step, 0)  # the steps this run ran
        return RunInfo(
            run=run.run,
            rank=run.rank,
            files=[self.paths[index] for index in run.files],
            model=run.model,
            policy=run.policy,
            params=run.params,
            first_step=first_step,
            last_step=last_step,
            steps=steps,
            start=run.first_ts,
            end=run.last_ts,
            seconds=seconds_between(run.first_ts, run.last_ts),
            events=run.events,
            ended=ended,
            counters=counters,
            counters_source=source,
            counters_complete=complete,
            snapshots=run.snapshots,
            rules_matching_nothing=[name for name, n in run.rules_matched.items() if n == 0],
            snapshot_memory=run.snapshot_memory,
            rewinds=run.rewinds,
            unlearned_steps=joined_stretches(run.rewound),
            job=run.job.number,
        )

    def job_infos(self, infos: list[RunInfo]) -> list[JobInfo]:
        """Every job, with its counters per step across its ranks (``job_counters``)."""
        by_job: dict[int, list[RunInfo]] = {}
        for info in infos:
            by_job.setdefault(info.job, []).append(info)
        return [
            JobInfo(
                job.number,
                [info.run for info in by_job.get(job.number, [])],
                [info.rank for info in by_job.get(job.number, [])],
                job_counters(job, by_job.get(job.number, [])),
            )
            for job in self.jobs
        ]


def job_counters(job: Job, runs: list[RunInfo]) -> Counts:
    """A job's counters, per step across its ranks: each count once, not once per rank.

    One run: its own counters, as they are. Several ranks: each (rule, action) is the largest of the job's own
    count (its events, each distributed event once: ``Job.counted``) and of each rank's counters; the ranks of a
    data-parallel job count the same events, so a rank whose count is larger had events the log lost (or the
    guard counted without a line: ``scale``, ``zero``, ``drop``), and the job's events more than any rank's when
    the ranks differed.
    """
    if len(runs) == 1:
        return runs[0].counters
    counters: Counts = {}
    for (rule, action), n in job.counted.items():
        if n and recomputable((rule, action)):
            counters.setdefault(rule, {})[action] = n
    for info in runs:
        for rule, by_action in info.counters.items():
            into = counters.setdefault(rule, {})
            for action, n in by_action.items():
                into[action] = max(into.get(action, 0), n)
    return counters


def ran_steps(run: RunState) -> tuple[int | None, int | None]:
    """The first and last steps ``run`` ran: from the step its guard attached at, to the last its guard counted.

    Most steps write no event (a clean step writes nothing until the next ``counters``), so the steps of a run's
    events start at its first intervention: the attach event's ``start_step`` and the ``steps`` count of the
    ``counters``/``detach`` events say where it really began and ended. A log without the attach event (cut at
    its start) falls back on the first event's step.
    """
    first, last = run.first_step, run.last_step
    if run.attached and (first is None or run.start_step < first):
        first = run.start_step
    if run.steps is not None and run.steps > run.start_step and (last is None or run.steps - 1 > last):
        last = run.steps - 1  # ``steps`` is the next step the guard would treat
    if last is None:
        return None, None  # attached, but no step is known to have run
    return first, last


def snapshot_memory(recovery: dict[str, Any] | None) -> str | None:
    """``device memory (cuda:0, memory: auto), 3,864 bytes for 2 snapshots``, from the attach event's ``recovery``."""
    if not recovery or "where" not in recovery:
        return None
    staged = ", staged through the device" if recovery.get("staged") else ""
    needed = recovery.get("needed_bytes")
    held = f", {needed:,} bytes for {recovery.get('keep')} snapshots" if isinstance(needed, int) else ""
    return f"{recovery['where']} memory ({recovery.get('device')}, memory: {recovery.get('memory')}{staged}){held}"


def seconds_between(start: str | None, end: str | None) -> float | None:
    """Seconds from one event timestamp to another; None where either is missing or unreadable."""
    if not start or not end:
        return None
    try:
        return (_parse_ts(end) - _parse_ts(start)).total_seconds()
    except ValueError:
        return None


def _parse_ts(text: str) -> datetime:
    return datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
