"""Shaping: ``scale``, ``zero`` and ``drop``, which change gradients without looking at them."""

from __future__ import annotations

import torch

from gradguard.enforce.actions.base import ActionKernel
from gradguard.enforce.work.step_work import StepWork
from gradguard.policy.matching import BoundRule
from gradguard.policy.schema import Action, Drop, Scale, Zero

__all__ = ["DropKernel", "ScaleKernel", "ZeroKernel"]


class ScaleKernel(ActionKernel):
    """``scale``: multiply every gradient by ``factor``."""

    alarms = True

    schemas = (Scale,)

    def may_erase_nonfinite(self, action: Action) -> bool:
        assert isinstance(action, Scale)
        return action.factor == 0

    def apply(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> bool:
        assert isinstance(action, Scale)
        torch._foreach_mul_([work.grads[i] for i in ids], action.factor)
        work.outcome.counts.append((bound.name, "scale", len(ids)))
        return True


class ZeroKernel(ActionKernel):
    """``zero``: the optimizer gets a zero gradient (Adam's moments and weight decay still move)."""

    alarms = True

    schemas = (Zero,)

    def may_erase_nonfinite(self, action: Action) -> bool:
        return True

    def apply(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> bool:
        torch._foreach_zero_([work.grads[i] for i in ids])
        work.outcome.counts.append((bound.name, "zero", len(ids)))
        return True


class DropKernel(ActionKernel):
    """``drop``: ``p.grad = None``, which every torch optimizer skips: the parameter stays as it is.

    Where the gradient is a piece of DeepSpeed's partitions (``work.places``), which DeepSpeed updates whole, the
    piece is zeroed (DeepSpeed's norm, clip and overflow check then leave it out, as torch's leave out a ``None``) and
    the boundary is asked to keep the parameter as it is through the update (``Place.hold``: its weights, master
    copy and optimizer state put back after DeepSpeed's step)."""

    alarms = True

    schemas = (Drop,)

    def may_erase_nonfinite(self, action: Action) -> bool:
        return True

    def apply(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> bool:
        params, places = work.binding.params, work.places
        for i in ids:
            place = places.get(i)
            if place is not None:
                assert place.hold is not None, "the boundary refuses drop where it cannot hold a parameter still"
                work.grads[i].zero_()
                place.hold()
            elif (param := params[i].ref()) is not None:
                param.grad = None
            del work.grads[i]
        work.outcome.counts.append((bound.name, "drop", len(ids)))
        return False  # the rule's later actions have no gradient left to act on
