"""The runs and jobs of a log, as the dispatcher finds them: ``RunBook.run_of`` for every line, once.

A run is one guard's life (its ``run`` id); the runs of one distributed job's ranks make one ``Job``
(``gradguard.audit.jobs``). Whole log, never filtered: every collector sees the run of each event it reads, with the
event's file, time and step already noted here.
"""

from __future__ import annotations

from gradguard.audit.jobs import Job
from gradguard.audit.reader import AnyEvent, Record
from gradguard.audit.run_state import RunState

__all__ = ["RunBook"]


class RunBook:
    """Finds (or starts) the run of every event and notes the event in it."""

    def __init__(self) -> None:
        self.by_id: dict[str, RunState] = {}
        self.jobs: list[Job] = []
        self._last: RunState | None = None
        self._last_file = -1

    def run_of(self, event: AnyEvent, record: Record) -> RunState:
        """The event's run, with the event's file, time and step noted."""
        run = self._last
        if run is None or run.run != event.run or record.file != self._last_file:
            run_id = event.run
            run = self.by_id.get(run_id)
            if run is None:
                run = self.by_id[run_id] = RunState(run_id, event.rank, self._job_for(run_id, event.rank))
            if record.file not in run.files:
                run.files[record.file] = None
            self._last, self._last_file = run, record.file
        run.events += 1
        ts = event.ts
        if ts is not None:
            if run.first_ts is None:
                run.first_ts = ts
            run.last_ts = ts
        step = getattr(event, "step", None)
        if step is not None:
            if run.first_step is None or step < run.first_step:
                run.first_step = step
            if run.last_step is None or step > run.last_step:
                run.last_step = step
        return run

    def _job_for(self, run: str, rank: int) -> Job:
        """The newest job if it has no run of ``rank`` yet (another rank of it), else a new one."""
        job = self.jobs[-1] if self.jobs else None
        if job is None or rank in job.runs:
            if job is not None:
                job.close()  # no rank can join it now: what it held for one is let go
            job = Job(len(self.jobs) + 1)
            self.jobs.append(job)
        job.join(rank, run)
        return job
