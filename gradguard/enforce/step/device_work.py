"""The device work stage: every figure and change the step queues on the device before its one read.

In order: the participants that must come first (a GradScaler's flags, the per-micro-batch hooks' records), the raw
norms the watches need (``watch_raw_norms``: the non-finite verdict rides them), the monitors' figures of the
gradients as they arrived, the participants beside the actions (the loss), each rule's actions in policy order
through their kernels, and the participants that come last (the provenance trace, whose reader sees the step's
non-finite verdict). Nothing here reads a value back to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gradguard.enforce.actions import ActionKernel, kernel_for
from gradguard.enforce.actions.nonfinite import watch_raw_norms
from gradguard.enforce.hooks.micro_batch import handled_in_hooks
from gradguard.enforce.plans.plan import Plan
from gradguard.enforce.step.participants import Participants
from gradguard.enforce.work.step_work import StepContext, StepWork
from gradguard.policy.matching import GuardedParam
from gradguard.policy.schema import Action, ClipNorm

__all__ = ["apply_actions", "observe", "queue_device_work"]


def queue_device_work(plan: Plan, work: StepWork, context: StepContext, participants: Participants) -> None:
    """Queue the step's device work, the participants' in their places."""
    for participant in participants.at["before_figures"]:
        participant.before_figures(work, context)
    grads = work.grads
    everyone = len(plan.params)  # while len(grads) is this, every tensor of the plan has a gradient
    if len(grads) == everyone:
        raw_ids = list(plan.raw_sorted)
    else:
        raw_ids = sorted(index for index in plan.raw_norm_params if index in grads)
    if raw_ids:
        work.raw = watch_raw_norms(work, plan, raw_ids)
    work.sampled = bool(plan.observers) and observe(plan, work, everyone)
    for participant in participants.at["beside_actions"]:
        participant.beside_actions(work)
    apply_actions(plan, work, everyone, participants.per_micro_batch)
    for participant in participants.at["after_actions"]:
        participant.after_actions(work)


def apply_actions(plan: Plan, work: StepWork, everyone: int, per_micro_batch: bool) -> None:
    """Each active rule's actions, in policy order, through their kernels."""
    grads, step = work.grads, work.step
    in_hooks = handled_in_hooks if per_micro_batch else None
    # Only the rules with a changing action, and only those actions (``Plan.changing``): an action that watches
    # (halt/skip: its verdict came with the raw norms) or observes (monitor) never runs here.
    for position, acting in plan.changing:
        bound, members = plan.rules[position]
        rule = bound.rule  # a rule without a step window is active at every step: no call to ask it
        if (rule.from_step is not None or rule.until_step is not None) and not rule.active_at(step):
            continue
        ids = _present(plan.member_ids[position], members, grads, everyone)
        if not ids:
            if work.pipeline is not None:
                _join_the_stages(plan, work, position, acting, in_hooks)
            continue
        for action_index, action, kernel in acting:
            if not plan.acts(position, action, step, in_hooks):
                continue
            work.final = plan.final_ids(position, action_index, ids, step, in_hooks)
            # A held change re-clips its group after the read where the read shows it was made: across ranks or stages
            # that would be a collective some take and others not.
            holds = (
                len(work.final) < len(ids) and not work.sharded and work.pipeline is None and kernel.may_hold(action)
            )
            work.held = plan.held_ids(position, action_index, ids, step, in_hooks) if holds else frozenset()
            if not kernel.apply(work, bound, action, ids):
                if work.pipeline is not None:  # nothing left to act on here; the stages' group clips still meet
                    _join_the_stages(
                        plan, work, position, acting[acting.index((action_index, action, kernel)) + 1 :], in_hooks
                    )
                break
            work.touched.update([i for i in ids if i not in work.held] if work.held else ids)
    work.final = work.held = frozenset()


def _join_the_stages(
    plan: Plan,
    work: StepWork,
    position: int,
    acting: Sequence[tuple[int, Action, ActionKernel]],
    in_hooks: Callable[[Action], bool] | None,
) -> None:
    """A pipeline stage with none of a rule's tensors still takes its part in the rule's group clips (a norm of 0), so
    every stage makes the same collectives over ``pp`` in the same order."""
    bound = plan.rules[position][0]
    for _, action, kernel in acting:
        if (
            isinstance(action, ClipNorm)
            and action.scope == "group"
            and plan.acts(position, action, work.step, in_hooks)
        ):
            kernel.apply(work, bound, action, [])


def observe(plan: Plan, work: StepWork, everyone: int) -> bool:
    """Every observing action (``monitor``) that samples this step, on the gradients as they arrived; whether
    one did."""
    grads, step, sampled = work.grads, work.step, False
    for position, action in plan.observers:
        bound, members = plan.rules[position]
        rule = bound.rule  # a rule without a step window is active at every step: no call to ask it
        if (rule.from_step is not None or rule.until_step is not None) and not rule.active_at(step):
            continue
        kernel = kernel_for(action)
        if not kernel.samples(action, step):
            continue
        ids = _present(plan.member_ids[position], members, grads, everyone)
        if ids:
            kernel.observe(work, bound, action, ids)
            sampled = True
    return sampled


def _present(
    member_ids: Sequence[int], members: Sequence[GuardedParam], grads: dict[int, torch.Tensor], everyone: int
) -> list[int]:
    """A rule's tensors that have a gradient in this pass: all of them while every tensor of the plan has one."""
    return list(member_ids) if len(grads) == everyone else [entry.index for entry in members if entry.index in grads]
