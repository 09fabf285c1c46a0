"""Reproduced counters: a run's ``guard.counters.snapshot()`` from its log, and every snapshot cross-checked.

``guard.counters.snapshot()`` is ``{rule: {action: count}}``. The log carries that snapshot whole in
every ``counters`` event (every ``summary_every`` steps), in ``detach`` and in ``halt``; it also
carries one event per clip, non-finite detection, halt and skip, but nothing per step for ``scale``,
``zero`` and ``drop``. So a run's counters are its last snapshot, plus what the events after that
snapshot add (``reproduced_counters``); and at every snapshot, the counts the events give are checked against
it (``CounterCheck``; a difference means lost or foreign lines, and is a finding).
"""

from __future__ import annotations

from typing import Final, Union

from gradguard.audit.reader import Record
from gradguard.audit.run_state import RunState, recomputable
from gradguard.audit.summary import Counts, Mismatch
from gradguard.events.definitions import Counters, Detach, Halt, event_name

Snapshot = Union[Counters, Detach, Halt]  # noqa: UP007
"""An event that carries the run's whole ``counters``."""

__all__ = ["CounterCheck", "reproduced_counters"]

KEPT_MISMATCHES: Final = 50


class CounterCheck:
    """Takes each snapshot (``counters``, ``detach``, ``halt``) of a run and checks it against the events so far."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.mismatches: list[Mismatch] = []
        """The first ``KEPT_MISMATCHES`` mismatches."""
        self.mismatches_total = 0

    def snapshot(self, event: Snapshot, run: RunState, record: Record) -> None:
        counts = event.counters
        steps = None if isinstance(event, Halt) else event.steps
        if steps is not None:
            run.steps = steps if run.steps is None else max(run.steps, steps)
        step = None if isinstance(event, Detach) else event.step
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
        run.snapshot_event = event_name(type(event))
        run.snapshot_step = step if step is not None else run.last_step
        run.at_snapshot = dict(run.recomputed)

    def _check(self, run: RunState, key: tuple[str, str], logged: int, step: int | None, record: Record) -> None:
        counted = run.recomputed.get(key, 0)
        if counted == logged or key in run.mismatched:
            return
        run.mismatched.add(key)
        self.mismatches_total += 1
        if len(self.mismatches) < KEPT_MISMATCHES:
            where = f"{self.paths[record.file]}:{record.line}"
            self.mismatches.append(Mismatch(run.run, step, key[0], key[1], logged, counted, where))


def reproduced_counters(run: RunState) -> tuple[Counts, str, bool]:
    """The run's counters, where they come from, and whether they are complete (see the module's docstring)."""
    counters: Counts = {}
    if run.snapshot is not None:
        counters = {rule: dict(by_action) for rule, by_action in run.snapshot.items()}
        after = {
            key: n - run.at_snapshot.get(key, 0)
            for key, n in run.recomputed.items()
            if recomputable(key) and n != run.at_snapshot.get(key, 0)
        }
        at = "after" if run.snapshot_event == "detach" else "at"
        source = f"{run.snapshot_event} event {at} step {run.snapshot_step}"
        if after:
            source += f" + {sum(after.values())} counted from the events after it"
        late = run.last_step is not None and (run.snapshot_step is None or run.last_step > run.snapshot_step)
        complete = run.snapshot_event == "detach" or not late
    else:
        after = {key: n for key, n in run.recomputed.items() if recomputable(key) and n}
        source = "events alone (no counters event in the log yet)"
        complete = False
    for (rule, action), n in after.items():
        into = counters.setdefault(rule, {})
        into[action] = into.get(action, 0) + n
        if into[action] == 0:
            del into[action]
            if not into:
                del counters[rule]
    return counters, source, complete
