"""The first stage: the gradients to treat, wherever they live.

A parameter's gradient is in ``p.grad``: a plain tensor, or under FSDP2 a DTensor whose local shard is treated (its
per-tensor figures combined across ranks; a Partial one, tensor parallel's, through a reduced copy); or where the
boundary's context says (``StepContext.gradients``: a DeepSpeed engine's reduced partitions, this rank's piece of
each gradient). A gradient the step already treated and that is unchanged since is not treated again (several
optimizers, or the loop's clip and then the optimizer's step, meet the same gradients).
"""

from __future__ import annotations

import weakref

import torch

from gradguard.enforce.distributed.collective import local_tensor
from gradguard.enforce.distributed.placements import Reduced, settle
from gradguard.enforce.plans.plan import Plan
from gradguard.enforce.work.step_work import StepContext
from gradguard.errors import GuardStateError

__all__ = ["Applied", "Version", "gather", "treated_version"]

Applied = dict[int, tuple[weakref.ReferenceType[torch.Tensor], "Version", bool]]
"""``Enforcer.applied_versions``: tensor index -> (weakref to its gradient, the version treated, held)."""
Version = int | tuple[int, int]
"""What tells a gradient changed since it was treated (``treated_version``)."""


def treated_version(grad: torch.Tensor, local: torch.Tensor) -> Version:
    """A plain gradient's version (``local`` is ``grad``); a DTensor's own and its local tensor's. DTensor's in-place
    ops (``zero_()``, backward's accumulation into it after ``zero_grad(set_to_none=False)``) run on the local tensor
    below the version counter and leave its version as it was; the guard's own writes to the local tensor leave the
    DTensor's."""
    return local._version if local is grad else (grad._version, local._version)


def gather(
    plan: Plan, applied: Applied, context: StepContext
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], Reduced | None]:
    """The gradients to treat: ``(index -> local gradient, index -> the DTensor it came from, the Partial gradients
    read through reduced copies)``; those treated and unchanged since (``Enforcer.applied_versions``) are not."""
    if context.gradients is not None:
        return context.gradients(plan), {}, None  # another place's (DeepSpeed's partitions): read once per update
    grads: dict[int, torch.Tensor] = {}
    wrapped: dict[int, torch.Tensor] = {}  # index -> the gradient itself where it is a DTensor
    placed: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    seen_at, plain, strided = applied.get, torch.Tensor, torch.strided  # locals: a loop per tensor
    honour_explicit = not context.explicit
    refs = plan.refs
    for index, ref in refs:
        param = ref()
        grad = param.grad if param is not None else None
        if grad is None:
            continue
        if type(grad) is plain:
            local = grad
        elif (local := local_tensor(grad)) is not grad:
            wrapped[index] = grad
        if local.layout is not strided:
            raise GuardStateError(
                f"parameter {plan.names[index]!r} has a {local.layout} gradient (e.g. from F.embedding(..., "
                "sparse=True)), which gradguard's actions cannot treat. Exclude it from the policy's rules, "
                "or compute a dense gradient."
            )
        seen = seen_at(index)
        if seen is not None and seen[0]() is grad:
            # A plain gradient's version inline (no call a tensor at every step); a DTensor's, both of its versions.
            version = local._version if local is grad else treated_version(grad, local)
            if seen[1] == version or (honour_explicit and seen[2]):
                continue  # already treated (and unchanged since, or at this step's explicit boundary)
        grads[index] = local
        if plan.placed and local is not grad and param is not None:
            placed.append((index, param, grad))
    if not placed:
        return grads, wrapped, None
    # Each gradient in its parameter's placements, a Partial one read through a reduced copy (distributed.placements).
    reduced = settle(placed)
    copies = reduced.copies if reduced is not None else {}
    for index, _, grad in placed:
        copy = copies[index][1] if index in copies else grad
        grads[index], wrapped[index] = local_tensor(copy), copy
    return grads, wrapped, reduced
