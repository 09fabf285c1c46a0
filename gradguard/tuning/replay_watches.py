"""The watches the replay runs on one step's norms as they arrived, before any action changes them, as the guard's
step engine does (``gradguard.enforce.step.engine``): the non-finite watch (which ``halt_on_nonfinite`` or
``skip_step_on_nonfinite`` rule covers each non-finite norm) and the spike watch (which ``skip_step_on_spike`` rules
see a spike, deciding with the guard's ``spike_decide``, on torch tensors: torch is imported only for a policy with
such an action). They only say what fired; the replayer
(``gradguard.tuning.replay``) decides what that does to the step, and keeps the statistics they propose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from gradguard.enforce.work.skips import has_active
from gradguard.policy.schema import Action, HaltOnNonfinite, Rule, SkipStepOnNonfinite, SkipStepOnSpike
from gradguard.tuning.acting import Proposal, Stats, followed
from gradguard.tuning.blocks import BoundRule
from gradguard.tuning.float32 import Floats

if TYPE_CHECKING:
    import torch

__all__ = ["StateOf", "nonfinite_verdicts", "present_members", "spiked_rules"]

StateOf = Callable[[tuple[int, int], Action, int], Stats]
"""``(key, action, columns) -> Stats``: an adaptive action's statistics, made with ``columns`` columns if new."""


def nonfinite_verdicts(
    raw: Floats,
    present: Sequence[bool],
    step: int,
    rules: Sequence[Rule],
    watchers: Mapping[int, list[int]],
) -> tuple[dict[int, int], dict[int, int]]:
    """The non-finite verdicts: name index -> the halt (or else skip) rule that covers it, as two maps (halts, skips).

    ``watchers`` maps a name index to the rules with a halt or skip action covering it, in policy order."""
    halted_by: dict[int, int] = {}
    skipped_by: dict[int, int] = {}
    finite = np.isfinite(raw)
    if bool(finite.all()):
        return halted_by, skipped_by
    for index in np.flatnonzero(~finite).tolist():
        if not present[index]:
            continue
        covering = [r for r in watchers.get(index, ()) if rules[r].active_at(step)]
        halts = [r for r in covering if has_active(rules[r].actions, HaltOnNonfinite, step)]
        skips = [r for r in covering if has_active(rules[r].actions, SkipStepOnNonfinite, step)]
        if halts:
            halted_by[index] = halts[0]
        elif skips:
            skipped_by[index] = skips[0]
    return halted_by, skipped_by


def present_members(bound: BoundRule, present: Sequence[bool], everyone: bool) -> tuple[list[int], torch.Tensor | None]:
    """The members with a norm this step, and their columns (``None``: all of them, in order), as a torch index."""
    if everyone:
        return bound.members, None
    import torch

    columns = [column for column, index in enumerate(bound.members) if present[index]]
    return [bound.members[c] for c in columns], torch.tensor(columns, dtype=torch.long)


def spiked_rules(
    raw: Floats,
    present: Sequence[bool],
    everyone: bool,
    step: int,
    bound_rules: Sequence[BoundRule],
    state_of: StateOf,
    proposals: list[Proposal],
) -> list[int]:
    """The spike watch, on the norms as they arrived (before any action): the rules whose norm spiked.

    Each spike action's statistics as the step would leave them go to ``proposals``: the replayer keeps them only
    if the step is applied, as the guard does."""
    spiked: list[int] = []
    for bound in bound_rules:
        rule = bound.rule
        if not bound.members or not rule.active_at(step):
            continue
        for position, action in enumerate(rule.actions):
            if not isinstance(action, SkipStepOnSpike) or not action.active_at(step):
                continue
            ids, cols = present_members(bound, present, everyone)
            if not ids:
                continue
            from gradguard.enforce.actions.spikes import spike_decide  # imports torch: for a spike action only

            group = action.scope == "group"
            g = followed(raw, ids, group)
            key = (bound.index, position)
            stats = state_of(key, action, 1 if group else len(bound.members))
            ring = stats.tensors["ring"] if group or cols is None else stats.tensors["ring"].index_select(0, cols)
            slot = stats.slot % action.window
            spike, _, _, _, proposed = spike_decide(action, g, ring, slot)
            proposals.append((key, None if group else cols, {"ring": proposed}, slot + 1))
            if bool(spike.any()):
                spiked.append(bound.index)
    return spiked
