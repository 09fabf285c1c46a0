"""Many recorded steps at once, for a policy whose actions keep no statistics (``gradguard.tuning.replay``).

A policy made of ``clip_norm`` (2-norm), ``scale``, ``zero``, ``drop``, ``monitor`` and the non-finite
watches decides each step from that step's norms alone: only the skip limits (skips in a row, skips in a
window) and a halt carry from one step to the next. So a run of recorded steps is decided as one
``[steps x tensors]`` float32 matrix, each action one array operation on its members' columns with the
formulas a single step uses (``stateless_coefficients``, element by element, a group's norm reduced along
its own row), and the steps are then walked in order to note what acted, keep the skip limits and stop at
a halt. A step the matrix cannot decide alone goes through ``Replayer.feed`` in its place: a name missing
or new, a non-finite norm (the watches decide it). Rules and actions that start or stop
(``from_step``/``until_step``) split the run where their activity changes.

A policy with an adaptive action (``zclip``, ``autoclip``, ``skip_step_on_spike``: statistics carried from
step to step), ``clip_value``, a ``clip_norm`` by ``inf`` or ``agc`` is replayed step by step.

A policy's ``loss`` section keeps statistics too (the median of recent losses), but they follow only the losses
and which steps are applied: ``Replayer.feed`` judges each step's loss as the step arrives
(``gradguard.tuning.loss_replay``), a step in a block is applied and its loss enters the reference at once, and a
step whose loss the section flags (a spike, a NaN: it may skip or halt) is decided on its own in its place. So
a loss section alone does not stop the blocks; its verdicts are those of a replay one step at a time.
"""

from __future__ import annotations

from array import array
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
from numpy.typing import NDArray

from gradguard.policy.schema import (
    Action,
    ClipNorm,
    Drop,
    HaltOnNonfinite,
    Monitor,
    Rule,
    Scale,
    SkipStepOnNonfinite,
    SkipStepOnSpike,
    Zero,
)
from gradguard.tuning.acting import stateless_coefficients
from gradguard.tuning.float32 import F32_MAX, Floats

__all__ = [
    "BLOCK_STEPS",
    "F32_MAX",
    "Acting",
    "BoundRule",
    "as_matrix",
    "decide_block",
    "decides_in_blocks",
    "gradient_actions",
    "reads_after",
    "stacked",
    "windowed",
]

BLOCK_STEPS: Final = 256
"""Recorded steps gathered and decided together (memory holds that many steps' norms)."""

_WATCHES: Final = Monitor | HaltOnNonfinite | SkipStepOnNonfinite


@dataclass
class BoundRule:
    """A rule bound to the recorded names: its members, in the order the names were first seen."""

    index: int
    rule: Rule
    members: list[int] = field(default_factory=list)


def decides_in_blocks(rules: Sequence[Rule]) -> bool:
    """Whether every action of ``rules`` decides a step from that step's norms alone (see the module)."""
    for rule in rules:
        for action in rule.actions:
            if isinstance(action, ClipNorm):
                if action.norm_type != 2.0:
                    return False
            elif not isinstance(action, Scale | Zero | Drop | _WATCHES):
                return False
    return True


def as_matrix(rows: Sequence[Mapping[str, float]]) -> NDArray[np.float64]:
    """Steps' figures of the same names in the same order as one float64 ``[steps x names]`` matrix.

    Gathered in an ``array`` (C doubles) and viewed by numpy: a tenth of building it from nested lists.
    """
    values = array("d")
    for row in rows:
        values.extend(row.values())
    return stacked(values, len(rows[0]))


def stacked(values: array[float], width: int) -> NDArray[np.float64]:
    """Doubles gathered row after row, ``width`` to a row, as a float64 ``[rows x width]`` array (no copy)."""
    return np.frombuffer(values, dtype=np.float64).reshape(-1, width)


def windowed(rules: Sequence[Rule]) -> list[Rule | Action]:
    """The rules and actions that start or stop at a step: a run of steps decided together shares their activity."""
    items: list[Rule | Action] = []
    for rule in rules:
        items += [item for item in (rule, *rule.actions) if item.from_step is not None or item.until_step is not None]
    return items


@dataclass(frozen=True)
class Acting:
    """One gradient-changing action about to act on a step (``gradient_actions``)."""

    bound: BoundRule
    position: int
    action: Action
    ids: list[int]
    """The rule's members with a gradient left (a ``drop`` of an earlier rule takes its members away)."""
    index: NDArray[np.int64]
    """``ids`` as an array."""
    columns: NDArray[np.int64] | None
    """Their places among the rule's members, or ``None`` for all of them in order."""

    @property
    def key(self) -> tuple[int, int]:
        return (self.bound.index, self.position)


def gradient_actions(
    rules: Sequence[BoundRule], undecidable: Container[tuple[int, int]], present: list[bool], step: int
) -> Iterator[Acting]:
    """Every rule's gradient-changing actions active at ``step``, in policy order, each with the members it acts
    on. After a ``drop`` is yielded its members leave ``present`` and the rule's later actions are not: they
    have no gradient left. The one loop of both replays (a step, ``Replayer._actions``; a block,
    ``decide_block``)."""
    for bound in rules:
        if not bound.members or not bound.rule.active_at(step):
            continue
        places = [place for place, member in enumerate(bound.members) if present[member]]
        if not places:
            continue
        ids = [bound.members[place] for place in places]
        index = np.asarray(ids, dtype=np.int64)
        columns = None if len(places) == len(bound.members) else np.asarray(places, dtype=np.int64)
        for position, action in enumerate(bound.rule.actions):
            if not action.active_at(step) or (bound.index, position) in undecidable:
                continue
            if isinstance(action, _WATCHES | SkipStepOnSpike):
                continue
            yield Acting(bound, position, action, ids, index, columns)
            if isinstance(action, Drop):
                for member in ids:
                    present[member] = False
                break


def decide_block(
    rules: Sequence[BoundRule], undecidable: Container[tuple[int, int]], raw: Floats, step: int
) -> tuple[list[tuple[int, int]], list[list[bool]]]:
    """Every rule's gradient-changing actions in policy order on ``raw``'s rows, each row one step with a norm
    for every name (as ``Replayer._actions`` on one step), under the rules' activity at ``step``: the actions'
    keys ``(rule, position)``, and per row whether each one acted."""
    current = raw.copy()
    keys: list[tuple[int, int]] = []
    acted: list[NDArray[np.bool_]] = []
    actings = list(gradient_actions(rules, undecidable, [True] * raw.shape[1], step))
    for position, acting in enumerate(actings):
        keys.append(acting.key)
        if isinstance(acting.action, Drop):
            acted.append(np.ones(raw.shape[0], dtype=np.bool_))
            continue
        assert isinstance(acting.action, ClipNorm | Scale | Zero)
        norms = current[:, acting.index]
        coef, did = stateless_coefficients(acting.action, norms, reads_after(actings, position))
        current[:, acting.index] = norms * coef
        acted.append(did)
    if not keys:
        return keys, [[] for _ in range(raw.shape[0])]
    rows: list[list[bool]] = np.stack(acted, axis=1).tolist()
    return keys, rows


def reads_after(actings: Sequence[Acting], position: int) -> bool:
    """Whether an action after ``actings[position]`` reads the norms it leaves (a ``drop`` reads none)."""
    return any(not isinstance(later.action, Drop) for later in actings[position + 1 :])
