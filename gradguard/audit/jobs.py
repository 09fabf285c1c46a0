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

Most events of a job of several ranks are one-tensor clips (and a NaN step's ``nonfinite`` lines), which every rank
writes in one order: a rank's streak of them is told against the others' by comparing lists of parameters, a step at
a time (``_Order``), not by a dict lookup per event; only where the ranks' orders part are they counted one by one.
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
_CLIP: Final = ev.Intervention
_NONFINITE: Final = ev.Nonfinite

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


class _Order:
    """The one-tensor events of one step of one kind (the clips of a rule, action and micro-batch mark; the
    ``nonfinite`` lines of a rule and kind): which rank wrote which, as often.

    The ranks of a job write a step's clips (and a NaN's lines) in one order (the same tensors, the same gradients),
    so while every rank's so far are the start of one list of parameters (``written``: each rank wrote how many of
    it, ``done``), a rank's next ones are told at once by comparing lists: those another rank wrote at the same
    places are replicas (that rank wrote the parameter at least as often by then), those past the end are new. Where
    a rank's leave that order, every rank's are counted by parameter from then on (``seen``, as ``_seen`` counts any
    event)."""

    __slots__ = ("done", "seen", "written")

    def __init__(self) -> None:
        self.written: list[str] = []
        self.done: dict[int, int] = {}
        """Rank -> how many of ``written`` it wrote (its clips, while every rank's are a start of it)."""
        self.seen: dict[str, Seen] | None = None
        """Parameter -> the ranks that clipped it so, once the ranks' orders parted (None before)."""

    def mark(self, params: list[str], rank: int, parts: list[tuple[int, bool]], end: int) -> None:
        """``rank`` clipped ``params`` (in order): each part of them, all replicas or none, appended to ``parts`` (a
        part is (where it ends, whether replicas); ``end`` is where the clips before these end)."""
        seen = self.seen
        if seen is None:
            written, done = self.written, self.done
            start = done.get(rank, 0)
            count = len(params)
            shared = min(count, len(written) - start)
            if shared <= 0:  # the rank wrote all of ``written``: these are new
                written.extend(params)
                done[rank] = start + count
                _part(parts, end + count, False)
                return
            if written[start : start + shared] == (params if shared == count else params[:shared]):
                done[rank] = start + count
                _part(parts, end + shared, True)
                if shared < count:
                    written.extend(params[shared:])
                    _part(parts, end + count, False)
                return
            seen = self._parted()
        for param in params:
            end += 1
            _part(parts, end, _seen(seen, param, rank))

    def _parted(self) -> dict[str, Seen]:
        """The ranks' orders parted: the clips so far counted by parameter, as ``_seen`` would have."""
        seen: dict[str, Seen] = {}
        for rank, count in self.done.items():
            for param in self.written[:count]:
                _seen(seen, param, rank)
        self.seen = seen
        return seen


def _one(order: _Order, param: str, rank: int) -> bool:
    """Whether ``rank``'s one event of ``param`` in ``order`` is a replica (``_Order.mark`` of one)."""
    parts: list[tuple[int, bool]] = []
    order.mark([param], rank, parts, 0)
    return parts[0][1]


def _part(parts: list[tuple[int, bool]], end: int, replica: bool) -> None:
    """Clips up to ``end`` are replicas or not: the last part grows where it says the same."""
    if parts and parts[-1][1] is replica:
        parts[-1] = (end, replica)
    else:
        parts.append((end, replica))


class _Step:
    """What the events of one step of a job were about, and the ranks that wrote each (``Seen``)."""

    __slots__ = ("events", "orders")

    def __init__(self) -> None:
        self.events: dict[Hashable, Seen] = {}
        """``identity`` -> the ranks that wrote such an event."""
        self.orders: dict[tuple[type[Any], str, str, bool], _Order] = {}
        """(event type, rule, action or kind, micro_batch) -> the one-tensor clips (or ``nonfinite`` lines) of the
        step so, most events of a step: told by their parameters alone, in the ranks' shared order (what ``identity``
        would say of them, but no tuple to build and hash an event)."""

    def order(self, kind: type[Any], rule: str, action: str, micro_batch: bool) -> _Order:
        """The one-tensor clips (``nonfinite`` lines) of the step of ``rule`` and ``action`` (kind)."""
        key = (kind, rule, action, micro_batch)
        found = self.orders.get(key)
        if found is None:
            found = self.orders[key] = _Order()
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
        if type(event) is _CLIP and event.param is not None and event.params is None:
            order = self._at(step, rank).order(_CLIP, event.rule, event.action, event.micro_batch)
            return _one(order, event.param, rank)
        if type(event) is _NONFINITE:
            return _one(self._at(step, rank).order(_NONFINITE, event.rule, event.kind, False), event.param, rank)
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

    def streak_replicas(self, records: Sequence[Any], rank: int) -> list[tuple[int, bool]]:
        """``replica`` of each event of a streak of the dispatcher's (one run's one-tensor clips of one rule and action,
        or its ``nonfinite`` lines of one rule and kind; ``rank``'s), as parts: (where a part ends, whether its events
        are replicas). The events of one step (and micro-batch mark) go at once (``_Order.mark``); a clip naming its
        group too goes as ``identity`` says of it."""
        parts: list[tuple[int, bool]] = []
        if not records:
            return parts
        first = records[0].event
        kind, rule, step_now = type(first), first.rule, first.step
        params: list[str] = []
        end = 0
        if kind is _NONFINITE:
            for record in records:
                event = record.event
                if event.step != step_now:
                    self._at(step_now, rank).order(kind, rule, first.kind, False).mark(params, rank, parts, end)
                    end += len(params)
                    params = []
                    step_now = event.step
                params.append(event.param)
            self._at(step_now, rank).order(kind, rule, first.kind, False).mark(params, rank, parts, end)
            return parts
        action, micro_now = first.action, first.micro_batch
        for record in records:
            event = record.event
            if event.step == step_now and event.micro_batch is micro_now and event.params is None:
                params.append(event.param)
                continue
            if params:
                self._at(step_now, rank).order(kind, rule, action, micro_now).mark(params, rank, parts, end)
                end += len(params)
                params = []
            if event.params is not None:
                end += 1
                _part(parts, end, _seen(self._at(event.step, rank).events, identity(event), rank))
                continue
            step_now, micro_now = event.step, event.micro_batch
            params.append(event.param)
        if params:
            self._at(step_now, rank).order(kind, rule, action, micro_now).mark(params, rank, parts, end)
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
