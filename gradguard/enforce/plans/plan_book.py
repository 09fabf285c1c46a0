"""The plans of one guard: the policy bound to the model, and what each optimizer's step treats.

An optimizer's plan is cached by the identity of the tensors it holds; when the model's tensors
were replaced after attach (``load_state_dict(assign=True)``, a new ``nn.Parameter``, ``to_empty``,
FSDP2's ``fully_shard``), the policy is bound again, so a guard never keeps guarding tensors the
model no longer has while the new ones go unguarded.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from itertools import chain
from operator import itemgetter

import torch
from torch import nn
from torch.optim import Optimizer

from gradguard.enforce.plans.plan import Plan
from gradguard.errors import GuardWarning, PolicyError, PolicyIssue
from gradguard.policy.document import Policy
from gradguard.policy.matching import Binding, bind

__all__ = ["PlanBook"]

_PARAMS = itemgetter("params")


class PlanBook:
    """The binding, the whole-model plan and each optimizer's plan; re-binds when the model changes."""

    def __init__(
        self, policy: Policy, model: nn.Module, on_rebind: Callable[[Binding, list[str]], None], *, stage: bool = False
    ) -> None:
        self.policy = policy
        self._stage = stage
        """The model is a pipeline stage: rules matching none of its tensors are the attach agreement's to refuse."""
        self.binding = bind(policy, model, stage=stage)
        _warn_binding(self.binding.warnings)
        self.whole = Plan.build(self.binding, self.binding.params)
        """Every guarded tensor of the model (``guard.step()`` without an optimizer)."""
        self._model_ref = weakref.ref(model)
        self._on_rebind = on_rebind
        self._by_optimizer: weakref.WeakKeyDictionary[Optimizer, tuple[tuple[int, ...], Plan | None]] = (
            weakref.WeakKeyDictionary()
        )
        self._last: tuple[weakref.ReferenceType[Optimizer], tuple[tuple[int, ...], Plan | None]] | None = None
        """The optimizer ``for_optimizer`` or ``steps_none`` was asked about last, and its entry."""
        self._warned_split: set[int] = set()
        self.one_plan = False
        """Every optimizer that steps a guarded tensor gets the whole-model plan: its step treats every gradient, and
        the other optimizers of the training step find them treated. A pipeline stage's, whose step takes one
        verdict with the other stages in a collective each: a stage of two optimizers (torchtitan steps one per model
        part) and a stage of one must make the same collectives, and no part update before another's fault halts."""
        self._by_clip: tuple[tuple[int, ...], Plan | None] | None = None
        self._among: tuple[tuple[int, ...], bool, list[torch.Tensor]] | None = None

    def with_policy(self, policy: Policy) -> PlanBook:
        """A new book for ``policy`` on the same model; raises [`PolicyError`][gradguard.PolicyError] if it does not
        bind."""
        model = self._model_ref()
        if model is None:
            raise PolicyError([PolicyIssue(policy.source, None, "", "the guarded model no longer exists")])
        book = PlanBook(policy, model, self._on_rebind)
        book.one_plan = self.one_plan
        return book

    def current(self) -> Plan:
        """The whole-model plan, bound again first if the model's tensors changed."""
        self._check_model()
        return self.whole

    def for_optimizer(self, optimizer: Optimizer) -> Plan | None:
        """The guarded tensors this optimizer steps (None: none); re-binds if the model's tensors changed."""
        # The ids of the tensors it steps, in order (its fingerprint), in C: map and chain, no Python call or loop.
        fingerprint = tuple(map(id, chain.from_iterable(map(_PARAMS, optimizer.param_groups))))
        last = self._last  # the optimizer asked last (every step asks for the same one): no weak dictionary's get
        if last is not None and last[0]() is optimizer:
            cached: tuple[tuple[int, ...], Plan | None] | None = last[1]
        elif (cached := self._by_optimizer.get(optimizer)) is not None:
            self._last = (weakref.ref(optimizer), cached)
        if cached is not None and cached[0] == fingerprint:
            return cached[1]
        self._check_model()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        by_id = self.binding.by_id
        members = [entry for p in params if (entry := by_id.get(id(p))) is not None and entry.ref() is p]
        plan = Plan.build(self.binding, members) if members else None
        if plan is not None and self.one_plan:
            plan = self.whole
        elif plan is not None:
            self._warn_split_groups(plan)
        self._by_optimizer[optimizer] = (fingerprint, plan)
        self._last = (weakref.ref(optimizer), (fingerprint, plan))
        return plan

    def steps_none(self, optimizer: Optimizer) -> bool:
        """The answer ``for_optimizer`` gave last: this optimizer steps none of the guarded tensors (and holds
        the same tensors since). A read only, safe on any thread without the guard's lock: every guard is asked
        this about every optimizer step of the process, and the other trainings' must not wait for this one."""
        last = self._last  # the optimizer asked last (every step asks for the same one): no weak dictionary's get
        if last is not None and last[0]() is optimizer:
            cached: tuple[tuple[int, ...], Plan | None] | None = last[1]
        elif (cached := self._by_optimizer.get(optimizer)) is not None:
            self._last = (weakref.ref(optimizer), cached)
        if cached is None or cached[1] is not None:
            return False
        return cached[0] == tuple(map(id, chain.from_iterable(map(_PARAMS, optimizer.param_groups))))

    def guarded_among(self, tensors: list[torch.Tensor], *, of_grads: bool) -> list[torch.Tensor]:
        """The guarded parameters among ``tensors``, or among the owners of ``tensors`` if they are gradients.

        The last answer is kept with the ids it was asked for: while ``tensors`` are alive, tensors with the
        same ids are the same tensors (the loop's clip asks the same every step).
        """
        key = tuple(map(id, tensors))
        cached = self._among
        if cached is not None and cached[0] == key and cached[1] == of_grads:
            return cached[2]
        if of_grads:
            grads = set(key)
            owners = (entry.ref() for entry in self.binding.params)
            found: list[torch.Tensor] = [
                p for p in owners if p is not None and p.grad is not None and id(p.grad) in grads
            ]
        else:
            by_id = self.binding.by_id
            found = [t for t in tensors if (entry := by_id.get(id(t))) is not None and entry.ref() is t]
        self._among = (key, of_grads, found)
        return found

    def for_params(self, params: list[torch.Tensor]) -> Plan | None:
        """The guarded tensors among ``params`` (a clip's), in model order; the last answer is cached."""
        fingerprint = tuple(map(id, params))
        cached = self._by_clip
        if cached is not None and cached[0] == fingerprint:
            return cached[1]
        self._check_model()
        by_id = self.binding.by_id
        found = {entry.index: entry for p in params if (entry := by_id.get(id(p))) is not None and entry.ref() is p}
        if len(found) == len(self.binding.params):
            plan: Plan | None = self.whole
        else:
            plan = Plan.build(self.binding, [found[i] for i in sorted(found)]) if found else None
        self._by_clip = (fingerprint, plan)
        return plan

    def _check_model(self) -> None:
        model = self._model_ref()
        if model is not None and not self.binding.still_matches(model):
            self._rebind(model)

    def _rebind(self, model: nn.Module) -> None:
        old = self.binding
        new = bind(self.policy, model, stage=self._stage)
        _warn_binding([warning for warning in new.warnings if warning not in old.warnings])
        old_refs = {name: entry.ref for entry in old.params for name in entry.names}
        replaced = [
            entry.name
            for entry in new.params
            if (before := old_refs.get(entry.name)) is not None and before() is not entry.ref()
        ]
        self.binding = new
        self.whole = Plan.build(new, new.params)
        self._by_optimizer = weakref.WeakKeyDictionary()
        self._last = None
        self._by_clip = None
        self._among = None
        self._on_rebind(new, replaced)

    def _warn_split_groups(self, plan: Plan) -> None:
        """A group clip whose rule spans several optimizers clips each optimizer's share by its own norm."""
        mine = {entry.index for entry in plan.params}
        for bound in self.binding.rules:
            group = any(
                action.action == "clip_norm" and getattr(action, "scope", "") == "group" for action in bound.actions
            )
            split = {entry.index for entry in bound.params} - mine
            if group and split and bound.index not in self._warned_split and len(split) < len(bound.params):
                self._warned_split.add(bound.index)
                warnings.warn(
                    f"rule {bound.name!r} clips a group whose parameters are stepped by more than one optimizer; "
                    "each optimizer's share is clipped by its own norm at its own step (under GradScaler the "
                    "others' gradients are still scaled then). Split the rule per optimizer to make this explicit.",
                    GuardWarning,
                    stacklevel=5,
                )


def _warn_binding(found: Sequence[str]) -> None:
    """A GuardWarning for each part of the policy the model makes void (an exclude that excludes nothing): the guard
    attaches and does the rest, but the user meant something it does not do."""
    for warning in found:
        warnings.warn(warning, GuardWarning, stacklevel=4)
