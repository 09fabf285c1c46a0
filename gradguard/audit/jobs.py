"""The jobs of a log: the runs of one distributed job (one run per rank), and which of their events are replicas.

Under ``torch.distributed`` every rank runs its own guard (its own ``run`` id) and writes every distributed event
itself: a skip, halt or rewind the ranks agreed on, a clip of the reduced gradient (under FSDP2 and DeepSpeed with
the figures combined over the ranks), a re-run's verdict. Read rank by rank, one skip on 2 ranks would be 2 skips,
and 12 clips 24. A ``Job`` groups the runs of distinct ranks that trained together (they share the step numbers),
and ``Job.replica`` says whether an event is one another rank of the job already wrote at that step: the audit's
tables count it once, naming the ranks, while each run keeps its own counts (its ``counters`` events are that
rank's own ``guard.counters``, checked against that rank's lines).

Runs are put in jobs as they are first seen (``RunTable.run_of``): a run joins the newest job when that job has no
run of its rank yet, else starts a new one. Two runs of one rank are never one job (a single-process log of
several runs stays a log of several runs), and the per-rank files of one job, read merged in step order, meet
every rank's first run before any step.

Memory stays bounded by the model, not the log: the events of a step are remembered only until every rank of
the job has gone past it (``WINDOW_STEPS`` at most, for a rank whose lines stopped).

A job of one rank so far (every single-process log, and most lines of a job's first rank before the others' appear)
cannot hold a replica yet: its events are only held as they are (``Job.hold``, a list append), and what they are about
is worked out only if another rank joins while they are still in the window (``Job.join``). The bookkeeping a
replica needs is then paid by the jobs of several ranks alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Final

import msgspec

from gradguard.events import definitions as ev

__all__ = ["WINDOW_STEPS", "Job", "identity"]

WINDOW_STEPS: Final = 64
"""Steps of a job's events held at most to find replicas: a rank whose lines lag further is counted again."""

_IDENTITY_FIELDS: Final = ("rule", "action", "param", "params", "name", "kind", "verdict", "why", "failed_rank")
"""The fields that say what an event is about (not its figures), where its definition has them."""
_VERDICT_FIELDS: Final = ("rule", "kind")
"""A halt, rewind or skip is one per step and rule: its ``params`` may differ by rank (a re-run's halt names only
the parameters whose own norms differed, empty on the other ranks)."""
_PER_RANK: Final = (ev.Counters, ev.SnapshotPlacement)
"""Events of one rank's own state, never replicas: its counters, where its own snapshots live."""

_fields_by_type: dict[type[Any], tuple[str, ...] | None] = {}

Seen = int | dict[int, int]
"""The ranks that wrote an event at a step: a bit per rank while each wrote it once (most events), else how many
times each rank did."""


def _seen(at: dict[Any, Seen], key: Hashable, rank: int) -> bool:
    """Note that ``rank`` wrote the event ``key`` (once more) at the step ``at``: whether another rank wrote it as
    often (then it is a replica)."""
    seen = at.get(key)
    bit = 1 << rank
    if seen is None:
        at[key] = bit
        return False
    if isinstance(seen, int):
        if not seen & bit:
            at[key] = seen | bit
            return True
        counts = {other: 1 for other in range(seen.bit_length()) if seen >> other & 1}  # a rank wrote it twice
        at[key] = counts
    else:
        counts = seen
    n = counts[rank] = counts.get(rank, 0) + 1
    return any(count >= n for other, count in counts.items() if other != rank)


def _identity_fields(kind: type[Any]) -> tuple[str, ...] | None:
    found = _fields_by_type.get(kind, ())
    if found != ():
        return found
    fields: tuple[str, ...] | None
    if not issubclass(kind, ev.StepEvent) or issubclass(kind, _PER_RANK):
        fields = None
    elif issubclass(kind, ev.Verdict):
        fields = _VERDICT_FIELDS
    else:
        names = {field.name for field in msgspec.structs.fields(kind)}
        fields = tuple(name for name in _IDENTITY_FIELDS if name in names)
        if issubclass(kind, ev.Intervention):
            fields += ("micro_batch",)  # one clip per micro-batch: the n-th of one rank matches the n-th of another
    _fields_by_type[kind] = fields
    return fields


def identity(event: Any) -> tuple[Hashable, ...] | None:
    """What ``event`` is about at its step (its kind, rule, parameter...), or None where it is a rank's own
    (an attach, a detach, a counters snapshot, an event of a name no definition has)."""
    kind = type(event)
    fields = _identity_fields(kind)
    if fields is None:
        return None
    values: list[Any] = [kind]
    for name in fields:
        value = getattr(event, name)
        values.append(tuple(value) if isinstance(value, list) else value)
    return tuple(values)


class _Step:
    """What the events of one step of a job were about, and the ranks that wrote each (``Seen``)."""

    __slots__ = ("clips", "events")

    def __init__(self) -> None:
        self.events: dict[Hashable, Seen] = {}
        """``identity`` -> the ranks that wrote such an event."""
        self.clips: dict[tuple[str, str, bool], dict[str, Seen]] = {}
        """(rule, action, micro_batch) -> parameter -> the ranks that clipped it so: the one-tensor clips, most events
        of a step, looked up by their parameter alone (what ``identity`` would say of them, but no tuple to build and
        hash a clip)."""

    def clipped(self, rule: str, action: str, micro_batch: bool) -> dict[str, Seen]:
        """The one-tensor clips of the step under ``rule`` and ``action``, by parameter."""
        key = (rule, action, micro_batch)
        found = self.clips.get(key)
        if found is None:
            found = self.clips[key] = {}
        return found


class Job:
    """The runs of one job, by rank, and the events of its recent steps, to tell a replica from a new event."""

    __slots__ = ("_held", "_last", "_window", "counted", "number", "runs")

    def __init__(self, number: int) -> None:
        self.number = number
        self.runs: dict[int, str] = {}
        """Rank -> the run id of its guard."""
        self.counted: dict[tuple[str, str], int] = {}
        """The counts of its events, each distributed event once (``RunState.count`` of an event no other rank
        of the job wrote before it)."""
        self._window: dict[int, _Step] = {}
        """Step -> what its events were about, and the ranks that wrote each."""
        self._last: dict[int, int] = {}
        """Rank -> the highest step of its events so far."""
        self._held: dict[int, list[tuple[Any, int]]] = {}
        """Step -> (event, rank) of the recent events while the job has one rank: the window, not worked out yet."""

    @property
    def multi(self) -> bool:
        """Whether the job has runs of several ranks (only then can an event be a replica)."""
        return len(self.runs) > 1

    def join(self, rank: int, run: str) -> None:
        """The run ``run`` of ``rank`` is one of the job's: with a second rank, the events held are worked out."""
        self.runs[rank] = run
        if len(self.runs) == 2 and self._held:
            held, self._held = self._held, {}
            for step in sorted(held):
                for one, by in held[step]:
                    if isinstance(one, list):  # a streak's records (``hold_streak``)
                        for record in one:
                            self.replica(record.event, by)
                    else:
                        self.replica(one, by)

    @property
    def holding(self) -> int:
        """How many events and streaks it holds in case another rank joins (``hold``)."""
        return sum(len(at) for at in self._held.values())

    def close(self) -> None:
        """A newer job has begun: no rank joins this one any more, so the events held for one (``hold``) go."""
        self._held = {}

    def hold(self, event: Any, rank: int) -> bool:
        """An event of a job of one rank so far: never a replica; held as it is, in case another rank joins.

        What is held is what the window of a job of one rank keeps: the events of its newest step and the one before
        (an event may come a step late)."""
        step = getattr(event, "step", None)
        if step is None:
            return False
        self._held_at(step).append((event, rank))
        return False

    def hold_streak(self, records: list[Any], last_step: int, rank: int) -> None:
        """``hold`` for a streak of the dispatcher's (one run's clips, or its ``nonfinite`` lines), as a whole: held at
        its last step (``last_step``), its records worked out in order if another rank joins."""
        self._held_at(last_step).append((records, rank))

    def _held_at(self, step: int) -> list[tuple[Any, int]]:
        held = self._held
        at = held.get(step)
        if at is None:
            at = held[step] = []
            if len(held) > 2:
                for old in [old for old in held if old < step - 1]:
                    del held[old]
        return at

    def replica(self, event: Any, rank: int) -> bool:
        """Whether another rank of the job already wrote ``event`` (as often) at its step; remembers it."""
        step = getattr(event, "step", None)
        if step is None:
            return False
        if type(event) is ev.Intervention and event.param is not None and event.params is None:
            clipped = self._at(step, rank).clipped(event.rule, event.action, event.micro_batch)
            return _seen(clipped, event.param, rank)
        key = identity(event)
        if key is None:
            return False
        return _seen(self._at(step, rank).events, key, rank)

    def _at(self, step: int, rank: int) -> _Step:
        """What the events of ``step`` were about, so far, as ``rank`` reaches it."""
        window = self._window
        at = window.get(step)
        if at is None:
            at = window[step] = _Step()
            self._forget(step, rank)
        elif self._last.get(rank, -1) < step:
            self._last[rank] = step
        return at

    def replicas(self, records: Sequence[Any], rank: int) -> list[tuple[int, bool]]:
        """``replica`` of each event of ``records`` (one run's, of ``rank``), as parts: (where a part ends, whether its
        events are replicas)."""
        parts: list[tuple[int, bool]] = []
        before = False
        for index, record in enumerate(records):
            replica = self.replica(record.event, rank)
            if replica is not before and index:
                parts.append((index, before))
            before = replica
        if records:
            parts.append((len(records), before))
        return parts

    def clip_replicas(self, records: Sequence[Any], rank: int) -> list[tuple[int, bool]]:
        """``replica`` of each one-tensor clip of ``records`` (a streak of one run of ``rank``, of one rule and action),
        in one loop, as parts: (where a part ends, whether its clips are replicas). The clips of a step are looked up
        by parameter in one dict (``_Step.clipped``), found once per step."""
        parts: list[tuple[int, bool]] = []
        if not records:
            return parts
        first = records[0].event
        rule, action = first.rule, first.action
        bit = 1 << rank
        step_now: int | None = None
        micro_now = False
        clipped: dict[str, Seen] = {}
        before = False
        for index, record in enumerate(records):
            event = record.event
            step = event.step
            micro = event.micro_batch
            if step != step_now or micro is not micro_now:
                clipped, step_now, micro_now = self._at(step, rank).clipped(rule, action, micro), step, micro
            if event.params is not None:  # a one-tensor clip naming its group too: what identity says of it
                replica = _seen(self._at(step, rank).events, identity(event), rank)
            else:
                param = event.param
                seen = clipped.get(param)
                if seen is None:
                    clipped[param] = bit
                    replica = False
                elif type(seen) is int and not seen & bit:
                    clipped[param] = seen | bit  # its first on this rank, another rank's before it: a replica
                    replica = True
                else:
                    replica = _seen(clipped, param, rank)
            if replica is not before and index:
                parts.append((index, before))
            before = replica
        parts.append((len(records), before))
        return parts

    def _forget(self, step: int, rank: int) -> None:
        """A new step entered the window: drop the steps every rank has gone past, and the oldest past the cap."""
        last = self._last
        if last.get(rank, -1) < step:
            last[rank] = step
        window = self._window
        if len(last) == len(self.runs):
            # An event may come a step late (a group clip written with the next step's read): keep one step more.
            below = min(last.values()) - 1
            for old in [old for old in window if old < below]:
                del window[old]
        while len(window) > WINDOW_STEPS:
            del window[min(window)]
