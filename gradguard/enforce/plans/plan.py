"""A plan: what one enforcement pass treats, and what its actions need from the step.

Built once per (binding, optimizer) and cached: which tensors, which rules over them, which raw
2-norms to take (for the non-finite watch and the clips that can reuse them), which actions only
observe the gradient as it arrives (``monitor``: before any action), and which watched
tensors an action could make finite (judged by their max-abs before any action).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

from gradguard.enforce.actions import ActionKernel, kernel_for
from gradguard.enforce.distributed.collective import is_sharded
from gradguard.policy.matching import Binding, BoundRule, GuardedParam
from gradguard.policy.schema import Action, ClipNorm

__all__ = ["Plan"]


@dataclass(eq=False)
class Plan:
    """What one enforcement pass treats: a subset of the guarded tensors (those one optimizer steps)."""

    names: dict[int, str]
    """Tensor index -> first name, built once (``run`` used to rebuild it every step)."""
    params: tuple[GuardedParam, ...]
    rules: tuple[tuple[BoundRule, tuple[GuardedParam, ...]], ...]
    raw_norm_params: frozenset[int]
    """Indices of the tensors whose untouched 2-norm is needed: halt/skip coverage and first-touch clips."""
    watchers_by_param: dict[int, tuple[int, ...]]
    """Tensor index -> indices of the rules with a halt or skip action covering it, in policy order."""
    fragile: frozenset[int]
    """Watched tensors that an action may make finite (zero, clip_value, drop, scale by 0): their
    NaN/Inf verdict is taken from the max-abs norm before any action, not checked afterwards."""
    raw_sorted: tuple[int, ...] = ()
    """``sorted(raw_norm_params)``: the raw norms to take when every tensor of the plan has a gradient."""
    member_ids: tuple[tuple[int, ...], ...] = ()
    """Per rule, the indices of its members: its tensors to treat when every tensor has a gradient."""
    observers: tuple[tuple[int, Action], ...] = ()
    """``(position in rules, action)`` of every observing action (``monitor``), in policy order."""
    refs: tuple[tuple[int, weakref.ReferenceType[nn.Parameter]], ...] = ()
    """``(index, weak reference)`` per tensor of ``params``: what the engine looks at for every tensor at every step,
    without an attribute lookup on each entry."""
    changing: tuple[tuple[int, tuple[tuple[int, Action, ActionKernel], ...]], ...] = ()
    """``(position in rules, its changing actions as (action index, action, kernel))`` of every rule with an action
    that runs in policy order (not one that only watches or observes), in policy order: what the step's actions
    walk, found once here rather than asked of every rule's every action at every step."""
    later_writers: dict[tuple[int, int], tuple[tuple[int, int, Action, frozenset[int]], ...]] = field(
        default_factory=dict
    )
    """``(position in rules, action index)`` of a changing action -> the changing actions after it in policy order
    that share tensors with it: ``(position, action index, action, shared tensor indices)``. A tensor none of them
    acts on in a step has its last change of that step from this action, which may then wait for the step's one
    read (``StepWork.final``)."""
    placed: bool = False
    """Some tensor is a DTensor (FSDP2, tensor parallel): its gradient is given its placements at gather."""

    def acts(self, position: int, action: Action, step: int, in_hooks: Callable[[Action], bool] | None) -> bool:
        """Whether a changing action runs at the step boundary of ``step`` (not in the micro-batch hooks)."""
        rule = self.rules[position][0].rule  # without step windows (the common case) no call asks them
        if (rule.from_step is not None or rule.until_step is not None) and not rule.active_at(step):
            return False
        if (action.from_step is not None or action.until_step is not None) and not action.active_at(step):
            return False
        return not (in_hooks is not None and in_hooks(action))

    def final_ids(
        self, position: int, action_index: int, ids: list[int], step: int, in_hooks: Callable[[Action], bool] | None
    ) -> frozenset[int]:
        """The tensors of ``ids`` that no later changing action running at ``step`` acts on."""
        blocked: set[int] = set()
        for other, _, action, shared in self.later_writers.get((position, action_index), ()):
            if self.acts(other, action, step, in_hooks):
                blocked |= shared
        return frozenset(ids).difference(blocked) if blocked else frozenset(ids)

    def held_ids(
        self, position: int, action_index: int, ids: list[int], step: int, in_hooks: Callable[[Action], bool] | None
    ) -> frozenset[int]:
        """The tensors of ``ids`` whose one later change at ``step`` is a 2-norm group clip that is the last change
        of every tensor it clips: this action's change to them may wait for the step's read too
        (``StepWork.held``). The group clip then takes its norm as if nothing before it changed a tensor, and where
        the read shows something did, clips again after the read (``clipping.clip_group_after_read``)."""
        acting = [
            (other, other_index, action, shared)
            for other, other_index, action, shared in self.later_writers.get((position, action_index), ())
            if self.acts(other, action, step, in_hooks)
        ]
        if len(acting) != 1:
            return frozenset()
        other, other_index, action, shared = acting[0]
        group_clip = isinstance(action, ClipNorm) and action.scope == "group" and action.norm_type == 2.0
        if not group_clip or any(
            self.acts(later, after, step, in_hooks) for later, _, after, _ in self.later_writers[other, other_index]
        ):
            return frozenset()
        return shared.intersection(ids)

    @classmethod
    def build(cls, binding: Binding, params: Sequence[GuardedParam]) -> Plan:
        chosen = {entry.index for entry in params}
        ordered = tuple(entry for entry in binding.params if entry.index in chosen)
        rules = tuple(
            (bound, tuple(entry for entry in bound.params if entry.index in chosen)) for bound in binding.rules
        )
        raw: set[int] = set()
        touched: set[int] = set()
        watchers: dict[int, list[int]] = {}
        for bound, members in rules:
            for action in bound.actions:
                kernel = kernel_for(action)
                if kernel.observes:
                    if kernel.wants_raw_norm(action):  # observed before any action, so the raw norms are its own
                        raw.update(entry.index for entry in members)
                    continue  # it never changes a gradient
                if kernel.watches:
                    for entry in members:
                        raw.add(entry.index)
                        if bound.index not in watchers.setdefault(entry.index, []):
                            watchers[entry.index].append(bound.index)
                    continue
                if kernel.wants_raw_norm(action):
                    raw.update(entry.index for entry in members if entry.index not in touched)
                touched.update(entry.index for entry in members)
        fragile = {
            entry.index
            for bound, members in rules
            if any(kernel_for(action).may_erase_nonfinite(action) for action in bound.actions)
            for entry in members
            if entry.index in watchers
        }
        writers = [
            (position, action_index, action, frozenset(entry.index for entry in members))
            for position, (bound, members) in enumerate(rules)
            if members
            for action_index, action in enumerate(bound.actions)
            if not (kernel_for(action).observes or kernel_for(action).watches)
        ]
        later_writers = {
            (position, action_index): tuple(
                (other, later_index, later, members & others)
                for other, later_index, later, others in writers[k + 1 :]
                if members & others
            )
            for k, (position, action_index, _, members) in enumerate(writers)
        }
        changing = tuple(
            (position, acting)
            for position, (bound, _) in enumerate(rules)
            if (
                acting := tuple(
                    (action_index, action, kernel)
                    for action_index, action in enumerate(bound.actions)
                    if not ((kernel := kernel_for(action)).watches or kernel.observes)
                )
            )
        )
        return cls(
            changing=changing,
            later_writers=later_writers,
            names={entry.index: entry.name for entry in ordered},
            params=ordered,
            refs=tuple((entry.index, entry.ref) for entry in ordered),
            placed=any(is_sharded(param) for entry in ordered if (param := entry.ref()) is not None),
            rules=rules,
            raw_norm_params=frozenset(raw),
            fragile=frozenset(fragile),
            watchers_by_param={key: tuple(value) for key, value in watchers.items()},
            raw_sorted=tuple(sorted(raw)),
            member_ids=tuple(tuple(entry.index for entry in members) for _, members in rules),
            observers=tuple(
                (position, action)
                for position, (bound, members) in enumerate(rules)
                if members
                for action in bound.actions
                if kernel_for(action).observes
            ),
        )
