"""One verdict on every rank: the guard's collectives under ``torch.distributed``.

A guard that decides per rank either hangs the job (one rank halts, the others wait in the next
collective until the timeout) or desynchronises the replicas. So, whenever the default process group
(or the one given) has more than one rank, every enforcement pass makes the same collectives on
every rank, unconditionally, in the same order:

- one ``all_reduce(SUM)`` of the non-finite flags of every watched tensor (NaN and Inf counted
  separately), so a NaN injected on a single rank halts or skips every rank. Under DDP it is
  redundant only for a NaN/Inf made before DDP's all-reduce (which carries it to every rank: checked
  by ``tests/test_distributed.py``, scenario ``ddp_agreement``); one made on a rank after it (user
  code between ``backward()`` and ``step()``) or inside ``no_sync()`` reaches no other rank, and the
  step cannot tell which it is, so the collective stays;
- with FSDP2 (gradients are sharded ``DTensor``s), norms are computed on each rank's shard and
  combined (sum of p-th powers, or max for the inf-norm) before anything is decided, so per-tensor,
  group and global norms are those of the full, unsharded gradient. The non-finite flags ride in
  the same collective as the first norms.

Single-process use makes no collective at all.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradguard.enforce.distributed.local import LocalGradients

__all__ = ["Collective", "is_sharded", "local_tensor"]


_DTENSOR: type | None = None


def _dtensor_type() -> type | None:
    """``DTensor``, once something has imported it (no DTensor exists before): importing it costs half a second,
    so the guard, the audit and ``gradguard replay`` do not do it for runs that never shard."""
    global _DTENSOR
    if _DTENSOR is None:
        module = sys.modules.get("torch.distributed.tensor")
        _DTENSOR = getattr(module, "DTensor", None) if module is not None else None
    return _DTENSOR


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's sharded parameters and gradients)."""
    dtensor = _DTENSOR if _DTENSOR is not None else _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (in-place changes to it change the DTensor), or the tensor itself."""
    if is_sharded(tensor):
        local: torch.Tensor = tensor.to_local()  # type: ignore[attr-defined]
        return local
    return tensor


class Collective:
    """The process group the guard agrees over, or nothing when there is one rank."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.local = LocalGradients()
        """This rank's own gradient before the reduction, as the engine's tap notes it (``distributed.taps``)."""

    def active(self) -> bool:
        """Whether collectives are needed: torch.distributed is initialised with more than one rank."""
        if not (dist.is_available() and dist.is_initialized()):
            return False
        return bool(dist.get_world_size(self.group) > 1)

    def sum_(self, values: torch.Tensor) -> torch.Tensor:
        """All-reduce ``values`` in place by sum; one collective."""
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
        return values

    def max_(self, values: torch.Tensor) -> torch.Tensor:
        """All-reduce ``values`` in place by max; one collective."""
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values


def combine_shard_norms(collective: Collective, norms: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Turn per-shard norms into norms of the full tensors, with one collective."""
    if not norms:
        return []
    stacked = torch.stack([norm.float() for norm in norms])
    if math.isinf(norm_type):
        return list(collective.max_(stacked).unbind())
    powered = collective.sum_(stacked.abs().pow(norm_type))
    return list(powered.pow(1.0 / norm_type).unbind())
