"""Where a rank's piece of a gradient lies in its parameter (``Place``), where each rank holds a flat piece of each
gradient (DeepSpeed ZeRO): what the actions that need the whole tensor's layout or its weights read beside the piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gradguard.enforce.distributed.collective import local_tensor
from gradguard.policy.matching import GuardedParam

__all__ = ["Place", "weights_at"]


@dataclass(frozen=True)
class Place:
    """Where this rank's piece of a gradient lies in its parameter, where a rank holds a flat piece of each gradient
    (DeepSpeed ZeRO): the figures that need the whole tensor's layout (``agc``'s units) or its weights are taken of
    the pieces and combined over the ranks."""

    start: int
    """The piece's first element in the parameter's flat (row-major) elements."""
    shape: tuple[int, ...]
    """The whole parameter's shape (ZeRO 3 parameters are empty between forwards: not ``param.shape``)."""
    weight: torch.Tensor
    """The parameter's elements at the piece's places (1-D, the piece's length): this rank's piece of the weights."""
    hold: Callable[[], None] | None = None
    """``drop``: keep the parameter as it is through the coming update (its piece is zeroed besides); None: not
    possible here."""


def weights_at(params: Sequence[GuardedParam], places: dict[int, Place], ids: Sequence[int]) -> list[torch.Tensor]:
    """The weights of tensors ``ids`` where their gradients are: at ``places`` (DeepSpeed's pieces), else the
    parameter (this rank's shard under FSDP2), so that figures of both are combined over the ranks the same way.
    The engine runs under ``torch.no_grad``."""
    out = []
    for index in ids:
        if (place := places.get(index)) is not None:
            out.append(place.weight)
            continue
        param = params[index].ref()
        assert param is not None, "a tensor with a gradient this step is alive"
        out.append(local_tensor(param))
    return out
