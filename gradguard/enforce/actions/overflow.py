"""A 2-norm that overflowed: every element finite, the float32 norm +inf. Not a non-finite gradient: the step's
tensor-scope clips take a float64 norm of it instead, after the read that showed it."""

from __future__ import annotations

import math

import torch

from gradguard.enforce.distributed.collective import Collective
from gradguard.enforce.work.step_work import StepWork
from gradguard.enforce.work.tensors import EPS
from gradguard.policy.matching import Binding, BoundRule
from gradguard.policy.schema import ClipNorm

__all__ = ["clear_overflows"]

_OVERFLOW_NOTE = (
    "every element is finite but the float32 2-norm overflowed: not a non-finite gradient; its tensor-scope "
    "clips used a float64 norm"
)


def clear_overflows(work: StepWork, fragile: frozenset[int]) -> None:
    """A +inf 2-norm with no NaN/Inf element is an overflow, not a non-finite gradient.

    Only on a step where some norm came out infinite, and with one more sync: the elements are
    checked, and a gradient that turns out finite gets its tensor-scope clips with a float64 norm,
    all on the device and read back together. (Those clips come after the step's other actions
    here; in exact arithmetic a clip and a scale commute.)
    """
    outcome, grads, names, step = work.outcome, work.grads, work.names, work.step
    suspects = sorted(
        index
        for index, (kind, _) in outcome.nonfinite.items()
        if kind == "inf" and index not in fragile and index in grads
    )
    if not suspects:
        return
    device = grads[suspects[0]].device
    flags = torch.stack([(~torch.isfinite(grads[i])).any().to(device) for i in suspects]).float()
    if work.collective is not None:
        flags = work.collective.sum_(flags)
    clips: list[tuple[int, BoundRule, ClipNorm, torch.Tensor, torch.Tensor]] = []
    for position, index in enumerate(suspects):
        finite = flags[position] == 0
        for bound, action in _tensor_clips(work.binding, index, step):
            grad = grads[index]
            norm = torch.linalg.vector_norm(grad.double(), action.norm_type)
            if work.sharded and work.collective is not None:  # the whole tensor's norm: every piece the same factor
                share = work.shares[index] if work.shares is not None else 1.0
                norm = _combined_float64(work.collective, norm, action.norm_type, share)
            coef = torch.where(finite, torch.clamp(action.max_norm / (norm + EPS), max=1.0), 1.0)
            grad.mul_(coef.to(grad.dtype))
            clips.append((index, bound, action, norm, coef))
    host = torch.cat([flags.double(), *(torch.stack([n, c]) for *_, n, c in clips)]).tolist()
    finite_ids = {index for index, nonfinite in zip(suspects, host, strict=False) if not nonfinite}
    rules = work.binding.policy.rules
    for index in finite_ids:
        _, rule_index = outcome.nonfinite.pop(index)
        outcome.halted_by.pop(index, None)
        outcome.skipped_by.pop(index, None)
        rule = rules[rule_index].name
        outcome.counts.append((rule, "norm_overflow", 1))
        event = {"step": step, "rule": rule, "param": names[index], "note": _OVERFLOW_NOTE}
        outcome.events.append(("norm_overflow", event))
    for position, (index, bound, action, _, _) in enumerate(clips):
        norm, coef = host[len(suspects) + 2 * position : len(suspects) + 2 * position + 2]
        if index not in finite_ids or coef >= 1.0:
            continue
        outcome.norm_clipped(step, bound.name, names[index], action, norm, coef, overflowed=True)


def _combined_float64(collective: Collective, norm: torch.Tensor, norm_type: float, share: float) -> torch.Tensor:
    """A shard's float64 norm made the whole tensor's (``combine_shard_norms`` in float64: the norm overflowed in
    float32)."""
    if math.isinf(norm_type):
        return collective.max_(norm.reshape(1))[0]
    return collective.sum_((norm.pow(norm_type) * share).reshape(1))[0].pow(1.0 / norm_type)


def _tensor_clips(binding: Binding, index: int, step: int) -> list[tuple[BoundRule, ClipNorm]]:
    """The tensor-scope clips active on ``step`` for one tensor, in policy order."""
    out = []
    for rule_index in binding.params[index].rules:
        bound = binding.rules[rule_index]
        for action in bound.actions:
            tensor_clip = isinstance(action, ClipNorm) and action.scope == "tensor"
            if tensor_clip and bound.rule.active_at(step) and action.active_at(step):
                assert isinstance(action, ClipNorm)
                out.append((bound, action))
    return out
