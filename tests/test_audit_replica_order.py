"""A job's clips (and ``nonfinite`` lines) told as replicas a streak at a time, against a count by hand of which rank
wrote what, as often."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradguard.audit.jobs import Job
from gradguard.audit.reader import Record
from gradguard.events.definitions import Intervention, Nonfinite

_PARAMS = ["a", "b", "c", "d", "e"]

ClipSpec = tuple[str, bool, bool]
"""(parameter, micro-batch mark, whether it names a group too)."""


def _one_rank(base: list[ClipSpec]) -> st.SearchStrategy[list[ClipSpec]]:
    """A rank's clips of a step: mostly the job's shared order, sometimes with clips dropped, swapped or added."""
    shared = st.just(list(base))
    changed = st.lists(st.sampled_from(base), max_size=len(base) + 2) if base else st.just([])
    return st.one_of(shared, shared, changed, st.permutations(base))


Streak = tuple[int, list[tuple[int, ClipSpec]]]
"""A rank and its records as one streak: (step, clip) of each."""


@st.composite
def _job(draw: st.DrawFn) -> tuple[int, list[Streak]]:
    """Ranks' streaks as the merged reader hands them: step by step, each rank's clips of a step cut into streaks at
    random places and the ranks' streaks interleaved; a rank's streak sometimes runs on into its next (a file whose
    steps no other file has, a log of several ranks in one file)."""
    ranks = draw(st.integers(2, 4))
    streaks: list[Streak] = []
    for step in range(draw(st.integers(1, 4))):
        base = draw(st.lists(st.tuples(st.sampled_from(_PARAMS), st.booleans(), st.booleans()), max_size=8))
        base = [(param, micro and len(base) > 3, group and len(base) > 5) for param, micro, group in base]
        pending: list[tuple[int, list[ClipSpec]]] = []
        for rank in range(ranks):
            clips = draw(_one_rank(base))
            cuts = sorted(draw(st.lists(st.integers(0, len(clips)), max_size=3)))
            for start, end in zip([0, *cuts], [*cuts, len(clips)], strict=True):
                if end > start:
                    pending.append((rank, clips[start:end]))
        order = draw(st.permutations(range(len(pending))))
        # each rank's own streaks stay in its order: only the ranks' interleaving is drawn
        by_rank: dict[int, list[list[ClipSpec]]] = {}
        for rank, clips in pending:
            by_rank.setdefault(rank, []).append(clips)
        for index in order:
            rank = pending[index][0]
            records = [(step, spec) for spec in by_rank[rank].pop(0)]
            if streaks and streaks[-1][0] == rank and draw(st.booleans()):
                streaks[-1][1].extend(records)
            else:
                streaks.append((rank, records))
    return ranks, streaks


def _event(rank: int, step: int, spec: ClipSpec, kind: str) -> Any:
    param, micro, group = spec
    if kind == "nonfinite":  # a NaN's line per tensor: no micro-batch mark, no group
        return Nonfinite(
            run=f"r{rank}", rank=rank, step=step, rule="nan", param=param, kind="nan", halts=False, skips=True
        )
    return Intervention(
        run=f"r{rank}", rank=rank, step=step, rule="clip", action="clip_norm", param=param,
        params=[param, "z"] if group else None, before=2.0, after=1.0, micro_batch=micro,
    )  # fmt: skip


def _by_hand(streaks: list[Streak], kind: str) -> list[bool]:
    """An event is a replica where another rank had written the same event of the step as often by then."""
    counts: Counter[tuple[int, int, ClipSpec]] = Counter()
    ranks = {rank for rank, _ in streaks}
    marks = []
    for rank, records in streaks:
        for step, spec in records:
            if kind == "nonfinite":
                spec = (spec[0], False, False)
            counts[rank, step, spec] += 1
            mine = counts[rank, step, spec]
            marks.append(any(counts[other, step, spec] >= mine for other in ranks if other != rank))
    return marks


@pytest.mark.parametrize("kind", ["clip", "nonfinite"])
@settings(max_examples=300, deadline=None)
@given(job=_job())
def test_events_told_a_streak_at_a_time_are_replicas_exactly_where_a_count_by_hand_says(
    kind: str, job: tuple[int, list[Streak]]
) -> None:
    ranks, streaks = job
    by_streak, one_by_one = Job(1), Job(1)
    for each in (by_streak, one_by_one):
        for rank in range(ranks):
            each.join(rank, f"r{rank}")
    marks_by_streak: list[bool] = []
    marks_one_by_one: list[bool] = []
    line = 0
    for rank, written in streaks:
        events = [_event(rank, step, spec, kind) for step, spec in written]
        records = []
        for event in events:
            records.append(Record(event.step, rank, line, event))
            line += 1
        start = 0
        for end, replica in by_streak.streak_replicas(records, rank):
            assert end > start
            marks_by_streak += [replica] * (end - start)
            start = end
        assert start == len(records)
        marks_one_by_one += [one_by_one.replica(event, rank) for event in events]
    expected = _by_hand(streaks, kind)
    assert marks_by_streak == expected
    assert marks_one_by_one == expected
