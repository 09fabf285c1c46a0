"""The whole tensor's figures from DTensor pieces: FSDP2, tensor and sequence parallel, and both on a 2-D mesh.

A DTensor gradient lies on its device mesh in one of three ways per mesh dimension, and each asks something else of
a figure taken from this rank's local piece:

- ``Shard(d)``: the ranks along that dimension hold different pieces; their sums of squares add up.
- ``Replicate()``: they hold the same piece; summed over the ranks, it would be counted once per rank. Each rank's
  contribution to a sum is therefore weighted by its ``share``: the number of distinct pieces (the product of the
  sharded dimensions' sizes) over the number of ranks the sum runs over, so that every distinct piece counts once.
  A plain tensor beside DTensors (a parameter a TP plan left alone) is a replica on every rank: share ``1 / world``.
- ``Partial(op)``: each rank holds an addend of the gradient, not a piece of it (a SequenceParallel norm's weight);
  no figure of an addend is a figure of the gradient. ``settle`` reduces every Partial gradient before anything is
  read, one all-reduce each, as the optimizer would otherwise reduce it inside its own update (the same values to
  the last bit: one joined buffer would round differently on three ranks or more), and gives each gradient its
  parameter's placements (a row-wise
  embedding's gradient comes back ``Replicate`` while its weight is ``Shard(0)``; the update applies the rank's rows
  of it, and the per-unit actions must read those).

Maxima (the inf-norm, ``clip_value``'s peaks) and non-finite counts need no share: a replica changes neither.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ShareBook", "settle"]


def settle(pairs: Iterable[tuple[Any, Any]]) -> None:
    """Give each ``(parameter, DTensor gradient)``'s gradient its parameter's placements, reducing the Partial ones
    first (an all-reduce each, as the update would make them). Every rank of the mesh calls this with the same
    parameters in the same order (the plan's), so the all-reduces match."""
    unsettled = [
        (param, grad)
        for param, grad in pairs
        if (placements := getattr(grad, "placements", None)) is not None  # a DTensor's
        and placements != getattr(param, "placements", None)
    ]
    if not unsettled:
        return
    buckets: dict[tuple[int, int, str], tuple[Any, list[torch.Tensor]]] = {}
    for _, grad in unsettled:
        mesh = grad.device_mesh
        for dim, placement in enumerate(grad.placements):
            if placement.is_partial():
                key = (id(mesh), dim, str(placement.reduce_op))
                buckets.setdefault(key, (mesh, []))[1].append(grad.to_local())
    for (_, dim, op), (mesh, locals_) in buckets.items():
        _reduce_each(locals_, mesh.get_group(dim), op, mesh.size(dim))
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    for param, grad in unsettled:
        # The gradient object itself is changed, not replaced: whoever holds it (a clip that listed the gradients
        # before calling get_total_norm, which runs the guard's step) sees the reduced values under their placements.
        spec = grad._spec
        placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
        grad._spec = DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)
        if placements != param.placements:  # Replicate -> Shard: the rank's own rows, taken locally
            placed = grad.redistribute(param.device_mesh, param.placements)
            grad._local_tensor, grad._spec = placed._local_tensor, placed._spec


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
