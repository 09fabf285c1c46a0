"""``GradGuard(averages=...)``: averaged copies of the model that recovery rewinds with it (docs/recovery.md).

An EMA of the weights (timm's ``ModelEmaV3``, torch's ``AveragedModel``, a module the loop updates itself) is
updated after each optimizer step from the model. A rewind that restores the model and not its EMA leaves the
EMA with the undone steps' contributions; given here, its parameters and buffers are snapshotted with the model's,
restored in place, and its updates on the fault step and in the skip window are undone at the next boundary.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from torch import nn

__all__ = ["averages_given"]


def averages_given(given: Iterable[nn.Module] | nn.Module | None, model: nn.Module) -> list[weakref.ref[nn.Module]]:
    """The averages, checked: modules other than the guarded model (held weakly, as the model is)."""
    averages = [given] if isinstance(given, nn.Module) else list(given or ())
    for average in averages:
        if not isinstance(average, nn.Module):
            raise TypeError(
                "averages must be nn.Modules (averaged copies of the model: timm's ModelEmaV3, torch's AveragedModel, "
                f"a deep copy the loop updates), got {type(average).__name__}"
            )
        if average is model:
            raise ValueError(
                f"averages: {type(average).__name__} is the guarded model itself; pass its averaged copy (the EMA)"
            )
    return [weakref.ref(average) for average in averages]
