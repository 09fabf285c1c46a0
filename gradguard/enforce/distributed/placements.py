"""The whole tensor's figures from DTensor pieces: FSDP2, tensor and sequence parallel, and both on a 2-D mesh.

A DTensor gradient lies on its device mesh in one of three ways per mesh dimension, and each asks something else of
a figure taken from this rank's local piece:

- ``Shard(d)``: the ranks along that dimension hold different pieces; their sums of squares add up.
- ``Replicate()``: they hold the same piece; summed over the ranks, it would be counted once per rank. Each rank's
  contribution to a sum is therefore weighted by its ``share``: the number of distinct pieces (the product of the
  sharded dimensions' sizes) over the number of ranks the sum runs over, so that every distinct piece counts once.
  A plain tensor beside DTensors (a parameter a TP plan left alone) is a replica on every rank: share ``1 / world``.
- ``Partial(op)``: each rank holds an addend of the gradient, not a piece of it (a SequenceParallel norm's weight);
  no figure of an addend is a figure of the gradient. ``settle`` reads every Partial gradient through a copy, reduced
  before anything is read, one all-reduce each, as the optimizer would reduce it inside its own update (the same
  values to the last bit: one joined buffer would round differently on three ranks or more). The gradient itself is
  left as it came (``Reduced.install`` gives it the copy only where an action changed the copy): the loop's clip,
  which runs after the guard's step, scales each rank's addend and the update sums them, as without a guard; scaling
  their sum rounds otherwise. Two copies of the Partial gradients (small: norms' weights) live for the step.
- A gradient whose placements differ from its parameter's without a Partial one is given its parameter's in place (a
  row-wise embedding's gradient comes back ``Replicate`` while its weight is ``Shard(0)``; the update applies the
  rank's rows of it, and the per-unit actions must read those): its rows, taken locally, are the ones the update
  takes.

Maxima (the inf-norm, ``clip_value``'s peaks) and non-finite counts need no share: a replica changes neither.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Reduced", "ShareBook", "settle"]


def settle(placed: Iterable[tuple[int, Any, Any]]) -> Reduced | None:
    """Give each ``(index, parameter, DTensor gradient)`` its parameter's placements: in place where it has no Partial
    one; a Partial gradient is left as it is, and a copy of it, reduced (an all-reduce each, as the update would
    reduce it) and placed so, is read instead (``Reduced``; None: no Partial gradient). Every rank of the mesh calls
    this with the same parameters in the same order (the plan's), so the all-reduces match."""
    unsettled = [
        (index, param, grad)
        for index, param, grad in placed
        if (placements := getattr(grad, "placements", None)) is not None  # a DTensor's
        and placements != getattr(param, "placements", None)
    ]
    if not unsettled:
        return None
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    buckets: dict[tuple[int, int, str], tuple[Any, list[torch.Tensor]]] = {}
    reduced, targets = Reduced(), []
    for index, param, grad in unsettled:
        mesh, target = grad.device_mesh, grad
        for dim, placement in enumerate(grad.placements):
            if placement.is_partial():
                if target is grad:  # the copy: contiguous, as the all-reduce takes it
                    local = grad._local_tensor.clone(memory_format=torch.contiguous_format)
                    target = DTensor(local, grad._spec, requires_grad=False)  # type: ignore[no-untyped-call]
                key = (id(mesh), dim, str(placement.reduce_op))
                buckets.setdefault(key, (mesh, []))[1].append(target._local_tensor)
        targets.append((index, param, grad, target))
    for (_, dim, op), (mesh, locals_) in buckets.items():
        _reduce_each(locals_, mesh.get_group(dim), op, mesh.size(dim))
    for index, param, grad, target in targets:
        spec = target._spec
        placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
        target._spec = DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)
        if placements != param.placements:  # Replicate -> Shard: the rank's own rows, taken locally
            rows = target.redistribute(param.device_mesh, param.placements)
            target._local_tensor, target._spec = rows._local_tensor, rows._spec
        if target is not grad:
            reduced.copies[index] = (grad, target, target._local_tensor.clone())
    return reduced if reduced.copies else None


class Reduced:
    """The Partial gradients a step reads through reduced copies (``settle``), and those its actions changed.

    A change is told by values, not by versions: an action that multiplies on the device by a coefficient that came
    out 1 (a clip that did not clip) writes a gradient without changing it. So each copy's values as reduced are
    kept beside it, and after the step's device work whether each copy still holds them rides the step's one read
    (``watch``); a write after the read (a change the read showed was needed) is told by the copy's version.
    """

    def __init__(self) -> None:
        self.copies: dict[int, tuple[Any, Any, torch.Tensor]] = {}
        """Tensor index -> (the Partial gradient, its reduced copy, the copy's local values as reduced)."""
        self._versions: dict[int, int] = {}
        self._changed: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.copies)

    def watch(self, pending: Any) -> None:
        """After the step's device work: each copy's largest difference from its values as reduced, read with the rest
        by ``pending`` (the step's ``Pending``): a NaN or Inf in it counts as a change."""
        ids = [index for index, (_, copy, _) in self.copies.items() if copy._local_tensor.numel()]
        self._versions = {index: copy._local_tensor._version for index, (_, copy, _) in self.copies.items()}
        if not ids:
            return
        copies = [self.copies[index][1]._local_tensor for index in ids]
        gaps = torch._foreach_norm(torch._foreach_sub(copies, [self.copies[index][2] for index in ids]), math.inf)

        def read(values: list[float]) -> None:
            self._changed = {index for index, gap in zip(ids, values, strict=True) if gap != 0.0}

        pending.add(gaps[0], read, *gaps[1:])

    def install(self) -> None:
        """After the step's changes: a Partial gradient whose copy one changed takes the copy's values and placements,
        in the gradient object itself (a clip that listed the gradients before calling ``get_total_norm``, which runs
        the guard's step, sees them); the others stay Partial, as they came, for the loop's clip and the update."""
        changed, versions = self._changed, self._versions
        for index, (grad, copy, _) in self.copies.items():
            local = copy._local_tensor
            if index in changed or local._version != versions.get(index):
                grad._local_tensor, grad._spec = local, copy._spec


def _reduce_each(locals_: list[torch.Tensor], group: Any, op: str, size: int) -> None:
    """All-reduce each of ``locals_`` in place, one collective each (all in flight at once), as DTensor's own
    redistribution in the update would: one joined buffer rounds differently on three ranks or more (the order in which
    an element's pieces are summed follows its place in the buffer), and a healthy step would not be the unguarded
    one to the last bit."""
    dense = [local if local.is_contiguous() else local.contiguous() for local in locals_]
    for work in [dist.all_reduce(each, op=dist.ReduceOp.SUM, group=group, async_op=True) for each in dense]:
        work.wait()
    for local, each in zip(locals_, dense, strict=True):
        if op == "avg":
            each /= size
        if each is not local:
            local.copy_(each)


class ShareBook:
    """Each guarded tensor's share of a sum over the ranks, kept per tensor index while its placements stay the
    same (asked at every step of a DTensor run: a comparison per tensor, not the mesh's arithmetic)."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[Any, float]] = {}

    def shares(
        self, grads: dict[int, torch.Tensor], wrapped: dict[int, torch.Tensor], world: int
    ) -> dict[int, float] | None:
        """Tensor index -> its share, for ``grads`` of which ``wrapped`` are DTensors; None where every share is 1
        (FSDP2 alone: every rank holds a different piece of every tensor)."""
        known, plain = self._known, 1.0 / world
        out: dict[int, float] = {}
        whole = True
        for index in grads:
            dtensor = wrapped.get(index)
            if dtensor is None:
                share = plain
            else:
                spec = dtensor._spec  # type: ignore[attr-defined]
                seen = known.get(index)
                if seen is not None and seen[0] == spec.placements:
                    share = seen[1]
                else:
                    share = share_of(spec.mesh, spec.placements, world)
                    known[index] = (spec.placements, share)
            out[index] = share
            whole = whole and share == 1.0
        return None if whole else out


def share_of(mesh: Any, placements: Iterable[Any], world: int) -> float:
    """The distinct pieces of a tensor placed so on ``mesh``, over the ``world`` ranks a sum runs over."""
    # Any placement that is neither a replica nor an addend splits the tensor (FSDP2 over TP's ``_StridedShard`` is
    # no ``Shard`` to ``is_shard()``).
    distinct = math.prod(
        mesh.size(dim)
        for dim, placement in enumerate(placements)
        if not placement.is_replicate() and not placement.is_partial()
    )
    return min(float(distinct) / world, 1.0)
